"""FAISS index choice, training and search: exact for small corpora, IVF-PQ above that.

The rules (written to the manifest): inner product on unit vectors; IVF lists ≈ 4·√N but never fewer than
39 training vectors per list; PQ sub-quantizers dividing the dimension (64 for 1024-d bge-m3 as in the
paper, 48 for 384-d MiniLM); an optional exact re-ranking of the PQ shortlist (`RFlat`).

Spilling: with re-ranking on, every vector is also stored in one more list, chosen by SOAR's rule (Sun et al.,
"SOAR: improved indexing for approximate nearest neighbor search", NeurIPS 2023): the list whose residual is
short *and* nearly orthogonal to the primary residual, so a query that misses a vector's first list tends to hit
its second. Real queries (short questions against long chunks) sit far from their neighbours' cells: on SciFact
with MiniLM, recall@10 at nprobe 16 went 0.90 → 0.96 for twice the PQ codes (48 bytes a vector), not twice the
vectors. Results are de-duplicated in `search`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragspec.errors import RagspecError

FLAT_MAX_CHUNKS = 20_000  # `auto` uses exact search up to this many chunks
MIN_PER_LIST = 39  # FAISS wants ≥ 39 training points per centroid
PAPER_FACTORY = "IVF4096,PQ64"
SOAR_LAMBDA = 1.0  # weight of the parallel part of the secondary residual (the SOAR paper uses 1)


@dataclass(frozen=True)
class FaissPlan:
    factory: str
    kind: str  # "flat" | "ivfpq" | "custom"
    nlist: int = 0
    m: int = 0
    nbits: int = 0
    nprobe: int = 16
    refine_k_factor: int = 0
    spill: int = 0  # extra lists each vector is stored in (needs the exact re-ranking)

    def as_dict(self) -> dict:
        return {
            "factory": self.factory,
            "metric": "inner_product",
            "kind": self.kind,
            "nlist": self.nlist,
            "pq_m": self.m,
            "pq_nbits": self.nbits,
            "nprobe": self.nprobe,
            "refine_k_factor": self.refine_k_factor,
            "spill": self.spill,
            "spill_rule": f"soar lambda={SOAR_LAMBDA:g}" if self.spill else "none",
        }


def pq_subquantizers(dim: int) -> int:
    """The largest of the usual PQ sizes that divides `dim` with ≥ 8 dimensions each (384→48, 1024→64)."""
    for m in (96, 64, 48, 32, 24, 16, 8, 4, 2, 1):
        if dim % m == 0 and dim // m >= 8:
            return m
    return 1


def plan_index(
    n: int, dim: int, index_type: str = "auto", factory: str | None = None, nprobe: int = 16, refine: bool = True,
    refine_k_factor: int = 8, spill: int = 1,
) -> FaissPlan:
    """Choose the FAISS index for `n` vectors of `dim` dimensions."""
    if factory:
        nlist = _nlist_of(factory)
        if nlist and n < nlist * MIN_PER_LIST:
            raise RagspecError(
                f"FAISS factory '{factory}' has {nlist} lists, which needs ≥ {nlist * MIN_PER_LIST} vectors "
                f"to train; this corpus has {n}. Use --index-type auto"
            )
        return FaissPlan(factory=factory, kind="custom", nlist=nlist, nprobe=nprobe)
    if index_type not in ("auto", "flat", "ivfpq"):
        raise RagspecError(f"index type '{index_type}' is not one of auto, flat, ivfpq")
    if index_type == "flat" or (index_type == "auto" and n <= FLAT_MAX_CHUNKS) or n < 2 * MIN_PER_LIST:
        return FaissPlan(factory="Flat", kind="flat")
    nlist = max(1, min(round(4 * math.sqrt(n)), n // MIN_PER_LIST))
    m = pq_subquantizers(dim)
    nbits = 8 if n >= 256 * MIN_PER_LIST else max(4, int(math.log2(max(16, n // MIN_PER_LIST))))
    suffix = ",RFlat" if refine else ""
    return FaissPlan(
        factory=f"IVF{nlist},PQ{m}x{nbits}{suffix}",
        kind="ivfpq",
        nlist=nlist,
        m=m,
        nbits=nbits,
        nprobe=min(nprobe, nlist),
        refine_k_factor=refine_k_factor if refine else 0,
        spill=spill if refine else 0,
    )


def _nlist_of(factory: str) -> int:
    for part in factory.split(","):
        if part.startswith("IVF"):
            digits = "".join(ch for ch in part[3:] if ch.isdigit())
            return int(digits) if digits else 0
    return 0


def gpu_available() -> bool:
    import faiss

    try:
        return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    except Exception:  # noqa: BLE001 - a GPU probe that fails means no GPU
        return False


def build(vectors: np.ndarray, plan: FaissPlan, use_gpu: bool = False, seed: int = 1234):
    """Train (when needed) and fill an index; ids are row numbers. Trains on the GPU when asked and present."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    index = faiss.index_factory(dim, plan.factory, faiss.METRIC_INNER_PRODUCT)
    _configure(index, plan)
    if use_gpu and gpu_available():  # pragma: no cover - no GPU in CI
        res = faiss.StandardGpuResources()
        gpu_index = faiss.index_cpu_to_gpu(res, 0, index)
        if not gpu_index.is_trained:
            gpu_index.train(vectors)
        gpu_index.add(vectors)
        index = faiss.index_gpu_to_cpu(gpu_index)
        _configure(index, plan)
        _spill(index, vectors, plan.spill)
        return index
    if not index.is_trained:
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.cp.seed = seed
        rng = np.random.default_rng(seed)
        cap = max(plan.nlist, 1) * 256
        train = vectors if n <= cap else vectors[np.sort(rng.choice(n, cap, replace=False))]
        index.train(train)
    index.add(vectors)
    _spill(index, vectors, plan.spill)
    return index


def _spill(index, vectors: np.ndarray, extra: int) -> None:
    """Store each vector in `extra` more IVF lists (SOAR); the exact re-ranking keeps one copy of each vector."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if extra <= 0 or ivf is None:
        return
    if not hasattr(index, "k_factor"):
        raise RagspecError("spilling needs the exact re-ranking (RFlat): without it duplicates cannot be told apart")
    n = len(vectors)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    _, primary = ivf.quantizer.search(vectors, 1)
    taken = primary[:, :1].copy()
    ids = np.arange(n, dtype=np.int64)
    for _ in range(extra):
        lists = soar_assign(vectors, centroids, primary[:, 0], taken)
        ivf.add_core(n, faiss.swig_ptr(vectors), faiss.swig_ptr(ids), faiss.swig_ptr(lists))
        taken = np.concatenate([taken, lists[:, None]], axis=1)


def soar_assign(
    vectors: np.ndarray, centroids: np.ndarray, primary: np.ndarray, taken: np.ndarray, lam: float = SOAR_LAMBDA,
    block: int = 4096,
) -> np.ndarray:
    """For each vector the list c minimising ‖x−c‖² + λ·⟨x−c, r̂⟩², r̂ the unit primary residual, among lists not
    yet `taken`. Blocked so memory stays at `block` × nlist floats."""
    n = len(vectors)
    sq = (centroids * centroids).sum(axis=1)
    out = np.empty(n, dtype=np.int64)
    for start in range(0, n, block):
        x = vectors[start:start + block]
        r = x - centroids[primary[start:start + block]]
        r_hat = r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-12)
        along = (x * r_hat).sum(axis=1, keepdims=True) - r_hat @ centroids.T  # ⟨x−c, r̂⟩ for every list c
        cost = sq[None, :] - 2.0 * (x @ centroids.T) + lam * along * along
        np.put_along_axis(cost, taken[start:start + block], np.inf, axis=1)
        out[start:start + block] = np.argmin(cost, axis=1)
    return out


def _configure(index, plan: FaissPlan) -> None:
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = plan.nprobe
    if plan.refine_k_factor and hasattr(index, "k_factor"):
        faiss.downcast_index(index).k_factor = plan.refine_k_factor


def write(index, path: Path) -> None:
    import faiss

    faiss.write_index(index, str(path))


def read(path: Path, plan: dict, use_gpu: bool = False):
    """Load an index file and apply the search parameters stored in the manifest."""
    import faiss

    index = faiss.read_index(str(path))
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = int(plan.get("nprobe", 16))
    if plan.get("refine_k_factor"):
        refine = faiss.downcast_index(index)
        if hasattr(refine, "k_factor"):
            refine.k_factor = float(plan["refine_k_factor"])
    if use_gpu and gpu_available():  # pragma: no cover
        index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    return index


def search_params(index, allowed: np.ndarray, nprobe: int | None = None):
    """FAISS search parameters that let only `allowed` ids through (an ID selector inside the search), for a
    flat index, an IVF index, or IVF-PQ under the exact re-ranking (`IndexRefine`)."""
    import faiss

    sel = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return faiss.SearchParameters(sel=sel), sel
    inner = faiss.SearchParametersIVF(sel=sel, nprobe=int(nprobe or ivf.nprobe))
    refine = faiss.downcast_index(index)
    if hasattr(refine, "k_factor"):
        return faiss.IndexRefineSearchParameters(k_factor=float(refine.k_factor), base_index_params=inner), sel
    return inner, sel


def search(index, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) for unit-vector queries, each id once; ids of -1 (fewer than k results) are dropped by
    callers. `allowed`: the only ids that may be returned (a filter), applied inside the search; on IVF, when
    the probed lists hold fewer than k allowed vectors, the search runs again over every list."""
    import faiss

    if getattr(index, "kind", None) == "torch-exact":  # torch_search.TorchExactIndex: a GPU without faiss-gpu
        return index.search(queries, max(1, min(k, len(allowed))) if allowed is not None else k, allowed)
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    ivf = faiss.try_extract_index_ivf(index)
    if allowed is not None:
        k = max(1, min(k, len(allowed)))
        scores, ids = _search(index, ivf, q, k, allowed)
        if ivf is not None and (ids < 0).any() and ivf.nprobe < ivf.nlist:
            scores, ids = _search(index, ivf, q, k, allowed, nprobe=ivf.nlist)
        return scores, ids
    return _search(index, ivf, q, max(1, min(k, index.ntotal)))


def _search(index, ivf, q: np.ndarray, k: int, allowed: np.ndarray | None = None, nprobe: int | None = None):
    params, selector = search_params(index, allowed, nprobe) if allowed is not None else (None, None)
    copies = -(-ivf.ntotal // max(index.ntotal, 1)) if ivf is not None else 1
    if copies <= 1:
        return index.search(q, k, params=params) if params is not None else index.search(q, k)
    kk = min(k * copies, ivf.ntotal)
    scores, ids = index.search(q, kk, params=params) if params is not None else index.search(q, kk)
    del selector  # kept alive through the search (FAISS holds only a raw pointer)
    out_s = np.full((len(q), k), -np.inf, dtype=np.float32)
    out_i = np.full((len(q), k), -1, dtype=np.int64)
    for row in range(len(q)):
        keep = ids[row] >= 0
        _, first = np.unique(ids[row][keep], return_index=True)
        order = np.sort(first)[:k]  # results are sorted by score: the first copy of each id is its place
        out_i[row, : len(order)] = ids[row][keep][order]
        out_s[row, : len(order)] = scores[row][keep][order]
    return out_s, out_i
