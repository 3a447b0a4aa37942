"""FAISS index choice follows the documented rules; IVF-PQ with refinement finds what exact search finds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ragspec.errors import RagspecError
from ragspec.index import faiss_index
from ragspec.index.faiss_index import MIN_PER_LIST, plan_index, pq_subquantizers


def test_small_corpora_use_exact_search():
    assert plan_index(1000, 384).factory == "Flat"
    assert plan_index(20_000, 384).kind == "flat"
    assert plan_index(50, 384, "ivfpq").kind == "flat"  # too few vectors to train any list


def test_ivfpq_rules():
    p = plan_index(40_000, 384)
    assert p.kind == "ivfpq"
    assert p.nlist == round(4 * math.sqrt(40_000)) == 800
    assert p.m == 48 and p.nbits == 8 and p.nprobe == 16
    assert p.factory == "IVF800,PQ48x8,RFlat"
    q = plan_index(5_000, 384, "ivfpq")
    assert q.nlist * MIN_PER_LIST <= 5_000  # never more lists than the training set supports
    assert q.nbits < 8
    assert pq_subquantizers(1024) == 64 and pq_subquantizers(384) == 48 and pq_subquantizers(768) == 96
    assert plan_index(40_000, 384, refine=False).factory == "IVF800,PQ48x8"


def test_paper_factory_is_selectable_but_checked():
    assert plan_index(10**6, 1024, factory="IVF4096,PQ64").factory == "IVF4096,PQ64"
    with pytest.raises(RagspecError, match="needs ≥ 159744 vectors"):
        plan_index(10_000, 1024, factory="IVF4096,PQ64")


def clustered(n, dim, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(64, dim))
    x = centers[rng.integers(0, 64, n)] + 0.3 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_ivfpq_recall_against_exact(tmp_path):
    x = clustered(12_000, 64)
    q = clustered(200, 64, seed=1)
    exact = faiss_index.build(x, plan_index(len(x), 64, "flat"))
    plan = plan_index(len(x), 64, "ivfpq")
    ann = faiss_index.build(x, plan)
    faiss_index.write(ann, tmp_path / "a.index")
    ann = faiss_index.read(tmp_path / "a.index", plan.as_dict())
    _, e = faiss_index.search(exact, q, 10)
    _, a = faiss_index.search(ann, q, 10)
    recall = np.mean([len(set(e[i]) & set(a[i])) / 10 for i in range(len(q))])
    assert recall >= 0.9, recall
