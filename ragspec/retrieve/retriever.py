"""Retrieval stages over one index: dense top-k, BM25, reciprocal-rank fusion, optional cross-encoder."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ragspec.errors import RagspecError
from ragspec.index.reader import Index
from ragspec.retrieve.fusion import rrf
from ragspec.settings import RetrieverSettings


@dataclass
class Hit:
    """One retrieved chunk. `start`/`end` are character offsets into the document text (for plain-text files:
    into the file as `open(path, newline="").read()` returns it)."""

    rank: int
    score: float
    chunk_id: int
    document_id: int
    path: str  # the source file as given to `ragspec index`
    key: str  # JSON record id, "" for whole files
    title: str
    start: int
    end: int
    text: str
    stages: dict = field(default_factory=dict)  # per-stage scores, e.g. {"dense": .81, "bm25": 12.3}

    def as_json(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in ("rank", "score", "path", "start", "end", "text", "chunk_id", "key", "title", "stages")}


class Retriever:
    """Search one index. Thread-safe: the embedder and reranker are guarded by a lock."""

    def __init__(self, index: Index | str, settings: RetrieverSettings = RetrieverSettings(), embedder=None,
                 device: str = "cpu"):
        self.index = index if isinstance(index, Index) else Index(index, device=device)
        self.settings = settings
        self._embedder = embedder
        self._device = device
        self._reranker = None
        self._lock = threading.Lock()
        if settings.mode == "bm25" and self.index.bm25 is None:
            raise RagspecError(f"index {self.index.path} was built without BM25; rebuild it or use mode: dense")
        if settings.nprobe:
            self.index.set_nprobe(settings.nprobe)

    # -- stages ------------------------------------------------------------------------------------------
    @property
    def stages(self) -> list[str]:
        """Which stages run, in order (what `ragspec info` reports)."""
        s = []
        if self.settings.mode in ("hybrid", "dense"):
            s.append(f"dense ({self.index.manifest['embedder']['name']}, FAISS {self.index.manifest['faiss']['factory']})")
        if self.settings.mode in ("hybrid", "bm25") and self.index.bm25 is not None:
            s.append("bm25")
        if len(s) == 2:
            s.append(f"rrf (k={self.settings.rrf_k})")
        s.append(f"rerank ({self.settings.reranker})" if self.settings.reranker else "no reranker (none configured)")
        return s

    @property
    def embedder(self):
        with self._lock:
            if self._embedder is None:
                from ragspec.models.embedder import load_embedder

                e = self.index.manifest["embedder"]
                self._embedder = load_embedder(e["requested"], self._device, e["dtype"], e.get("max_tokens"))
            return self._embedder

    def embed_query(self, query: str) -> np.ndarray:
        emb = self.embedder
        with self._lock:
            return emb.encode([query])[0]

    def dense(self, query: str | np.ndarray, k: int) -> list[tuple[int, float]]:
        from ragspec.index import faiss_index

        vec = self.embed_query(query) if isinstance(query, str) else query
        scores, ids = faiss_index.search(self.index.faiss, vec, k)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def bm25(self, query: str, k: int) -> list[tuple[int, float]]:
        if self.index.bm25 is None:
            return []
        ids, scores = self.index.bm25.search(query, k)
        return [(int(i), float(s)) for i, s in zip(ids, scores)]

    def rerank(self, query: str, candidates: list[tuple[int, float]]) -> list[tuple[int, float]]:
        if not self.settings.reranker or not candidates:
            return candidates
        with self._lock:
            if self._reranker is None:
                from ragspec.retrieve.rerank import CrossEncoderReranker

                self._reranker = CrossEncoderReranker(self.settings.reranker, self._device)
        rows = self.index.store.chunks([c for c, _ in candidates])
        scores = self._reranker.scores(query, [r.text for r in rows])
        return sorted(zip([r.id for r in rows], scores), key=lambda x: -x[1])

    # -- the whole stage ---------------------------------------------------------------------------------
    def candidates(self, query: str, k: int | None = None) -> tuple[list[tuple[int, float]], dict]:
        """Fused first-stage candidates (id, score), best first, plus per-stage scores and timings."""
        k = k or self.settings.top_k
        per_stage: dict[str, dict[int, float]] = {}
        timings: dict[str, float] = {}
        rankings = []
        if self.settings.mode in ("hybrid", "dense"):
            t = time.perf_counter()
            d = self.dense(query, k)
            timings["dense_ms"] = (time.perf_counter() - t) * 1000
            per_stage["dense"] = dict(d)
            rankings.append([i for i, _ in d])
        if self.settings.mode in ("hybrid", "bm25") and self.index.bm25 is not None:
            t = time.perf_counter()
            b = self.bm25(query, k)
            timings["bm25_ms"] = (time.perf_counter() - t) * 1000
            per_stage["bm25"] = dict(b)
            rankings.append([i for i, _ in b])
        if len(rankings) == 1:
            name = next(iter(per_stage))
            fused = list(per_stage[name].items())
        else:
            fused = rrf(rankings, self.settings.rrf_k)[:k]
        return fused, {"stages": per_stage, "timings": timings}

    def search(self, query: str, top_n: int | None = None, top_k: int | None = None) -> list[Hit]:
        if not query or not query.strip():
            raise RagspecError("the query is empty")
        top_n = top_n or self.settings.top_n
        fused, info = self.candidates(query, top_k)
        if self.settings.reranker:
            t = time.perf_counter()
            fused = self.rerank(query, fused)
            info["timings"]["rerank_ms"] = (time.perf_counter() - t) * 1000
        fused = fused[:top_n]
        rows = {r.id: r for r in self.index.store.chunks([i for i, _ in fused])}
        hits = []
        for rank, (cid, score) in enumerate(fused, 1):
            r = rows[cid]
            stages = {name: round(s[cid], 6) for name, s in info["stages"].items() if cid in s}
            hits.append(Hit(rank, float(score), cid, r.document, self.index.source_path(r.path), r.key, r.title,
                            r.start, r.end, r.text, stages))
        return hits
