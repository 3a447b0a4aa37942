"""Query latency of the retrieval stages (`ragspec bench-search`): measured, never asserted in tests."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from ragspec.index import faiss_index
from ragspec.index.reader import Index


def sample_queries(index: Index, path: Path | None, n: int, seed: int = 0) -> list[str]:
    """Queries from a file, or the first sentence of `n` chunks sampled with a fixed seed."""
    if path is not None:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        out = []
        for line in lines:
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                out.append(json.loads(line)["text"])
            else:
                out.append(line.strip())
        return out[:n]
    total = index.store.count_chunks()
    ids = random.Random(seed).sample(range(total), min(n, total))
    out = []
    for row in index.store.chunks(ids):
        words = " ".join(row.text.split()).split(". ")[0].split()[:16]
        out.append(" ".join(words) or row.title)
    return out


def percentiles(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p95": round(float(np.percentile(a, 95)), 3),
            "mean": round(float(a.mean()), 3)}


def bench_queries(retriever, queries: list[str], k: int = 100) -> dict:
    retriever.search(queries[0])  # warm-up: loads the embedder, FAISS and BM25
    embed, dense, bm25, whole = [], [], [], []
    for q in queries:
        t0 = time.perf_counter()
        vec = retriever.embed_query(q)
        t1 = time.perf_counter()
        faiss_index.search(retriever.index.faiss, vec, k)
        t2 = time.perf_counter()
        retriever.bm25(q, k)
        t3 = time.perf_counter()
        retriever.search(q)
        t4 = time.perf_counter()
        embed.append((t1 - t0) * 1000)
        dense.append((t2 - t1) * 1000)
        bm25.append((t3 - t2) * 1000)
        whole.append((t4 - t3) * 1000)
    return {
        "queries": len(queries),
        "chunks": retriever.index.store.count_chunks(),
        "faiss": retriever.index.manifest["faiss"]["factory"],
        "stages": retriever.stages,
        "latency_ms": {
            "dense_search (FAISS)": percentiles(dense),
            "query_embedding": percentiles(embed),
            "bm25": percentiles(bm25),
            "retrieval_stage": percentiles(whole),
        },
        "mean_retrieval_ms": round(statistics.fmean(whole), 3),
    }
