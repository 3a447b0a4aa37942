"""FAISS index choice, training and search: exact for small corpora, IVF-PQ above that.

The rules (written to the manifest): inner product on unit vectors; IVF lists ≈ 4·√N but never fewer than
39 training vectors per list; PQ sub-quantizers dividing the dimension (64 for 1024-d bge-m3 as in the
paper, 48 for 384-d MiniLM); an optional exact re-ranking of the PQ shortlist (`RFlat`).
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


@dataclass(frozen=True)
class FaissPlan:
    factory: str
    kind: str  # "flat" | "ivfpq" | "custom"
    nlist: int = 0
    m: int = 0
    nbits: int = 0
    nprobe: int = 16
    refine_k_factor: int = 0

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
        }


def pq_subquantizers(dim: int) -> int:
    """The largest of the usual PQ sizes that divides `dim` with ≥ 8 dimensions each (384→48, 1024→64)."""
    for m in (96, 64, 48, 32, 24, 16, 8, 4, 2, 1):
        if dim % m == 0 and dim // m >= 8:
            return m
    return 1


def plan_index(
    n: int, dim: int, index_type: str = "auto", factory: str | None = None, nprobe: int = 16, refine: bool = True,
    refine_k_factor: int = 8,
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
    except Exception:
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
    return index


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


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) for unit-vector queries; ids of -1 (fewer than k results) are dropped by callers."""
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    k = max(1, min(k, index.ntotal))
    return index.search(q, k)
