"""`ragspec eval-retrieval`: nDCG@10, Recall@100, MRR@10 per stage on a BEIR-layout set, plus ANN recall."""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.eval.metrics import mrr_at, ndcg_at, recall_at
from ragspec.index.reader import Index
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import RetrieverSettings


def load_queries(path: Path) -> dict[str, str]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise RagspecError(f"{path}: line {n} is not JSON") from None
                out[str(obj.get("_id", obj.get("id")))] = obj["text"]
    return out


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """query id → {doc id: grade}; a header line (query-id …) is skipped."""
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for row in csv.reader(f, delimiter="\t"):
            if len(row) < 3 or not row[2].strip().lstrip("-").isdigit():
                continue
            qrels.setdefault(row[0], {})[row[1]] = int(row[2])
    return qrels


def doc_ranking(index: Index, chunk_ranking: list[tuple[int, float]]) -> list[str]:
    """Chunk ranking → document-key ranking (a document ranks where its best chunk ranks)."""
    rows = index.store.chunks([c for c, _ in chunk_ranking])
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r.key or r.path, None)
    return list(seen)


def source_doc_ranking(hits) -> list[str]:
    """Sources (after merging, duplicate collapsing and diversity) → document keys: each source's locations in
    order, the primary first (a copied or contained passage retrieves its document at the source's rank)."""
    seen: dict[str, None] = {}
    for h in hits:
        for loc in h.locations:
            seen.setdefault(loc.key or loc.path, None)
    return list(seen)


def evaluate(index: Index, queries: dict[str, str], qrels: dict[str, dict[str, int]], ann_index: Index | None = None,
             limit: int | None = None, reranker: str | None = None, progress=None) -> dict:
    qids = [q for q in queries if q in qrels][: limit or None]
    if not qids:
        raise RagspecError("no query has qrels: check that the queries and qrels files belong together")
    retriever = Retriever(index, RetrieverSettings(top_k=100, top_n=100, reranker=reranker))
    stages = {"dense": [], "bm25": [], "hybrid": [], "sources": []}
    if reranker:
        stages["reranked"] = []
    ann_recalls = []
    sweep = {p: [] for p in (8, 16, 32, 64)}  # ANN recall@10 as a function of nprobe
    ann_ret = Retriever(ann_index, RetrieverSettings(mode="dense"), embedder=retriever.embedder) if ann_index else None
    dense_ms = []
    for qid in qids:
        q = queries[qid]
        rel = qrels[qid]
        vec = retriever.embed_query(q)
        t = time.perf_counter()
        dense = retriever.dense(vec, 300)
        dense_ms.append((time.perf_counter() - t) * 1000)
        bm25 = retriever.bm25(q, 300)
        from ragspec.retrieve.fusion import rrf

        hybrid = rrf([[i for i, _ in dense], [i for i, _ in bm25]], retriever.settings.rrf_k)
        runs = {"dense": dense, "bm25": bm25, "hybrid": hybrid}
        if reranker:
            runs["reranked"] = retriever.rerank(q, hybrid[:100])
        ranked_by = {name: doc_ranking(index, run) for name, run in runs.items()}
        # what an ask gets: the retriever's sources with the default settings (duplicates, neighbours, diversity)
        ranked_by["sources"] = source_doc_ranking(retriever.search(q, top_n=100))
        for name, ranked in ranked_by.items():
            stages[name].append((ndcg_at(ranked, rel, 10), recall_at(ranked, rel, 100), mrr_at(ranked, rel, 10)))
        if ann_ret is not None:
            exact = [i for i, _ in dense[:10]]
            approx = [i for i, _ in ann_ret.dense(vec, 10)]
            ann_recalls.append(len(set(exact) & set(approx)) / max(1, len(exact)))
            default = ann_index.manifest["faiss"]["nprobe"]
            for p in sweep:
                ann_index.set_nprobe(p)
                got = [i for i, _ in ann_ret.dense(vec, 10)]
                sweep[p].append(len(set(exact) & set(got)) / max(1, len(exact)))
            ann_index.set_nprobe(default)
        if progress:
            progress()
    result = {
        "queries": len(qids),
        "stages": {
            name: {
                "ndcg@10": round(statistics.fmean(v[0] for v in vals), 4),
                "recall@100": round(statistics.fmean(v[1] for v in vals), 4),
                "mrr@10": round(statistics.fmean(v[2] for v in vals), 4),
            }
            for name, vals in stages.items()
            if vals
        },
        "ann_recall@10": round(statistics.fmean(ann_recalls), 4) if ann_recalls else None,
        "ann_recall@10_by_nprobe": {str(p): round(statistics.fmean(v), 4) for p, v in sweep.items() if v} or None,
        "ann_factory": ann_index.manifest["faiss"]["factory"] if ann_index else None,
        "ann_nprobe": ann_index.manifest["faiss"]["nprobe"] if ann_index else None,
        "exact_factory": index.manifest["faiss"]["factory"],
        "embedder": index.manifest["embedder"]["name"],
        "embed_dtype": index.manifest["embedder"]["dtype"],
        "dense_search_ms_p50": round(statistics.median(dense_ms), 3),
    }
    return result
