"""k-gram → positions index over a growing token sequence, shared by the lookup drafters.

Positions are kept in increasing order, so `positions(g)[0]` is the first occurrence. Extending costs
`max_n` dict appends per new token, so drafting never rescans the context.
"""

from __future__ import annotations

from collections import defaultdict


class NgramIndex:
    def __init__(self, max_n: int):
        self.max_n = max_n
        self._by_n: list[dict[tuple, list[int]]] = [defaultdict(list) for _ in range(max_n + 1)]
        self._indexed = 0

    def extend(self, seq: list[int]) -> None:
        """Index every k-gram (1 ≤ k ≤ max_n) that ends within `seq` and is not indexed yet."""
        for end in range(self._indexed + 1, len(seq) + 1):
            for k in range(1, self.max_n + 1):
                start = end - k
                if start < 0:
                    break
                self._by_n[k][tuple(seq[start:end])].append(start)
        self._indexed = len(seq)

    def positions(self, gram) -> list[int]:
        """Start positions of `gram` (length ≤ max_n), in increasing order ([] if absent)."""
        return self._by_n[len(gram)].get(tuple(gram), [])
