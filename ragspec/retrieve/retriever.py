"""Retrieval stages over one index: dense top-k, BM25 (both restricted by a metadata filter inside the search),
reciprocal-rank fusion, optional cross-encoder, optional MMR, then distinct sources (`sources`)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ragspec.errors import RagspecError, loading
from ragspec.index.filters import as_filter
from ragspec.index.reader import Index
from ragspec.retrieve.fusion import rrf
from ragspec.retrieve.mmr import mmr
from ragspec.retrieve.sources import Location, group_candidates
from ragspec.settings import RetrieverSettings

MMR_POOL = 4  # MMR reorders the best top_n × this fused candidates (at least 20)


@dataclass
class Hit:
    """One source: a retrieved chunk, or neighbouring chunks of one document merged into one span. `start`/`end`
    are character offsets into the document text (for plain-text files: into the file as
    `open(path, newline="").read()` returns it). `locations` lists every place the text is found, this one
    first: copies of it in other documents, and chunks mostly contained in it."""

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
    chunk_ids: list[int] = field(default_factory=list)  # the chunks this span covers
    locations: list[Location] = field(default_factory=list)  # [0] is this span; paths as given to `ragspec index`

    def as_json(self) -> dict:
        d = asdict(self)
        out = {k: d[k] for k in ("rank", "score", "path", "start", "end", "text", "chunk_id", "key", "title",
                                 "stages", "document_id", "chunk_ids")}
        out["locations"] = [{"path": loc.path, "key": loc.key, "start": loc.start, "end": loc.end, "document_id": loc.document_id,
                             "chunk_ids": list(loc.chunk_ids), "kind": loc.kind} for loc in self.locations]
        return out


class Retriever:
    """Search one index. Thread-safe: the embedder and reranker are guarded by a lock."""

    def __init__(self, index: Index | str, settings: RetrieverSettings | None = None, embedder=None,
                 device: str = "cpu"):
        self.index = index if isinstance(index, Index) else Index(index, device=device)
        self.settings = settings = settings or RetrieverSettings()
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
                with loading():
                    self._embedder = load_embedder(e["requested"], self._device, e["dtype"], e.get("max_tokens"))
            return self._embedder

    def embed_query(self, query: str) -> np.ndarray:
        emb = self.embedder
        with self._lock:
            return emb.encode([query])[0]

    def dense(self, query: str | np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        from ragspec.index import faiss_index

        if allowed is not None and len(allowed) == 0:
            return []
        vec = self.embed_query(query) if isinstance(query, str) else query
        scores, ids = faiss_index.search(self.index.faiss, vec, k, allowed)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def bm25(self, query: str, k: int, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        if self.index.bm25 is None:
            return []
        ids, scores = self.index.bm25.search(query, k, allowed)
        return [(int(i), float(s)) for i, s in zip(ids, scores)]

    def rerank(self, query: str, candidates: list[tuple[int, float]]) -> list[tuple[int, float]]:
        if not self.settings.reranker or not candidates:
            return candidates
        with self._lock:
            if self._reranker is None:
                from ragspec.retrieve.rerank import CrossEncoderReranker

                with loading():
                    self._reranker = CrossEncoderReranker(self.settings.reranker, self._device)
        rows = self.index.store.chunks([c for c, _ in candidates])
        scores = self._reranker.scores(query, [r.text for r in rows])
        return sorted(zip([r.id for r in rows], scores), key=lambda x: -x[1])

    # -- the whole stage ---------------------------------------------------------------------------------
    def allowed(self, flt) -> np.ndarray | None:
        """Chunk ids a filter (any accepted form) keeps, None for no filter."""
        flt = as_filter(flt)
        return None if flt is None else self.index.allowed_chunks(flt)

    def candidates(self, query: str, k: int | None = None, filter=None) -> tuple[list[tuple[int, float]], dict]:
        """Fused first-stage candidates (id, score), best first, plus per-stage scores and timings. `filter`
        (default: the settings' filter) restricts both stages inside their search."""
        k = k or self.settings.top_k
        per_stage: dict[str, dict[int, float]] = {}
        timings: dict[str, float] = {}
        rankings = []
        t = time.perf_counter()
        allowed = self.allowed(self.settings.filter if filter is None else filter)
        if allowed is not None:
            timings["filter_ms"] = (time.perf_counter() - t) * 1000
        if self.settings.mode in ("hybrid", "dense"):
            t = time.perf_counter()
            query_vec = self.embed_query(query)
            d = self.dense(query_vec, k, allowed)
            timings["dense_ms"] = (time.perf_counter() - t) * 1000
            per_stage["dense"] = dict(d)
            rankings.append([i for i, _ in d])
        if self.settings.mode in ("hybrid", "bm25") and self.index.bm25 is not None:
            t = time.perf_counter()
            b = self.bm25(query, k, allowed)
            timings["bm25_ms"] = (time.perf_counter() - t) * 1000
            per_stage["bm25"] = dict(b)
            rankings.append([i for i, _ in b])
        if len(rankings) == 1:
            name = next(iter(per_stage))
            fused = list(per_stage[name].items())
        else:
            fused = rrf(rankings, self.settings.rrf_k)[:k]
        info = {"stages": per_stage, "timings": timings, "allowed": allowed}
        if self.settings.mode in ("hybrid", "dense"):
            info["query_vector"] = query_vec
        return fused, info

    def diversify(self, query: str, ranked: list[tuple[int, float]], top_n: int, info: dict,
                  diversity: float) -> list[tuple[int, float]]:
        """MMR over the best `MMR_POOL × top_n` candidates with their stored embeddings; the rest keep their
        order behind them."""
        pool = max(MMR_POOL * top_n, 20)
        head, tail = ranked[:pool], ranked[pool:]
        if diversity <= 0 or len(head) < 2:
            return ranked
        q = info.get("query_vector")
        if q is None:
            q = self.embed_query(query)
        vecs = np.asarray(self.index.embeddings[[c for c, _ in head]], dtype=np.float32)
        return [head[i] for i in mmr(q, vecs, diversity)] + tail

    def search(self, query: str, top_n: int | None = None, top_k: int | None = None, filter=None,
               diversity: float | None = None) -> list[Hit]:
        """The `top_n` best distinct sources. `filter`: a metadata filter (dict or --where strings; default the
        settings' one); `diversity`: MMR strength (default the settings')."""
        if not query or not query.strip():
            raise RagspecError("the query is empty")
        top_n = top_n or self.settings.top_n
        fused, info = self.candidates(query, top_k, filter)
        if self.settings.reranker:
            t = time.perf_counter()
            fused = self.rerank(query, fused)
            info["timings"]["rerank_ms"] = (time.perf_counter() - t) * 1000
        fused = self.diversify(query, fused, top_n, info,
                               self.settings.diversity if diversity is None else diversity)
        store = self.index.store
        groups = group_candidates(fused, store, top_n, store.document_text, self.settings.merge,
                                  self.settings.containment)
        hits = []
        for rank, g in enumerate(groups, 1):
            p = g.primary
            cid = p.chunk_ids[0]
            stages = {name: round(s[cid], 6) for name, s in info["stages"].items() if cid in s}
            locations = [Location(loc.document_id, self.index.source_path(loc.path), loc.key, loc.title, loc.start, loc.end,
                                  loc.text, list(loc.chunk_ids), loc.kind) for loc in g.locations]
            hits.append(Hit(rank, float(g.score), cid, p.document_id, locations[0].path, p.key, p.title, p.start,
                            p.end, p.text, stages, list(p.chunk_ids), locations))
        return hits
