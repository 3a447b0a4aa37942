"""The transformers backend: today's tree verifier over a Hugging Face causal LM and its DynamicCache.

One forward of [root + tree] with a 4-D tree mask; the cache then keeps the accepted path (only out-of-place
rows move). It alone offers hidden states (PLD+ h) and attention rows (PLD+ a).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from dataclasses import dataclass, field

import torch

from ragspec.decoding.backends.accept import accept_greedy, accept_sampled, new_generator, walk
from ragspec.decoding.backends.base import MIN_TAIL, PREFILL_CHUNK, StepResult, chunks
from ragspec.decoding.budget import measured_enough
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.tree import DraftTree
from ragspec.errors import check_cancel
from ragspec.runtime.cache_only import cache_only
from ragspec.runtime.exact_attention import rows_independent
from ragspec.runtime.growing_cache import growing, stand_in_context
from ragspec.runtime.model_runtime import runtime_of
from ragspec.runtime.prompt_mode import prompt_forward, reads_by_role

LONG_MS = 1000.0  # t(n) measurement: timed runs of one size that add up to this are enough
WARM_ROWS = 16  # t(n) measurement over a stand-in context: the rows of the forward that warms up first

_CACHE_KEYWORD: dict[type, str] = {}


def cache_arg(model, cache) -> dict:
    """The forward's keyword argument for a KV cache: recent transformers 5.x call it `cache` (5.24 warns that
    `past_key_values` goes in 5.40); older 5.x releases know only `past_key_values`."""
    kind = type(model)
    if kind not in _CACHE_KEYWORD:
        params = inspect.signature(kind.forward).parameters
        _CACHE_KEYWORD[kind] = "cache" if "cache" in params else "past_key_values"
    return {_CACHE_KEYWORD[kind]: cache}


def generate_kwargs(model, prompt_ids: list[int]) -> dict:
    """What HF `generate` needs to read a prompt as the backend does, for plain greedy references: prefilled in
    the backend's chunks, and for a model that reads prompts by role every position but the last read by prompt
    forwards (`prompt_mode.py`) into the cache `generate` then continues from."""
    if not reads_by_role(model):
        return {"prefill_chunk_size": PREFILL_CHUNK}
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), prompt_forward():
        for a, b in chunks(0, len(prompt_ids) - 1):
            model(input_ids=torch.tensor([prompt_ids[a:b]], device=model.device), **cache_arg(model, cache),
                  use_cache=True, logits_to_keep=1)
    return {"past_key_values": cache}


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, if it has any (config.layer_types names them)."""
    types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in types else None


@dataclass
class TransformersBackend:
    """Holds a model, its KV cache and the sequence decoded so far."""

    name = "transformers"

    model: object
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    hidden_layer: int | None = None  # keep this layer's hidden states of accepted positions (PLD+ h)
    attention_heads: tuple = ()  # (layer, head) pairs whose attention row of the last accepted token PLD+ (a) reads
    predictions: bool = False  # return every row's argmax (StepResult.predictions): lookahead's Jacobi window
    batcher: object = None  # a `step_batcher.StepBatcher`: steps batched with other generations', turns for the rest

    def __post_init__(self):
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self._capture = None
        self._attention = None  # [cached] max over the chosen heads of the last cached position's attention
        self._gen = new_generator(self.sampling)
        self._root_logits = None  # set by a prefill that cached the root too: its logits, for the first step

    # -- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], prefix=None, on_progress=None, cancel=None, sources=None) -> float:
        """Cache the prompt in `PREFILL_CHUNK` chunks (see base.py); its last token is the first step's root.
        Returns ms. `prefix`: a `prefix_cache.PrefixStore` or `PromptTree`; the longest cached prefix of the
        prompt is reused, not recomputed. `sources`: a `source_cache.SourcePlan`; the prompt is assembled from
        cached source pieces (backends/source_kv.py) unless a prefix reuse covers them all or the model cannot
        (the plan's `fallback` then says why).

        The root is cached with the rest and its logits kept (as HF `generate` reads a prompt), so the first
        step runs only its tree, or no forward at all for a plain step: one t(1) less per generation. A PLD+
        drafter's hidden states or attention row of the last cached token keep the root out of the prefill."""
        from transformers import DynamicCache

        if not prompt_ids:
            raise ValueError("the prompt is empty")
        # sliding-window layers (Gemma 3, Mistral-style) keep every key here, hidden by the mask instead: a
        # windowed cache would drop keys our tree rows and cache trimming still index
        self.window = sliding_window(self.model.config)
        self.cache = DynamicCache() if self.window else growing(DynamicCache(config=self.model.config))
        self.cached = 0
        self.root = int(prompt_ids[-1])
        self._hidden = None  # [capacity, d] buffer of layer-`hidden_layer` states of cached positions
        t = time.perf_counter()
        # with attention heads to read, the last cached token runs alone with eager attention (its row is
        # what the first step ranks by); the rest of the prompt keeps the fast attention kernel
        self._root_logits = None
        whole = self.hidden_layer is None and not self.attention_heads  # the root is cached too
        split = len(prompt_ids) - 2 if self.attention_heads and len(prompt_ids) > 2 else len(prompt_ids) - 1
        # a model that reads prompts by role (a weight copy, prompt attention) reads the root as a step: alone,
        # after the prompt's chunks
        root_alone = whole and reads_by_role(self.model)
        split = len(prompt_ids) if whole and not root_alone else split
        if prefix is not None and whole:
            # at least the root is computed here: its logits are the first step's
            cache, self.cached = prefix.lookup(prompt_ids, len(prompt_ids) - 1)
            self.cache = cache if cache is not None else self.cache
        if sources is not None:
            covered = max([sources.head] + [b for _, b in sources.pieces])
            why = "" if whole else "PLD+ drafters read every prompt position's hidden state or attention row"
            if not why:
                from ragspec.decoding.backends.source_kv import assemble, unsupported

                why = unsupported(self.model)
            if why:
                sources.fallback = why
            elif self.cached < covered:  # a prefix reuse that covers every piece is exact: it wins
                with self._turn():
                    self.cache, self._root_logits = assemble(self.model, prompt_ids, sources, cancel, on_progress)
                self.cached = len(prompt_ids)
                return (time.perf_counter() - t) * 1000
        total = split - self.cached
        for a, b in chunks(self.cached, split, min_tail=MIN_TAIL if rows_independent(self.model) else 0):
            check_cancel(cancel)
            ids = torch.tensor([prompt_ids[a:b]], device=self.device)
            # every position but the root's by role; a chunk without the root is read for the cache alone
            with self._turn(), prompt_forward(b < len(prompt_ids)), \
                    cache_only(b < len(prompt_ids) and self.hidden_layer is None):
                out = self.model(
                    input_ids=ids,
                    **cache_arg(self.model, self.cache),
                    use_cache=True,
                    logits_to_keep=1,
                    output_hidden_states=self.hidden_layer is not None,
                )
            if self.hidden_layer is not None:
                self._append_hidden(out.hidden_states[self.hidden_layer][0], at=a)
            self.cached = b
            if whole and b == len(prompt_ids):
                self._root_logits = out.logits[0, -1]
            if on_progress is not None:
                on_progress(b - (split - total), total)
        check_cancel(cancel)
        if root_alone:
            ids = torch.tensor([prompt_ids[split:]], device=self.device)
            if self.batcher is not None:  # a one-token step's forward: it rides with the other generations' steps
                pos = torch.tensor([[split]], device=self.device)
                logits = self.batcher.step(1, lambda: self._forward(ids, pos, None).logits[0],
                                           (TransformersBackend.run_steps, ids, pos, None, self.cache))
                self._root_logits, self.cached = logits[-1], len(prompt_ids)
            else:
                out = self.model(input_ids=ids, **cache_arg(self.model, self.cache), use_cache=True,
                                 logits_to_keep=1)
                self._root_logits, self.cached = out.logits[0, -1], len(prompt_ids)
        elif split < len(prompt_ids) - 1:
            from ragspec.decoding.backends.attention import AttentionCapture, eager_attention

            self._capture = AttentionCapture(self.model, list(self.attention_heads))
            ids = torch.tensor([prompt_ids[split : split + 1]], device=self.device)
            with self._turn(), eager_attention(self.model, keep_exact=True), prompt_forward():
                out = self.model(input_ids=ids, position_ids=torch.tensor([[split]], device=self.device),
                                 **cache_arg(self.model, self.cache), use_cache=True, logits_to_keep=1,
                                 output_hidden_states=self.hidden_layer is not None)
            if self.hidden_layer is not None:
                self._append_hidden(out.hidden_states[self.hidden_layer][0], at=split)
            self._attention = self._capture.rows[0].clone() if self._capture.rows is not None else None
            self.cached = split + 1
        return (time.perf_counter() - t) * 1000

    def known_next(self) -> int | None:
        """The first answer token, when greedy and the prefill kept the root's logits: known before any step."""
        if self._root_logits is None or not self.sampling.greedy:
            return None
        return int(self._root_logits.argmax())

    # -- one step ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tree: DraftTree) -> StepResult:
        n = len(tree)
        t0 = time.perf_counter()
        logits, out, first, t1 = self._logits(tree)
        self._root_logits = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        preds = logits.argmax(dim=-1).tolist() if self.predictions else None
        if self.sampling.greedy:
            path, bonus = walk(tree, preds.__getitem__) if preds is not None else accept_greedy(tree, logits)
        else:
            path, bonus = accept_sampled(tree, logits, self.sampling, self._gen)
        t3 = time.perf_counter()
        forward_ms = (t3 - t1) * 1000
        # rows of this step's inputs to keep: [root + tree], or [tree] when the prefill cached the root
        keep_rows = list(path) if first else [0] + [i + 1 for i in path]
        if self._capture is not None and self._capture.rows is not None:
            row = self._capture.rows[keep_rows[-1]]
            base = self.cached
            self._attention = torch.cat([row[:base], row[base + torch.tensor(keep_rows, device=row.device)]])
        self._keep(keep_rows, n)
        hidden = None
        if self.hidden_layer is not None:
            hidden = out.hidden_states[self.hidden_layer][0, keep_rows]
            self._append_hidden(hidden, at=self.cached - len(keep_rows))
        self.root = bonus
        t4 = time.perf_counter()
        return StepResult(
            tokens=[tree.tokens[i] for i in path] + [bonus],
            sources=[tree.sources[i] for i in path] + [-1],
            accepted=len(path),
            tree_size=n,
            forward_ms=forward_ms,
            path=path,
            hidden=hidden,
            predictions=preds,
            timings={"inputs": (t1 - t0) * 1000, "forward": (t2 - t1) * 1000, "accept": (t3 - t2) * 1000,
                     "trim": (t4 - t3) * 1000},
        )

    def _logits(self, tree: DraftTree):
        """(logits [1 + n, vocab] of [root + tree], the forward's output or None, root cached, inputs done at):
        the forward appends the rows it runs to the cache."""
        first = self._root_logits is not None
        root_at = self.cached - 1 if first else self.cached  # the root's position
        rows = slice(1, None) if first else slice(None)  # a cached root is not run again
        ids = torch.tensor([([] if first else [self.root]) + tree.tokens], device=self.device)
        pos = torch.tensor([tree.position_ids(root_at)[rows]], device=self.device)
        mask = tree.attention_mask(root_at, self.dtype, self.device)[:, :, rows]
        if self.window:  # one mask per layer type
            mask = {"full_attention": mask, "sliding_attention":
                    tree.attention_mask(root_at, self.dtype, self.device, self.window)[:, :, rows]}
        t1 = time.perf_counter()
        if first and not len(tree):
            return self._root_logits[None], None, first, t1
        if self._capture is not None:
            from ragspec.decoding.backends.attention import eager_attention

            self._capture.reset()
            with self._turn(), eager_attention(self.model, keep_exact=True):
                out = self._forward(ids, pos, mask)
            logits = out.logits[0]
        elif self.batcher is not None and self.hidden_layer is None:  # batched with other generations' steps
            out = None
            logits = self.batcher.step(ids.shape[1], lambda: self._forward(ids, pos, mask).logits[0],
                                       (TransformersBackend.run_steps, ids, pos, mask, self.cache))
        else:
            with self._turn():
                out = self._forward(ids, pos, mask)
            logits = out.logits[0]
        if first:
            logits = torch.cat([self._root_logits[None].to(logits.dtype), logits])
        return logits, out, first, t1

    @torch.inference_mode()
    def score(self, tree: DraftTree):
        """Every row's logits [1 + n, vocab] for [root + tree], the cache left as it was (for tests/tools)."""
        base, keep = self.cached, self._root_logits
        logits, _, _, _ = self._logits(tree)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :base], layer.values[:, :, :base]
        self._root_logits = keep
        return logits

    def _turn(self):
        """The model to this generation alone for one forward, where it shares the model with others."""
        return self.batcher.exclusive() if self.batcher is not None else contextlib.nullcontext()

    @staticmethod
    def run_steps(model, parts: list[tuple]):
        """Several generations' steps ((ids, positions, mask, cache) each) as one forward: each one's logits
        [rows, vocab], or None where they cannot share one (`backends.run_steps`)."""
        from ragspec.runtime.step_forward import step_forward_many

        with torch.inference_mode():
            return step_forward_many(model, parts)

    def _forward(self, ids, pos, mask):
        return self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            **cache_arg(self.model, self.cache),
            use_cache=True,
            output_hidden_states=self.hidden_layer is not None,
        )

    def attention_row(self):
        """The chosen heads' attention (max over heads) of the last cached position over every cached one."""
        return self._attention

    def close(self) -> None:
        if self._capture is not None:
            self._capture.close()
            self._capture = None

    def _keep(self, rows: list[int], n: int) -> None:
        """Trim the cache to the cached prefix + the kept rows of this step's 1 + n inputs."""
        base = self.cached
        end = base + len(rows)
        moved = [(base + i, base + r) for i, r in enumerate(rows) if r != i]
        if moved:  # only the kept rows that are out of place move (in place), never the cached prefix
            dst = torch.tensor([d for d, _ in moved], device=self.device)
            src = torch.tensor([s for _, s in moved], device=self.device)
        for layer in self.cache.layers:
            if moved:
                layer.keys[:, :, dst] = layer.keys[:, :, src]
                layer.values[:, :, dst] = layer.values[:, :, src]
            layer.keys = layer.keys[:, :, :end]
            layer.values = layer.values[:, :, :end]
        self.cached = end

    def fork(self) -> TransformersBackend:
        """A copy with its own KV cache (cloned) and the same random stream: many samples, one prefill."""
        import copy

        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        twin._hidden = None if self._hidden is None else self._hidden.clone()
        return twin

    def _append_hidden(self, rows: torch.Tensor, at: int = 0) -> None:
        """Write rows for positions [at, at + len(rows)) into a buffer that doubles when full."""
        need = at + rows.shape[0]
        if self._hidden is None or self._hidden.shape[0] < need:
            cap = max(need, 2 * (0 if self._hidden is None else self._hidden.shape[0]), 256)
            buf = torch.empty((cap, rows.shape[1]), dtype=torch.float32, device=rows.device)
            if self._hidden is not None:
                buf[: self._hidden.shape[0]] = self._hidden
            self._hidden = buf
        self._hidden[at:need] = rows.float()

    def hidden_states(self) -> torch.Tensor:
        """Hidden states (layer `hidden_layer`) of every cached position, in order: [cached, d]."""
        if self._hidden is None:
            return torch.zeros(0)
        return self._hidden[: self.cached]

    # -- model-derived n-grams (ngrammys) -------------------------------------------------------------------
    @staticmethod
    @torch.inference_mode()
    def bigram_rows(model, tokens, k: int, w: int, max_batch: int = 256) -> dict[int, list[list[int]]]:
        """For each token t: the model's top-k next tokens given t alone (n-grammys §4.1, `model(x)`), each
        extended to w tokens by greedy decoding from [t, a_i] (§4.2 "Extensions"). "Alone" means after the
        model's BOS (`config.bos_token_id`, as the paper's Mistral tokenizer adds it): at position 0 with
        nothing before it, SmolLM2 and Qwen2.5 predict noise (top-5 held the next answer token 6 % of the
        time on the greedy test answers, 34 % after BOS). The distinct tokens run as a batch of independent
        sequences, then w-1 more batched steps over a small cache of their own. Returns {t: k rows of w ids}."""
        from transformers import DynamicCache

        dev = next(model.parameters()).device
        todo = sorted({int(t) for t in tokens})
        out: dict[int, list[list[int]]] = {}
        per = max(1, max_batch // max(1, k))  # distinct tokens per batch: k * per sequences after the first step
        for a in range(0, len(todo), per):
            chunk = todo[a : a + per]
            bos = getattr(model.config, "bos_token_id", None)
            pre = [int(bos)] if isinstance(bos, int) else []
            ids = torch.tensor([pre + [t] for t in chunk], device=dev)  # [D, 1 or 2]
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            top = torch.topk(logits, k, dim=-1).indices  # [D, k], best first
            rows = top.reshape(-1, 1)  # [D*k, 1]
            if w > 1:
                cache = DynamicCache(config=model.config)
                seq = torch.cat([ids.repeat_interleave(k, 0), rows], 1)  # [D*k, 2 or 3]
                o = model(input_ids=seq, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
                nxt = o.logits[:, -1].float().argmax(-1, keepdim=True)
                rows = torch.cat([rows, nxt], 1)
                for j in range(w - 2):
                    pos = torch.full((nxt.shape[0], 1), ids.shape[1] + 1 + j, device=dev)
                    o = model(input_ids=nxt, position_ids=pos, **cache_arg(model, cache), use_cache=True)
                    nxt = o.logits[:, -1].float().argmax(-1, keepdim=True)
                    rows = torch.cat([rows, nxt], 1)
            rows = rows.reshape(len(chunk), k, w).tolist()
            for t, r in zip(chunk, rows):
                out[t] = r
        return out

    # -- t(n) calibration ----------------------------------------------------------------------------------
    @staticmethod
    def cost_key(model) -> str:
        """Names a model/device/dtype/threads/kernels combination: t(n) is cached per key."""
        cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        threads = torch.get_num_threads() if dev.type == "cpu" else 0
        h = hashlib.sha256(cfg.encode()).hexdigest()[:12]
        rt = runtime_of(model)
        packed = "-packed" if rt is not None and rt.packed_linears else ""  # other kernels, other costs
        int8 = f"-int8-{rt.int8}" if rt is not None and rt.int8 else ""  # float32 parameters
        if rt is not None and rt.gguf:  # GGUF blocks, float32 parameters, ragspec's kernels of this build
            int8 += f"-gguf-{rt.kernels}"
        attn = getattr(model.config, "_attn_implementation", None)
        attn = f"-{attn}" if attn and attn != "sdpa" else ""  # ragspec's own attention kernels cost otherwise
        return (f"{getattr(model.config, 'model_type', 'model')}-{h}-{dev.type}-{str(dtype).split('.')[-1]}"
                f"-t{threads}{packed}{attn}{int8}")

    @staticmethod
    def measure_costs(model, context: int, repeats: int, sizes, stop_ms: float | None = None) -> list[float]:
        """Median ms of a forward of n tokens over a `context`-token cache, for each n in `sizes`: `repeats`
        timed runs after a warm-up, fewer where they are long. A size whose timed runs reach `LONG_MS` stops
        there (one 2-s forward of 256 rows says what three do), and no warm-up runs after a forward of over
        100 ms. On a CPU that is most of the time: the 1.5B's table took 32 s on dtype gguf, now 14 s.
        `stop_ms`: past budget.ALWAYS, no larger size once a forward takes this long (fewer figures come back)."""
        from transformers import DynamicCache

        dev = next(model.parameters()).device
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ctx = torch.randint(100, min(vocab, 30000), (1, context), generator=gen).to(dev)
        ms = []
        with torch.inference_mode():
            cache = growing(DynamicCache(config=model.config))  # as the steps run it
            if stand_in_context(cache, model.config, context, next(model.parameters()).dtype, dev):
                first = ctx[:, :WARM_ROWS]  # a short forward warms what reading the context would have
                model(input_ids=first, position_ids=torch.arange(context, context + WARM_ROWS, device=dev)[None],
                      **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
                _back_to(cache, context)
            else:
                model(input_ids=ctx, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
            for n in sizes:
                ids = torch.randint(100, min(vocab, 30000), (1, n), generator=gen).to(dev)
                pos = torch.arange(context, context + n, device=dev)[None]
                warm = 0 if ms and ms[-1] > 100 else 1  # a long forward just ran: the caches are warm
                times = []
                while len(times) < warm + repeats and not (len(times) > warm and sum(times[warm:]) >= LONG_MS):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    model(input_ids=ids, position_ids=pos, **cache_arg(model, cache), use_cache=True)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t) * 1000)
                    _back_to(cache, context)
                timed = sorted(times[warm:])
                ms.append(timed[len(timed) // 2])
                if measured_enough(n, ms[-1], stop_ms):
                    break
        return ms


def _back_to(cache, context: int) -> None:
    """Trim every layer of `cache` back to its first `context` rows (a measured forward's rows dropped)."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :context]
        layer.values = layer.values[:, :, :context]
