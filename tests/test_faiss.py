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


def test_spilled_index_keeps_each_vector_in_two_lists_and_returns_each_id_once(tmp_path):
    import faiss

    x = clustered(6_000, 64)
    q = clustered(100, 64, seed=2)
    plan = plan_index(len(x), 64, "ivfpq")
    assert plan.spill == 1 and plan.as_dict()["spill_rule"].startswith("soar")
    ann = faiss_index.build(x, plan)
    assert faiss.extract_index_ivf(ann).ntotal == 2 * len(x) and ann.ntotal == len(x)
    faiss_index.write(ann, tmp_path / "s.index")
    ann = faiss_index.read(tmp_path / "s.index", plan.as_dict())
    scores, ids = faiss_index.search(ann, q, 10)
    assert ids.shape == (100, 10) and (ids >= 0).all()
    for row, srow in zip(ids, scores):
        assert len(set(row.tolist())) == 10
        assert (np.diff(srow) <= 1e-6).all()  # still best first
    exact = faiss_index.build(x, plan_index(len(x), 64, "flat"))
    _, e = faiss_index.search(exact, q, 10)
    plain = faiss_index.build(x, plan_index(len(x), 64, "ivfpq", spill=0))
    _, a0 = faiss_index.search(plain, q, 10)
    recall = [np.mean([len(set(e[i]) & set(a[i])) / 10 for i in range(len(q))]) for a in (a0, ids)]
    assert recall[1] >= recall[0], recall


def test_refined_scores_are_exact_inner_products():
    x = clustered(6_000, 64)
    q = clustered(20, 64, seed=3)
    ann = faiss_index.build(x, plan_index(len(x), 64, "ivfpq"))
    scores, ids = faiss_index.search(ann, q, 5)
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", q, x[ids]), rtol=1e-5, atol=1e-5)


def test_soar_assignment_rules():
    rng = np.random.default_rng(0)
    c = rng.normal(size=(20, 8)).astype(np.float32)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    l2 = ((x[:, None, :] - c[None]) ** 2).sum(-1)
    primary = l2.argmin(1)
    taken = primary[:, None]
    second = faiss_index.soar_assign(x, c, primary, taken, lam=0.0, block=64)
    np.testing.assert_array_equal(second, np.argsort(l2, axis=1)[:, 1])  # λ = 0: the next-nearest list
    soar = faiss_index.soar_assign(x, c, primary, taken, lam=1.0, block=64)
    assert (soar != primary).all()
    third = faiss_index.soar_assign(x, c, primary, np.stack([primary, soar], 1), block=64)
    assert (third != primary).all() and (third != soar).all()


def test_spilling_needs_the_exact_reranking():
    assert plan_index(40_000, 384, refine=False).spill == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_exact_search_matches_flat_faiss(device):
    """Where FAISS has no GPU build, a cuda index searches exactly in torch: same ids and scores as FAISS's flat
    index, filters applied inside (fewer allowed than k leaves -1s, as FAISS does)."""
    import torch

    from ragspec.index.torch_search import TorchExactIndex

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((500, 48)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[:7] + 0.1 * rng.standard_normal((7, 48)).astype(np.float32)
    flat = faiss_index.build(x, plan_index(len(x), 48, "flat"))
    exact = TorchExactIndex(x, device)
    s1, i1 = faiss_index.search(flat, q, 10)
    s2, i2 = faiss_index.search(exact, q, 10)
    assert (i1 == i2).all() and np.allclose(s1, s2, atol=1e-5)
    allowed = np.array([3, 40, 41, 499], dtype=np.int64)
    s1, i1 = faiss_index.search(flat, q, 10, allowed)
    s2, i2 = faiss_index.search(exact, q, 10, allowed)
    assert (i1 == i2).all() and np.allclose(s1[i1 >= 0], s2[i2 >= 0], atol=1e-5)
    assert set(i2[0]) == set(allowed.tolist())
