"""Maximal marginal relevance (Carbonell & Goldstein 1998) over candidates' stored embeddings.

The most relevant first, then repeatedly the candidate maximising λ·cos(q, d) − (1 − λ)·max cos(d, s) over
those already taken, with λ = 1 − diversity: 0 keeps the relevance order, 1 takes the most different next. Unit vectors, so cosine is a
dot product; one matrix product, then O(k·n) updates.
"""

from __future__ import annotations

import numpy as np


def mmr(query: np.ndarray, vectors: np.ndarray, diversity: float, k: int | None = None) -> list[int]:
    """Row indices of `vectors` in MMR order (the first `k`, default all)."""
    n = len(vectors)
    k = n if k is None else min(k, n)
    if n == 0 or k <= 0:
        return []
    v = np.asarray(vectors, dtype=np.float32)
    lam = 1.0 - float(diversity)
    relevance = v @ np.asarray(query, dtype=np.float32)
    sims = v @ v.T
    taken: list[int] = []
    closest = np.full(n, -np.inf, dtype=np.float32)  # max similarity to anything taken so far
    free = np.ones(n, dtype=bool)
    for step in range(k):
        score = lam * relevance - (1.0 - lam) * closest if step else relevance
        score = np.where(free, score, -np.inf)
        best = int(np.argmax(score))  # ties: the better-ranked candidate (lower index)
        taken.append(best)
        free[best] = False
        closest = np.maximum(closest, sims[best])
    return taken
