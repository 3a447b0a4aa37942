"""The llama.cpp backend: a GGUF as shipped, run by llama-cpp-python's low-level API.

A draft tree is verified in ONE `llama_decode` through sequence ids (llama.cpp's examples/speculative and
lookahead do the same): each leaf gets a sequence, a node belongs to the sequence of every leaf below it,
the root to all of them and to the main sequence 0, and a node's position is the root's plus its depth.
llama.cpp masks a token by its first sequence id — a leaf below it — so every node sees the cached context
(copied into each leaf sequence before the decode), its ancestors and itself, as in the transformers tree
mask. Rows are read with `llama_get_logits_ith`, only those the acceptance walk visits. After acceptance the
accepted path joins sequence 0 and everything else is dropped (`seq_rm`, `seq_cp`, `seq_keep`).

What drafters get: no hidden states and no attention rows (llama.cpp exposes neither for inner layers), so
PLD+ (h) and PLD+ (a) do not run here; PLD, the trie, the suffix drafter and plain decoding do.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from ragspec.cpu_flags import flags_hash
from ragspec.decoding.backends.accept import accept_sampled, new_generator, walk
from ragspec.decoding.backends.base import StepResult
from ragspec.decoding.budget import measured_enough
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.tree import DraftTree
from ragspec.errors import RagspecError
from ragspec.runtime.llama_cpp_model import MAX_SEQS, LlamaCppModel


@dataclass
class LlamaCppBackend:
    """One generation on a `LlamaCppModel`: sequence 0 holds the prompt and the accepted tokens."""

    model: LlamaCppModel
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    hidden_layer: int | None = None
    attention_heads: tuple = ()
    predictions: bool = False  # every row's argmax (lookahead's window): not offered here, see __post_init__

    name = "llama.cpp"
    supports_prefix = False

    def __post_init__(self):
        if self.hidden_layer is not None or self.attention_heads:
            raise RagspecError(
                "PLD+ drafters read an inner layer's hidden states (pldplus-h) or attention rows (pldplus-a), which "
                "llama.cpp does not expose: use drafting pld, trie, suffix or none with generator.backend llama.cpp, "
                "or generator.backend transformers")
        if self.predictions:
            raise RagspecError(
                "lookahead decoding is not supported on llama.cpp (its Jacobi window needs every tree row's "
                "prediction): use drafting pld, trie, suffix or none with generator.backend llama.cpp, "
                "or generator.backend transformers")
        self._gen = new_generator(self.sampling)
        self.cached = 0
        self.root = 0
        self._root_logits = None  # set by prefill: the root is cached and these are its logits

    def prefill(self, prompt_ids: list[int], prefix=None, on_progress=None, cancel=None, sources=None) -> float:
        """`sources`: a `source_cache.SourcePlan`: the prompt assembled from cached source pieces
        (source_kv_llama.py) unless this context cannot shift positions (the plan's `fallback` says why)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + self.model.n_batch > self.model.n_ctx:
            raise RagspecError(f"the prompt ({len(prompt_ids)} tokens) does not fit llama.cpp's context "
                               f"({self.model.n_ctx} tokens, {self.model.n_batch} kept for the draft tree)")
        t = time.perf_counter()
        m = self.model
        if sources is not None:
            from ragspec.decoding.backends import source_kv_llama

            sources.fallback = source_kv_llama.unsupported(m)
            if not sources.fallback:
                if sources.blend > 0:
                    sources.note = "CacheBlend needs layer 1's keys, which llama.cpp does not expose: first-k only"
                self._root_logits = source_kv_llama.assemble(m, list(prompt_ids), sources, cancel, on_progress)
                self.cached = len(prompt_ids) - 1
                self.root = int(prompt_ids[-1])
                return (time.perf_counter() - t) * 1000
        m.clear()
        # the whole prompt, as llama.cpp's own greedy reads it: the last token's logits come from the same
        # big-batch kernels, and the first step runs only the tree (the root is cached already)
        m.feed(list(prompt_ids), 0, last_logits=True, on_progress=on_progress, cancel=cancel)
        self._root_logits = m.row((len(prompt_ids) - 1) % m.n_batch).copy()
        self.cached = len(prompt_ids) - 1
        self.root = int(prompt_ids[-1])
        return (time.perf_counter() - t) * 1000

    def known_next(self) -> int | None:
        """The first answer token, when greedy and the prefill kept the root's logits: known before any step."""
        if self._root_logits is None or not self.sampling.greedy:
            return None
        return int(np.argmax(self._root_logits))

    def _run(self, rows):
        """Decode the step's rows; returns row(r) for r over [root + tree]. The first step after a prefill
        skips the root row (cached, its logits kept from the prefill)."""
        m = self.model
        first = self._root_logits
        if first is None:
            m.decode_small(rows)
            return m.row
        self._root_logits = None
        if len(rows) > 1:
            m.decode_small(rows[1:])
        return lambda r: first if r == 0 else m.row(r - 1)

    def step(self, tree: DraftTree) -> StepResult:
        m = self.model
        t0 = time.perf_counter()
        tree = tree.truncated(fitting_nodes(tree, m.n_batch - 1, MAX_SEQS - 1))
        n = len(tree)
        rows, leaves = tree_rows(tree, self.root, self.cached)
        for s in range(1, len(leaves) + 1):  # every leaf sequence sees the cached context
            m.lc.llama_memory_seq_cp(m.mem, 0, s, -1, -1)
        t1 = time.perf_counter()
        row = self._run(rows)
        t2 = time.perf_counter()
        if self.sampling.greedy:
            path, bonus = walk(tree, lambda r: int(np.argmax(row(r))))
        else:
            import torch

            path, bonus = accept_sampled(tree, lambda r: torch.from_numpy(row(r).copy()), self.sampling, self._gen)
        t3 = time.perf_counter()
        self._keep(path, rows)
        self.cached += 1 + len(path)
        self.root = bonus
        t4 = time.perf_counter()
        return StepResult(
            tokens=[tree.tokens[i] for i in path] + [bonus],
            sources=[tree.sources[i] for i in path] + [-1],
            accepted=len(path), tree_size=n, forward_ms=(t3 - t1) * 1000, path=path,
            timings={"inputs": (t1 - t0) * 1000, "forward": (t2 - t1) * 1000, "accept": (t3 - t2) * 1000,
                     "trim": (t4 - t3) * 1000},
        )

    def _keep(self, path: list[int], rows) -> None:
        """The accepted path joins sequence 0; every other tree cell and the leaf sequences go."""
        m = self.model
        lc = m.lc
        if path:
            leaf = rows[path[-1] + 1][2][0]  # a sequence holding root → the last accepted node
            end = self.cached + 1 + len(path)
            lc.llama_memory_seq_rm(m.mem, leaf, end, -1)
            lc.llama_memory_seq_cp(m.mem, leaf, 0, self.cached + 1, end)
        lc.llama_memory_seq_keep(m.mem, 0)

    def score(self, tree: DraftTree) -> np.ndarray:
        """Every row's logits [1 + n, vocab] for [root + tree], the cache left as it was (for tests/tools)."""
        m = self.model
        rows, leaves = tree_rows(tree, self.root, self.cached)
        for s in range(1, len(leaves) + 1):
            m.lc.llama_memory_seq_cp(m.mem, 0, s, -1, -1)
        root_cached = self._root_logits is not None
        keep = self._root_logits
        row = self._run(rows)
        out = np.stack([row(r).copy() for r in range(len(rows))])
        self._root_logits = keep
        m.lc.llama_memory_seq_rm(m.mem, 0, self.cached + root_cached, -1)
        m.lc.llama_memory_seq_keep(m.mem, 0)
        return out

    def hidden_states(self):
        return None

    def attention_row(self):
        return None

    def close(self) -> None:
        pass

    @staticmethod
    def bigram_rows(model, tokens, k: int, w: int, max_batch: int = 256):
        raise ValueError("ngrammys needs the model's own bigram table, which only the transformers backend "
                         "computes; use generator.backend transformers (or another drafting method)")

    # -- t(n) calibration ----------------------------------------------------------------------------------
    @staticmethod
    def cost_key(model: LlamaCppModel) -> str:
        """t(n) depends on the GGUF, the threads and the CPU the native build runs on."""
        st = model.path.stat()
        h = hashlib.sha256(f"{model.path.resolve()}:{st.st_size}:{model.n_batch}".encode()).hexdigest()[:12]
        return f"llamacpp-{model.name}-{h}-cpu{flags_hash()}-t{model.n_threads}"

    @staticmethod
    def measure_costs(model: LlamaCppModel, context: int, repeats: int, sizes,
                      stop_ms: float | None = None) -> list[float]:
        """Median ms of one decode of an n-node chain tree over a `context`-token cache, for each n (up to the
        first that takes `stop_ms`)."""
        rng = np.random.default_rng(0)
        hi = min(model.n_vocab, 30000)
        model.clear()
        model.feed(rng.integers(100, hi, context).tolist(), 0)
        ms = []
        for n in sizes:
            n = min(n, model.n_batch)
            rows = [(int(t), context + k, [0], True) for k, t in enumerate(rng.integers(100, hi, n))]
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                model.decode_small(rows)
                times.append((time.perf_counter() - t) * 1000)
                model.lc.llama_memory_seq_rm(model.mem, 0, context, -1)
            ms.append(sorted(times[1:])[len(times[1:]) // 2])
            if measured_enough(n, ms[-1], stop_ms):
                break
        model.clear()
        return ms


def tree_rows(tree: DraftTree, root: int, cached: int):
    """The decode rows of [root + tree] — (token, position, sequence ids, logits) — and the leaves. Leaf k is
    sequence k + 1; a node's sequences are those of the leaves below it (its first one masks it)."""
    n = len(tree)
    has_child = [False] * n
    for p in tree.parents:
        if p >= 0:
            has_child[p] = True
    leaves = [i for i in range(n) if not has_child[i]]
    seqs: list[list[int]] = [[] for _ in range(n)]
    for k, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            seqs[node].append(k + 1)
            node = tree.parents[node]
    rows = [(root, cached, [0] + list(range(1, len(leaves) + 1)), True)]
    rows += [(tree.tokens[i], cached + tree.depths[i], seqs[i], True) for i in range(n)]
    return rows, leaves


def fitting_nodes(tree: DraftTree, max_nodes: int, max_leaves: int) -> int:
    """How many first nodes of the tree fit one decode: at most `max_nodes`, at most `max_leaves` leaves."""
    leaves, has_child = 0, set()
    for i, p in enumerate(tree.parents[:max_nodes]):
        leaves += 1
        if p >= 0 and p not in has_child:
            has_child.add(p)
            leaves -= 1
        if leaves > max_leaves:
            return i
    return min(len(tree), max_nodes)
