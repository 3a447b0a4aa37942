"""Prefix KV reuse: keep the KV cache of recent generations (prompt + answer) and start a new prefill from the
longest cached prefix of its prompt instead of from nothing.

A follow-up turn of a conversation repeats the system prompt, the sources and the earlier turns: its prompt
starts with the previous generation's tokens, so only the new turn is prefilled. Saved caches are never
changed: a reuse copies the cached tensors cut to the common prefix.

Used by `Verifier.prefill(ids, prefix=store)` and `SpeculativeGenerator.stream(..., prefix=store)`; one store
per model (its caches are that model's), accessed under the model's lock.

`HeadStore` keeps only the fixed head of each prompt (system instruction and chat template up to the sources):
every ask repeats it, so every ask past the first reads its prompt from the first source on.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token ids and a DynamicCache holding exactly their keys and values."""

    def __init__(self, ids: list[int], cache):
        self.ids = list(ids)
        self.cache = cache

    def restore(self, n: int):
        """A fresh DynamicCache holding the first n positions (the saved one is left as it is)."""
        out = copy.copy(self.cache)
        out.layers = []
        for layer in self.cache.layers:
            twin = copy.copy(layer)
            twin.keys = layer.keys[:, :, :n].clone()
            twin.values = layer.values[:, :, :n].clone()
            out.layers.append(twin)
        return out


class PrefixStore:
    """The `capacity` most recently used prefix caches; `lookup` finds the longest shared prefix."""

    def __init__(self, capacity: int = 4, min_tokens: int = 1):
        self.capacity = capacity
        self.min_tokens = min_tokens
        self.entries: OrderedDict[int, PrefixCache] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.last_reused = 0  # tokens reused by the latest lookup (0: prefilled from nothing)

    def lookup(self, ids: list[int], limit: int):
        """(cache copy, n): a cache of the first n <= limit tokens of `ids`, or (None, 0)."""
        best, best_n = None, 0
        with self._lock:
            for key, entry in self.entries.items():
                n = min(common_prefix(entry.ids, ids), limit)
                if n > best_n:
                    best, best_n, best_key = entry, n, key
            if best is None or best_n < self.min_tokens:
                self.last_reused = 0
                return None, 0
            self.entries.move_to_end(best_key)
        self.last_reused = best_n
        return best.restore(best_n), best_n

    def save(self, ids: list[int], cache, cached: int) -> None:
        """Keep `cache`, whose first `cached` positions hold `ids[:cached]` (it is not copied: hand over a cache
        nobody changes afterwards)."""
        n = min(cached, len(ids))
        if n < self.min_tokens or self.capacity <= 0:
            return
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        with self._lock:
            # an entry whose ids are a prefix of the new one is superseded by it
            for key in [k for k, e in self.entries.items() if common_prefix(e.ids, ids[:n]) == len(e.ids)]:
                del self.entries[key]
            self.entries[self._next] = PrefixCache(ids[:n], cache)
            self._next += 1
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


class HeadStore(PrefixStore):
    """Prefix reuse of prompt heads only: `save` keeps the first `keep` tokens (set per ask to the prompt's head)
    as a copy of their own, so neither the answer nor the prompt's source tokens stay in memory (~25 KB a token
    for Qwen2.5-0.5B, ~57 KB for the 1.5B, float32); a few heads (one per system instruction in use)."""

    def __init__(self, capacity: int = 4):
        super().__init__(capacity)
        self.keep = 0

    def save(self, ids: list[int], cache, cached: int) -> None:
        n = min(self.keep, cached, len(ids))
        if n >= self.min_tokens:
            super().save(ids[:n], PrefixCache(ids[:n], cache).restore(n), n)
