"""A llama.cpp model and its one context, run by llama-cpp-python's low-level API: decodes of rows, logits read
by row, sequences copied and dropped. The llama.cpp backend (`decoding/backends/llama_cpp.py`) verifies draft
trees on it; the loaders (`models/generator.py`) make it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ragspec.errors import RagspecError, check_cancel

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


_LOG_CB = None


def _quiet(lc) -> None:
    """Silence llama.cpp's stderr chatter (the callback must outlive every call, hence the global)."""
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
