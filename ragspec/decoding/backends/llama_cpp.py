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

import ctypes
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ragspec.cpu_flags import flags_hash
from ragspec.decoding.backends.accept import accept_sampled, new_generator, walk_greedy
from ragspec.decoding.backends.base import StepResult, check_cancel
from ragspec.decoding.budget import measured_enough
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.tree import DraftTree
from ragspec.errors import RagspecError

MAX_SEQS = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence 0 plus at most 255 leaves per tree
# llama.cpp's CPU matmuls switch kernels for big batches: on SmolLM2's Q4_1 GGUF (AVX2) a row computed in a
# batch of 64 rows differs from the same row decoded alone by up to 0.4 in the logits (batches of 1-48: 0.0,
# bit-identical). So a draft tree runs in decodes of at most UBATCH rows (one `llama_decode` up to 31 nodes,
# consecutive ones beyond, as llama.cpp itself would split it into micro-batches): its rows share kernels with
# the reference's one-token decodes, and greedy output is identical by construction, not only up to near-ties.
# The prompt is the same in both (`feed`, micro-batches of `n_batch` rows), so it takes the fast big-batch
# kernels: on Zen 3 (AVX2), Qwen2.5-0.5B Q4_K_M, 2 threads, 1,300 tokens: 121 tok/s against 73 in 32-row
# micro-batches.
UBATCH = 32


_AVAILABLE: list = []


def model_params(lc):
    """llama.cpp's default model parameters, less the extra buffer types where the build has ggml's AMX kernels:
    their weight buffer (one of those types) segfaulted at the first decode on the Sapphire Rapids-class Xeon this
    was tried on, as reported upstream (ggml-org/llama.cpp#20824). `make install` builds without them; this guards
    an older build (it then runs without its repacked weights too, slower)."""
    mp = lc.llama_model_default_params()
    if b"AMX_INT8 = 1" in lc.llama_print_system_info():
        mp.use_extra_bufts = False
    return mp


def available() -> str | None:
    """None when llama-cpp-python loads, else why not (for skips and errors). Tried once in a child process
    first: a native build made for another CPU dies of SIGILL rather than raising."""
    if not _AVAILABLE:
        import importlib.util
        import subprocess
        import sys

        why = None
        if importlib.util.find_spec("llama_cpp") is None:
            why = "llama-cpp-python is not installed (`make install` builds it; RAGSPEC_SKIP_LLAMA=1 skips that)"
        else:
            r = subprocess.run([sys.executable, "-c", "import llama_cpp; llama_cpp.llama_backend_init()"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
                why = f"llama-cpp-python does not load here ({tail}); rebuild it with `make install`"
        _AVAILABLE.append(why)
    return _AVAILABLE[0]


class LlamaCppModel:
    """A GGUF loaded once: the llama.cpp model, one context (a unified KV cache for up to 256 sequences) and a
    batch big enough for a prefill chunk or a whole tree (run in micro-batches of `n_ubatch` rows, see
    UBATCH). Generations on it queue (one context)."""

    def __init__(self, gguf: str | Path, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 name: str = "", n_ubatch: int | None = None):
        why = available()
        if why:
            raise RagspecError(why + " (run `make install`, or use generator.backend: transformers)")
        import llama_cpp as lc

        self.lc = lc
        self.path = Path(gguf)
        self.name = name or self.path.stem
        self.n_batch = n_batch
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        _quiet(lc)
        lc.llama_backend_init()
        mp = model_params(lc)
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise RagspecError(f"llama.cpp cannot load {self.path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_ubatch or n_batch, n_batch)  # prompt chunks in one micro-batch (trees split themselves)
        cp.n_seq_max = MAX_SEQS
        cp.kv_unified = True  # one cache all sequences share (the tree's sequences share the whole prefix)
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.no_perf = False  # llama.cpp's own prompt and decode timers (`perf`): a bench reports them
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RagspecError(f"llama.cpp cannot create a context for {self.path}")
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.mem = lc.llama_get_memory(self.ctx)
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        eos = {lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)} - {-1}
        self.batch = lc.llama_batch_init(n_batch, 0, MAX_SEQS)
        self._saved = None  # logits of a decode_small, by row
        # what the pipeline and the loop read off a model (window, eos ids)
        self.config = SimpleNamespace(model_type="gguf", max_position_embeddings=self.n_ctx - n_batch,
                                      eos_token_id=sorted(eos), vocab_size=self.n_vocab)
        self.generation_config = None
        self.device = "cpu"

    def close(self) -> None:
        lc = self.lc
        if getattr(self, "ctx", None):
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a destructor never raises
            pass

    def perf(self, reset: bool = False) -> dict:
        """llama.cpp's own timers since the last reset: the prompt's batches (`prompt_ms`, `prompt_tokens`) and
        the one-token decodes (`decode_ms`, `decode_tokens`), as its `llama_perf_context` counts them."""
        # llama.cpp adds a decode to its timers when its logits are synchronized: flush one still pending
        self.lc.llama_synchronize(self.ctx)
        d = self.lc.llama_perf_context(self.ctx)
        out = {"prompt_ms": round(d.t_p_eval_ms, 1), "prompt_tokens": d.n_p_eval, "decode_ms": round(d.t_eval_ms, 1),
               "decode_tokens": d.n_eval}
        if reset:
            self.lc.llama_perf_context_reset(self.ctx)
        return out

    # -- primitives the backend, the calibration and the tests share ---------------------------------------
    def clear(self) -> None:
        self.lc.llama_memory_clear(self.mem, True)

    def decode(self, rows: list[tuple[int, int, list[int], bool]]) -> None:
        """One `llama_decode` of rows (token, position, sequence ids, wants logits); `row(i)` reads row i."""
        self._saved = None
        self._decode(rows)

    def decode_small(self, rows: list[tuple[int, int, list[int], bool]], size: int = UBATCH) -> None:
        """`decode` in consecutive decodes of at most `size` rows (the kernels of one-token decodes, see
        UBATCH); the logits of each part are kept, so `row(i)` reads any row afterwards."""
        if len(rows) <= size:
            self.decode(rows)
            return
        saved = {}
        for a in range(0, len(rows), size):
            part = rows[a : a + size]
            self._saved = None
            self._decode(part)
            for k, r in enumerate(part):
                if r[3]:
                    saved[a + k] = self.row(k).copy()
        self._saved = saved

    def _decode(self, rows) -> None:
        b = self.batch
        for i, (tok, pos, seqs, out) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = len(seqs)
            sid = b.seq_id[i]
            for j, s in enumerate(seqs):
                sid[j] = s
            b.logits[i] = out
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RagspecError(f"llama_decode failed ({rc}) on {len(rows)} rows")

    def row(self, i: int) -> np.ndarray:
        """Logits of batch row i of the last decode (a view into llama.cpp's buffer: valid until the next)."""
        if self._saved is not None:
            return self._saved[i]
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def feed(self, tokens: list[int], start: int, last_logits: bool = False, on_progress=None,
             cancel=None) -> None:
        """Decode `tokens` into sequence 0 from position `start`, in `n_batch` chunks (`cancel` checked
        before each, `on_progress(done, total)` after each)."""
        for a in range(0, len(tokens), self.n_batch):
            check_cancel(cancel)
            chunk = tokens[a : a + self.n_batch]
            end = a + len(chunk) == len(tokens)
            self.decode([(t, start + a + k, [0], last_logits and end and k == len(chunk) - 1)
                         for k, t in enumerate(chunk)])
            if on_progress is not None:
                on_progress(a + len(chunk), len(tokens))
        check_cancel(cancel)

    def greedy(self, prompt: list[int], n: int, eos=(), on_first=None) -> list[int]:
        """llama.cpp's own greedy decoding, the reference: the prompt in `n_batch` chunks, then one token per
        decode, each the argmax of the last logits. `on_first()` is called once the first token is known (a
        bench times llama.cpp's own prefill by it)."""
        self.clear()
        self.feed(prompt, 0, last_logits=True)
        out, pos = [], len(prompt)
        idx = (len(prompt) - 1) % self.n_batch
        while len(out) < n:
            tok = int(np.argmax(self.row(idx)))
            out.append(tok)
            if on_first is not None and len(out) == 1:
                on_first()
            if tok in eos or len(out) == n:  # the last token is not decoded: nothing reads its logits
                break
            self.decode([(tok, pos, [0], True)])
            pos, idx = pos + 1, 0
        return out


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
            path, bonus = walk_greedy(tree, lambda r: int(np.argmax(row(r))))
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


_LOG_CB = None


def _quiet(lc) -> None:
    """Silence llama.cpp's stderr chatter (the callback must outlive every call, hence the global)."""
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
