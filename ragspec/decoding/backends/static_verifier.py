"""The transformers verifier over a static KV cache, each step's forward replayed from a CUDA graph.

On a GPU a small model's forward is host-bound: ~30 layers of a dozen kernels each, launched one by one from
Python, cost 15–50 ms whatever the row count (docs/benchmarks.md "On CUDA"), so drafting gained little there.
Here each layer's cache is one preallocated buffer. A step's rows (root + tree) are padded to a bucket of 1, 2,
4, … 256 rows written at the slots that follow the cached prefix; a mask over the whole buffer shows each row
its prefix and its ancestors and hides the rest (padding, rows of earlier steps that were not accepted). A
bucket's forward is captured once as a CUDA graph and then replayed: one launch a step. Accepting a path moves
its out-of-place rows; nothing is trimmed, rows past the cached length are hidden and later overwritten. The
cache, the input buffers and the graphs outlive a generation: the model's next generation reuses them (a capture
costs a few forwards, too much to pay per answer), unless another generation holds them at that moment.

Without CUDA the same path runs eagerly (the tests check it on the CPU); `RAGSPEC_STATIC_VERIFIER` picks it:
`auto` (default: on CUDA), `1` (everywhere), `0` (never). A generation that needs what only the dynamic
backend does (PLD+ hidden states or attention rows, sliding-window layers) runs on `TransformersBackend`; the
source KV cache and a prefix store are not used here (a GPU reads a prompt at ~35k tokens/s).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ragspec.decoding.backends.base import chunks
from ragspec.decoding.backends.transformers import TransformersBackend, cache_arg, sliding_window
from ragspec.decoding.budget import measured_enough
from ragspec.decoding.tree import DraftTree
from ragspec.errors import check_cancel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows a forward runs, padded up; one CUDA graph each
ROOM = 1024  # slots a cache holds beyond the prompt before it doubles


def wanted(model) -> bool:
    """Whether a model's generations run here (`RAGSPEC_STATIC_VERIFIER`, see the module)."""
    from ragspec.runtime.model_runtime import options_of
    from ragspec.runtime.options import overridden

    choice = overridden(options_of(model)).static_verifier
    if choice in ("0", "no", "off", "false") or sliding_window(model.config):
        return False
    if choice in ("1", "yes", "on", "true"):
        return True
    return next(model.parameters()).device.type == "cuda"


def bucket(rows: int) -> int:
    for size in BUCKETS:
        if rows <= size:
            return size
    raise ValueError(f"a step of {rows} rows is over the largest bucket ({BUCKETS[-1]})")


@dataclass
class Held:
    """A slot cache with its input buffers and captured graphs, kept per model between generations."""

    cache: DynamicCache | None = None
    graphs: dict = field(default_factory=dict)  # bucket -> (graph, its logits output)
    inputs: dict = field(default_factory=dict)  # bucket -> (int buffer [3, N]: ids, positions, slots; mask)
    busy: bool = False


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Held
_LOCK = threading.Lock()


def acquire(model) -> Held:
    """The model's kept cache and graphs, marked busy; a private set while another generation holds them."""
    with _LOCK:
        held = _HELD.setdefault(model, Held())
        if held.busy:
            return Held(busy=True)
        held.busy = True
        return held


class Slots:
    """Where the next forward's rows go: the index tensor every layer of one cache writes through."""

    def __init__(self):
        self.active: torch.Tensor | None = None


class SlotLayer(DynamicLayer):
    """A cache layer over a fixed buffer [1, heads, capacity, dim]: an update writes its rows at the shared
    slots and returns the whole buffer (the mask says which rows count)."""

    def __init__(self, slots: Slots, capacity: int):
        super().__init__()
        self.slots, self.capacity = slots, capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            shape = (key_states.shape[0], key_states.shape[1], self.capacity)
            self.keys = key_states.new_zeros((*shape, key_states.shape[3]))
            self.values = value_states.new_zeros((*shape, value_states.shape[3]))
            self.is_initialized = True
        self.keys.index_copy_(2, self.slots.active, key_states)
        self.values.index_copy_(2, self.slots.active, value_states)
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        """New buffers of `capacity` slots holding the old ones' rows (captured graphs then hold stale ones)."""
        if self.is_initialized:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)
        self.capacity = capacity


def slot_cache(config, capacity: int) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.slots = Slots()
    cache.layers = [SlotLayer(cache.slots, capacity) for _ in cache.layers]
    return cache


class StaticBackend(TransformersBackend):
    """`TransformersBackend`'s steps over a slot cache, replayed from CUDA graphs on a GPU (see the module)."""

    name = "transformers"
    supports_prefix = False  # a prefix store holds dynamic caches

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_layer is not None or self.attention_heads:
            raise ValueError("the static verifier keeps no hidden states or attention rows: use TransformersBackend")
        self.graphs_enabled = self.device.type == "cuda" and self.graphs_wanted(self.model)
        self.graph_error: str | None = None  # why capture failed, if it did (the steps then run eagerly)
        self._held: Held | None = None
        self.window = None

    @staticmethod
    def graphs_wanted(model) -> bool:
        """`cuda_graphs: false` (RAGSPEC_CUDA_GRAPHS=0) runs the static steps eagerly on CUDA too (to measure what
        graphs save)."""
        from ragspec.runtime.model_runtime import options_of
        from ragspec.runtime.options import overridden

        return overridden(options_of(model)).cuda_graphs

    # -- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], prefix=None, on_progress=None, cancel=None, sources=None) -> float:
        """Cache the whole prompt (its last token, the first root, too) in `PREFILL_CHUNK` chunks, eagerly,
        and keep the root's logits for the first step. `prefix` is not used (see the module); `sources` are
        computed, not assembled (the plan's `fallback` says so)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if sources is not None:
            sources.fallback = "the static (CUDA graph) verifier computes the prompt"
        t = time.perf_counter()
        self.close()
        self._held = held = acquire(self.model)
        need = _capacity(len(prompt_ids) + ROOM)
        if held.cache is None or held.cache.layers[0].capacity < need:
            held.cache = slot_cache(self.model.config, need)
            held.graphs.clear()
            held.inputs.clear()
        self.cache = held.cache
        self.cached, self.root, self._hidden = 0, int(prompt_ids[-1]), None
        total = len(prompt_ids)
        lo = torch.finfo(self.dtype).min
        for a, b in chunks(0, total):
            check_cancel(cancel)
            rows = torch.arange(a, b, device=self.device)
            cols = torch.arange(self.capacity, device=self.device)
            mask = torch.where(cols[None, :] <= rows[:, None], 0.0, lo).to(self.dtype)[None, None]
            self.cache.slots.active = rows
            out = self.model(input_ids=torch.tensor([prompt_ids[a:b]], device=self.device), position_ids=rows[None],
                             attention_mask=mask, **cache_arg(self.model, self.cache), use_cache=True,
                             logits_to_keep=1)
            self.cached = b
            if on_progress is not None:
                on_progress(b, total)
        self._root_logits = out.logits[0, -1].clone()
        check_cancel(cancel)
        return (time.perf_counter() - t) * 1000

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].capacity

    # -- one step ------------------------------------------------------------------------------------------
    def _logits(self, tree: DraftTree):
        first = self._root_logits is not None
        t1 = time.perf_counter()
        if first and not len(tree):
            return self._root_logits[None], None, first, t1
        root_at = self.cached - 1 if first else self.cached
        lead = [] if first else [self.root]
        rows = len(lead) + len(tree)
        size = bucket(rows)
        if self.cached + size > self.capacity:
            self._grow(_capacity(self.cached + size + ROOM))
        ints, mask = self._buffers(size)
        host = torch.zeros((3, size), dtype=torch.long)
        host[0, :rows] = torch.tensor(lead + tree.tokens)
        pos = tree.position_ids(root_at)[1 if first else 0 :]
        host[1, :rows] = torch.tensor(pos)
        host[1, rows:] = pos[-1]
        host[2] = torch.arange(self.cached, self.cached + size)
        m = torch.full((size, self.capacity), torch.finfo(self.dtype).min, dtype=self.dtype)
        tree_mask = tree.attention_mask(root_at, self.dtype)[0, 0, 1 if first else 0 :]
        m[:rows, : tree_mask.shape[1]] = tree_mask
        m[rows:, 0] = 0  # padding rows see slot 0 only: their outputs and cached rows are never read
        ints.copy_(host)
        mask.copy_(m[None, None])
        t1 = time.perf_counter()
        logits = self._run(size)[0, :rows]
        if first:
            logits = torch.cat([self._root_logits[None].to(logits.dtype), logits])
        return logits, None, first, t1

    @property
    def _graphs(self) -> dict:
        return self._held.graphs

    @property
    def _inputs(self) -> dict:
        return self._held.inputs

    def close(self) -> None:
        """Hand the cache and graphs back for the model's next generation."""
        super().close()
        if self._held is not None:
            self._held.busy = False
            self._held = None

    def _buffers(self, size: int):
        if size not in self._inputs:
            ints = torch.zeros((3, size), dtype=torch.long, device=self.device)
            mask = torch.zeros((1, 1, size, self.capacity), dtype=self.dtype, device=self.device)
            self._inputs[size] = (ints, mask)
        return self._inputs[size]

    def _forward_bucket(self, size: int):
        ints, mask = self._inputs[size]
        self.cache.slots.active = ints[2]
        return self.model(input_ids=ints[0:1], position_ids=ints[1:2], attention_mask=mask,
                          **cache_arg(self.model, self.cache), use_cache=True).logits

    def _run(self, size: int) -> torch.Tensor:
        """The bucket's logits [1, size, vocab]: a graph replay on CUDA (captured at first use), else eager."""
        if not self.graphs_enabled:
            return self._forward_bucket(size)
        if size not in self._graphs:
            try:
                self._graphs[size] = self._record(size)
            except Exception as err:  # noqa: BLE001 - an op that cannot be captured: run eagerly from now on
                self.graph_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                self.graphs_enabled = False
                warnings.warn(f"CUDA graph capture failed, the verifier runs eagerly: {self.graph_error}",
                              stacklevel=2)
                torch.cuda.synchronize()
                return self._forward_bucket(size)
        graph, out = self._graphs[size]
        graph.replay()
        return out

    def _record(self, size: int):
        """Warm the bucket's forward up on a side stream (as torch's CUDA graph docs ask), then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward_bucket(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a pool of its own: buckets replay in any order
            out = self._forward_bucket(size)
        return graph, out

    def _grow(self, capacity: int) -> None:
        for layer in self.cache.layers:
            layer.grow(capacity)
        self._graphs.clear()
        self._inputs.clear()

    @torch.inference_mode()
    def score(self, tree: DraftTree):
        """Every row's logits [1 + n, vocab] for [root + tree]; the cached length stays (the rows written past
        it are hidden from later steps)."""
        keep = self._root_logits
        logits, _, _, _ = self._logits(tree)
        self._root_logits = keep
        return logits.clone()

    def _keep(self, rows: list[int], n: int) -> None:
        """Keep the accepted rows of this step's inputs (input row r sits at slot cached + r): only the
        out-of-place ones move; nothing is trimmed."""
        base = self.cached
        moved = [(base + i, base + r) for i, r in enumerate(rows) if r != i]
        if moved:
            dst = torch.tensor([d for d, _ in moved], device=self.device)
            src = torch.tensor([s for _, s in moved], device=self.device)
            for layer in self.cache.layers:
                layer.keys[:, :, dst] = layer.keys[:, :, src]
                layer.values[:, :, dst] = layer.values[:, :, src]
        self.cached = base + len(rows)

    def fork(self) -> StaticBackend:
        """A copy with its own slot cache (cloned), no captured graphs, and the same random stream."""
        import copy

        twin = copy.copy(self)
        twin.cache = slot_cache(self.model.config, self.capacity)
        twin._held = Held(cache=twin.cache, busy=True)
        for mine, theirs in zip(twin.cache.layers, self.cache.layers):
            if theirs.is_initialized:
                mine.dtype, mine.device, mine.is_initialized = theirs.dtype, theirs.device, True
                mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
        return twin

    # -- t(n) calibration ----------------------------------------------------------------------------------
    @staticmethod
    def cost_key(model) -> str:
        graphs = "-graphs" if next(model.parameters()).device.type == "cuda" else ""
        return TransformersBackend.cost_key(model) + "-static" + graphs

    @staticmethod
    def measure_costs(model, context: int, repeats: int, sizes, stop_ms: float | None = None) -> list[float]:
        """Median ms of a step of n rows (inputs, forward — a graph replay on CUDA — and nothing kept) over a
        `context`-token cache, for each n in `sizes` (up to the first that takes `stop_ms`)."""
        from ragspec.decoding.sampling import SamplingSettings

        dev = next(model.parameters()).device
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, min(vocab, 30000), (context,), generator=gen).tolist()
        backend = StaticBackend(model, SamplingSettings())
        backend.prefill(prompt)
        backend._root_logits = None  # every measured step runs its root too: n rows
        ms = []
        with torch.inference_mode(), contextlib.closing(backend):
            for n in sizes:
                tree = DraftTree()
                tree.add_chain(torch.randint(100, min(vocab, 30000), (n - 1,), generator=gen).tolist())
                times = []
                for _ in range(repeats + 1):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    backend._logits(tree)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t) * 1000)
                ms.append(sorted(times[1:])[len(times[1:]) // 2])
                if measured_enough(n, ms[-1], stop_ms):
                    break
        return ms


def _capacity(slots: int) -> int:
    """Slots rounded up to a power of two (the mask's width; aligned for the attention kernels)."""
    return 1 << max(10, (slots - 1).bit_length())
