"""Reciprocal-rank fusion (Cormack et al. 2009): score = Σ 1 / (k + rank) over the rankings."""

from __future__ import annotations

from collections.abc import Sequence


def rrf(rankings: Sequence[Sequence[int]], k: int = 60) -> list[tuple[int, float]]:
    """Fuse rankings of ids (best first) into one list of (id, fused score), best first, ties by id."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            scores[int(item)] = scores.get(int(item), 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
