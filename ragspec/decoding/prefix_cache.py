"""Prefix KV reuse: keep the KV cache of recent generations (prompt + answer) and start a new prefill from the
longest cached prefix of its prompt instead of from nothing.

A follow-up turn of a conversation repeats the system prompt, the sources and the earlier turns: its prompt
starts with the previous generation's tokens, so only the new turn is prefilled. Saved caches are never
changed: a reuse copies the cached tensors cut to the common prefix.

Used by `Verifier.prefill(ids, prefix=store)` and `SpeculativeGenerator.stream(..., prefix=store)`; one store
per model (its caches are that model's), accessed under the model's lock.

`PromptTree` keeps earlier prompts (and their answers) as a radix tree, bounded by memory: every ask repeats
the fixed head (system instruction and template up to the sources), and a question whose first sources came
before reads its prompt from after them. Used where the reuse is exact (rows computed alike however batched).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _LastReused:
    """`last_reused`: tokens the latest lookup of any thread reused; `reused_here`: those of this thread's latest
    (generations running together, continuous batching, each read their own)."""

    @property
    def last_reused(self) -> int:
        return self.__dict__.get("_latest", 0)

    @last_reused.setter
    def last_reused(self, n: int) -> None:
        self._mine().n = self.__dict__["_latest"] = n

    @property
    def reused_here(self) -> int:
        return getattr(self._mine(), "n", 0)

    def _mine(self) -> threading.local:
        return self.__dict__.setdefault("_local", threading.local())  # one, whichever thread comes first


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


class PrefixStore(_LastReused):
    """The `capacity` most recently used prefix caches; `lookup` finds the longest shared prefix."""

    copies = False  # `save` keeps the cache handed over: only a finished generation's may be saved

    def __init__(self, capacity: int = 4, min_tokens: int = 1):
        self.capacity = capacity
        self.min_tokens = min_tokens
        self.entries: OrderedDict[int, PrefixCache] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

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


class _Node:
    """A run of tokens on the path from the tree's root and their keys and values ([B, H_kv, len, D] a layer,
    contiguous: a split or an eviction frees exactly what it says)."""

    __slots__ = ("children", "ids", "kv", "parent", "used")

    def __init__(self, ids: list[int], kv: list, parent):
        self.ids, self.kv, self.parent = ids, kv, parent
        self.children: dict[int, _Node] = {}
        self.used = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv for t in pair)


class PromptTree(_LastReused):
    """Exact reuse of what earlier prompts share, as a radix tree over their token ids (RAGCache's knowledge tree,
    SGLang's radix cache): the system head every ask repeats, then the sources in the order they were sent, then
    the question and the answer. A prompt reads only what follows its longest stored prefix, so a question whose
    first sources came before (a rephrased question, a follow-up turn) starts after them.

    Exact only where the model computes each row the same way however rows are batched
    (`models.exact_attention.rows_independent`): then the reused keys and values are the bits a whole prefill
    makes and every answer is the one without reuse (tested). Shared runs are stored once; `budget_mb` bounds
    the keys and values held, the least recently used leaves go first (~25 KB a token for Qwen2.5-0.5B,
    ~57 KB for the 1.5B, float32). `PrefixStore`'s interface: `lookup`, `save`, `last_reused`, `clear`."""

    copies = True  # `save` copies what it keeps: a generation saves its prompt as soon as it is read

    AHEAD = 32  # a prompt being read that shares this many tokens more than the tree holds is worth waiting for

    def __init__(self, budget_mb: float = 2048):
        self.budget = int(budget_mb * 2 ** 20)
        self.root = _Node([], [], None)
        self.nbytes = 0
        self._skeleton = None  # an empty cache of the model's kind: lookups fill copies of it
        self._clock = 0
        self._lock = threading.Lock()
        self._read = threading.Condition(self._lock)  # notified when a prompt being read is stored or given up
        self._reading: dict[int, list[int]] = {}  # thread id -> the prompt it is reading (looked up, not yet saved)

    # -- prompts being read ------------------------------------------------------------------------------------
    def wait_for_readers(self, ids: list[int], limit: int, cancel=None, timeout_s: float = 120.0) -> int:
        """Wait while another request reads a prompt that shares `AHEAD` tokens more of `ids[:limit]` than the
        tree holds (it is stored once read, and this prompt then reads only the rest), then count this thread as
        reading `ids` until it saves them or calls `done_reading`. The wait costs no time where prompts are read
        first come first served (the step batcher's turns): this prompt's reading would wait for that one's
        anyway. A thread counts as reading only once it stops waiting, so two never wait for each other.
        Returns the reader's key for `done_reading`."""
        from ragspec.errors import check_cancel

        ids, end, me = list(ids[:limit]), time.monotonic() + timeout_s, threading.get_ident()
        with self._read:
            while time.monotonic() < end:
                held = self._walk(ids)[1]
                if not any(common_prefix(r, ids) >= held + self.AHEAD for t, r in self._reading.items() if t != me):
                    break
                self._read.wait(0.05)
                check_cancel(cancel)
            self._reading[me] = ids
        return me

    def done_reading(self, reader: int) -> None:
        """`reader` reads no prompt now (stored, cancelled or failed): requests waiting for it go on."""
        with self._read:
            if self._reading.pop(reader, None) is not None:
                self._read.notify_all()

    def _walk(self, ids: list[int]):
        """[(node, tokens of it matched)] along `ids` from the root, and the tokens matched in all."""
        path, node, pos = [], self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            m = common_prefix(child.ids, ids[pos:pos + len(child.ids)])
            path.append((child, m))
            pos += m
            if m < len(child.ids):
                break
            node = child
        return path, pos

    def lookup(self, ids: list[int], limit: int):
        """(cache, n): a fresh cache holding the keys and values of the first n <= `limit` tokens of `ids`
        (the longest stored prefix), or (None, 0)."""
        with self._lock:
            path, n = self._walk(ids[:limit])
            self.last_reused = n if self._skeleton is not None else 0
            if not self.last_reused:
                return None, 0
            self._clock += 1
            for node, _ in path:
                node.used = self._clock
            parts = [(node.kv, m) for node, m in path]
            return self._cache(parts, n, len(ids) + 256), n

    def _cache(self, parts, n: int, room: int):
        """A cache of the model's kind whose layers hold the runs `parts` ([(kv, tokens)]) end to end in buffers
        of `room` positions (the rest of the prompt and an answer: a growing layer then appends in place)."""
        out = copy.copy(self._skeleton)
        out.layers = []
        for i, layer in enumerate(self._skeleton.layers):
            twin = copy.copy(layer)
            for name, j in (("keys", 0), ("values", 1)):
                first = parts[0][0][i][j]
                buf = first.new_empty((first.shape[0], first.shape[1], room, first.shape[3]))
                at = 0
                for kv, m in parts:
                    buf[:, :, at:at + m] = kv[i][j][:, :, :m]
                    at += m
                setattr(twin, name, buf)
                setattr(twin, name, buf[:, :, :n])  # a prefix view: a growing layer keeps the room
            out.layers.append(twin)
        return out

    def save(self, ids: list[int], cache, cached: int) -> None:
        """Store the first `cached` tokens of `ids`, whose keys and values `cache` holds (copied: the caller
        may go on changing it)."""
        n = min(cached, len(ids))
        if n <= 0 or self.budget <= 0:
            return
        with self._lock:
            if self._skeleton is None:
                self._skeleton = copy.copy(cache)
                self._skeleton.layers = [copy.copy(layer) for layer in cache.layers]
                for layer in self._skeleton.layers:  # the structure only: no reference to this cache's tensors
                    layer.keys = layer.values = None
            path, pos = self._walk(ids[:n])
            self._clock += 1
            node = self.root
            for child, m in path:
                if m < len(child.ids):
                    child = self._split(child, m)
                child.used = self._clock
                node = child
            if pos < n:
                kv = [(layer.keys[:, :, pos:n].clone(), layer.values[:, :, pos:n].clone()) for layer in cache.layers]
                leaf = _Node(list(ids[pos:n]), kv, node)
                leaf.used = self._clock
                node.children[leaf.ids[0]] = leaf
                self.nbytes += leaf.nbytes()
            self._evict()

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut `node` after its first m tokens; returns the new upper part (the lower keeps the children)."""
        upper = _Node(node.ids[:m], [(k[:, :, :m].clone(), v[:, :, :m].clone()) for k, v in node.kv], node.parent)
        upper.used = node.used
        node.parent.children[node.ids[0]] = upper
        node.ids = node.ids[m:]
        node.kv = [(k[:, :, m:].clone(), v[:, :, m:].clone()) for k, v in node.kv]
        node.parent = upper
        upper.children[node.ids[0]] = node
        return upper

    def _evict(self) -> None:
        """Drop least recently used leaves until the tree fits its budget."""
        while self.nbytes > self.budget:
            leaves = [node for node in self._nodes() if not node.children and node is not self.root]
            if not leaves:
                return
            leaf = min(leaves, key=lambda x: x.used)
            del leaf.parent.children[leaf.ids[0]]
            self.nbytes -= leaf.nbytes()

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def tokens(self) -> int:
        """Tokens held (each shared run once)."""
        with self._lock:
            return sum(len(node.ids) for node in self._nodes())

    def clear(self) -> None:
        with self._lock:
            self.root, self.nbytes, self._skeleton = _Node([], [], None), 0, None
            self._read.notify_all()
