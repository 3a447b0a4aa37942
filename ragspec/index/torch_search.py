"""Exact inner-product search in torch on a GPU, for machines where FAISS has no GPU build.

`faiss-gpu` wheels exist for CUDA 12 only; on a CUDA 13 machine (or with `faiss-cpu` alone) an index opened
with `device: cuda` searches here instead: the stored chunk vectors on the GPU, one matrix product per query
batch, top-k over every vector (so IVF-PQ indexes are searched exactly, a recall of 1). `which_search` names
what an index on a device will run, for the one line a build or a search prints.
"""

from __future__ import annotations

import numpy as np


class TorchExactIndex:
    """Flat inner-product search over `vectors` (rows = chunk ids) on a torch device."""

    kind = "torch-exact"

    def __init__(self, vectors: np.ndarray, device: str = "cuda"):
        import torch

        self.device = torch.device(device)
        self.vectors = torch.from_numpy(np.asarray(vectors, dtype=np.float32)).to(self.device)
        self.ntotal = len(vectors)

    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) as FAISS returns them: float32 and int64, -1 past the last result."""
        import torch

        q = torch.from_numpy(np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)).to(self.device)
        scores = q @ self.vectors.T
        if allowed is not None:
            keep = torch.full((self.ntotal,), float("-inf"), device=self.device)
            keep[torch.from_numpy(np.asarray(allowed, dtype=np.int64)).to(self.device)] = 0.0
            scores = scores + keep
        k = max(1, min(k, self.ntotal))
        top, ids = torch.topk(scores, k, dim=1)
        top, ids = top.float().cpu().numpy(), ids.cpu().numpy().astype(np.int64)
        ids[~np.isfinite(top)] = -1  # filtered out: fewer than k allowed
        return top.astype(np.float32), ids


def which_search(device: str) -> str:
    """What an index on `device` searches with: FAISS on the GPU where it loads, else exact search in torch."""
    if device != "cuda":
        return "faiss (cpu)"
    from ragspec.index.faiss_index import gpu_available

    return "faiss (gpu)" if gpu_available() else "torch exact search on cuda (this faiss has no GPU support)"
