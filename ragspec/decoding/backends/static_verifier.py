"""The transformers verifier over a static KV cache, each step's forward replayed from a CUDA graph.

On a GPU a small model's forward is host-bound: ~30 layers of a dozen kernels each, launched one by one from
Python, cost 15–50 ms whatever the row count (docs/benchmarks.md "On CUDA"), so drafting gained little there.
Here each layer's cache is one preallocated buffer. A step's rows (root + tree) are padded to a bucket of 1, 2,
4, … 256 rows written at the slots that follow the cached prefix; a mask over the whole buffer shows each row
its prefix and its ancestors and hides the rest (padding, rows of earlier steps that were not accepted). A
bucket's forward is captured once as a CUDA graph and then replayed: one launch a step. Accepting a path moves
its out-of-place rows; nothing is trimmed, rows past the cached length are hidden and later overwritten. The
cache, the input buffers and the graphs outlive a generation: the model's next generation reuses them (a capture
costs a few forwards, too much to pay per answer).

Generations running at once share that one buffer, each in a region of its own slots (`Held.take`), so the rows
of several generations' steps pack into one bucket and one replay (continuous batching, `run_parts`): each row
writes at its generation's slots and its mask shows only its region's prefix and its tree ancestors. A forward's
padding rows write into the buffer's first `SCRATCH` slots, which no mask shows. A region that fills moves to a
larger one; the buffer grows (graphs recaptured) when the regions need it, and shrinks back once none is held.

Without CUDA the same path runs eagerly (the tests check it on the CPU); `RAGSPEC_STATIC_VERIFIER` picks it:
`auto` (default: on CUDA), `1` (everywhere), `0` (never). A generation that needs what only the dynamic
backend does (PLD+ hidden states or attention rows, sliding-window layers) runs on `TransformersBackend`; the
source KV cache and a prefix store are not used here (a GPU reads a prompt at ~35k tokens/s).
"""

from __future__ import annotations

import contextlib
import itertools
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
from ragspec.runtime.cache_only import cache_only

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows a forward runs, padded up; one CUDA graph each
ROOM = 1024  # slots a generation's region holds beyond its prompt before it moves to one twice as large
SCRATCH = BUCKETS[-1]  # the buffer's first slots: where a bucket's padding rows write (no mask shows them)


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
    """A slot cache with its input buffers and captured graphs, kept per model between generations and shared by
    the generations running at once, each in its own region of slots. Every use holds `lock`."""

    cache: DynamicCache | None = None
    graphs: dict = field(default_factory=dict)  # bucket -> (graph, its logits output)
    inputs: dict = field(default_factory=dict)  # bucket -> (int buffer [3, N]: ids, positions, slots; mask)
    regions: dict = field(default_factory=dict)  # owner key -> [start, end) slots it holds
    graph_error: str | None = None  # why a capture failed, if one did (steps then run eagerly)
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].capacity

    def take(self, model, owner: int, size: int, keep: tuple[int, int] | None = None) -> int:
        """A region of `size` slots for `owner` (the first free gap after the scratch slots, the buffer grown
        where none fits; emptied and made small again while nobody holds a region). `keep` = (start, n): the
        owner's current region, whose first n slots move to the new one and which is then freed."""
        if self.cache is None or (not self.regions and self.capacity > 2 * _capacity(SCRATCH + size)):
            self.cache = slot_cache(model.config, _capacity(SCRATCH + size))
            self.graphs.clear()
            self.inputs.clear()
        start = SCRATCH
        for a, b in sorted(self.regions.values()):
            if a - start >= size:
                break
            start = max(start, b)
        if start + size > self.capacity:
            self.grow(_capacity(start + size))
        if keep is not None and keep[1]:
            src = torch.arange(keep[0], keep[0] + keep[1], device=self.cache.layers[0].keys.device)
            self.move(src, src + (start - keep[0]))
        self.regions[owner] = (start, start + size)
        return start

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's keys and values at slots `src` copied to slots `dst`."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys[:, :, dst] = layer.keys[:, :, src]
                layer.values[:, :, dst] = layer.values[:, :, src]

    def release(self, owner: int) -> None:
        self.regions.pop(owner, None)

    def grow(self, capacity: int) -> None:
        """Buffers of `capacity` slots holding the old ones' rows; the captured graphs and inputs go (their
        shapes name the old width)."""
        for layer in self.cache.layers:
            layer.grow(capacity)
        self.graphs.clear()
        self.inputs.clear()


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Held
_LOCK = threading.Lock()
_OWNERS = itertools.count(1)


def held_by(model) -> Held:
    """The model's shared slot cache and graphs (made empty on first use)."""
    with _LOCK:
        return _HELD.setdefault(model, Held())


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


@dataclass
class Part:
    """One generation's rows of a forward: token ids, positions, the slots they write, and their mask over the
    generation's region (columns from its first slot `base`)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    base: int
    mask: torch.Tensor  # [rows, width] additive, the dtype's minimum where hidden


@torch.inference_mode()
def run_parts(model, held: Held, parts: list[Part]) -> list[torch.Tensor]:
    """The rows of `parts` as one bucket's forward (a graph replay on CUDA): each part's logits [rows, vocab].
    Padding rows write the scratch slots and see slot 0 only; no part's mask shows another's region."""
    with held.lock:
        sizes = [len(p.ids) for p in parts]
        total = sum(sizes)
        size = bucket(total)
        ints, mask = _buffers(model, held, size)
        host = torch.zeros((3, size), dtype=torch.long)
        at = 0
        for p, r in zip(parts, sizes):
            host[0, at : at + r] = torch.tensor(p.ids)
            host[1, at : at + r] = torch.tensor(p.positions)
            host[2, at : at + r] = torch.tensor(p.slots)
            at += r
        host[2, total:] = torch.arange(size - total)
        ints.copy_(host)
        mask.fill_(torch.finfo(mask.dtype).min)
        at = 0
        for p, r in zip(parts, sizes):
            mask[0, 0, at : at + r, p.base : p.base + p.mask.shape[1]] = p.mask.to(mask.device, mask.dtype)
            at += r
        mask[0, 0, total:, 0] = 0
        logits = _run(model, held, size)[0, :total]
        return [x.clone() for x in logits.split(sizes)]


def _buffers(model, held: Held, size: int):
    if size not in held.inputs:
        param = next(model.parameters())
        ints = torch.zeros((3, size), dtype=torch.long, device=param.device)
        mask = torch.zeros((1, 1, size, held.capacity), dtype=param.dtype, device=param.device)
        held.inputs[size] = (ints, mask)
    return held.inputs[size]


def _forward_bucket(model, held: Held, size: int):
    ints, mask = held.inputs[size]
    held.cache.slots.active = ints[2]
    return model(input_ids=ints[0:1], position_ids=ints[1:2], attention_mask=mask,
                 **cache_arg(model, held.cache), use_cache=True).logits


def _run(model, held: Held, size: int) -> torch.Tensor:
    """The bucket's logits [1, size, vocab]: a graph replay on CUDA (captured at first use), else eager."""
    if held.graph_error is not None or next(model.parameters()).device.type != "cuda" \
            or not StaticBackend.graphs_wanted(model):
        return _forward_bucket(model, held, size)
    if size not in held.graphs:
        try:
            held.graphs[size] = _record(model, held, size)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: run eagerly from now on
            held.graph_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            warnings.warn(f"CUDA graph capture failed, the verifier runs eagerly: {held.graph_error}", stacklevel=2)
            torch.cuda.synchronize()
            return _forward_bucket(model, held, size)
    graph, out = held.graphs[size]
    graph.replay()
    return out


def _record(model, held: Held, size: int):
    """Warm the bucket's forward up on a side stream (as torch's CUDA graph docs ask), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _forward_bucket(model, held, size)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a pool of its own: buckets replay in any order
        out = _forward_bucket(model, held, size)
    return graph, out


class StaticBackend(TransformersBackend):
    """`TransformersBackend`'s steps over a region of the model's slot cache, replayed from CUDA graphs on a GPU;
    with a step batcher, batched with the other generations' steps (see the module)."""

    name = "transformers"
    supports_prefix = False  # a prefix store holds dynamic caches

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_layer is not None or self.attention_heads:
            raise ValueError("the static verifier keeps no hidden states or attention rows: use TransformersBackend")
        self._held: Held | None = None
        self._owner = next(_OWNERS)  # this generation's key among the regions
        self.base = SCRATCH  # the first slot of its region
        self.window = None

    @staticmethod
    def graphs_wanted(model) -> bool:
        """`cuda_graphs: false` (RAGSPEC_CUDA_GRAPHS=0) runs the static steps eagerly on CUDA too (to measure what
        graphs save)."""
        from ragspec.runtime.model_runtime import options_of
        from ragspec.runtime.options import overridden

        return overridden(options_of(model)).cuda_graphs

    @property
    def graph_error(self) -> str | None:
        """Why capture failed, if it did (the steps then run eagerly)."""
        return self._held.graph_error if self._held is not None else None

    @property
    def _graphs(self) -> dict:
        """The captured graphs this generation replays (bucket -> (graph, logits))."""
        return self._held.graphs if self._held is not None else {}

    # -- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], prefix=None, on_progress=None, cancel=None, sources=None) -> float:
        """Cache the whole prompt (its last token, the first root, too) in `PREFILL_CHUNK` chunks, eagerly, into
        a region of its own, and keep the root's logits for the first step. `prefix` is not used (see the
        module); `sources` are computed, not assembled (the plan's `fallback` says so)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if sources is not None:
            sources.fallback = "the static (CUDA graph) verifier computes the prompt"
        t = time.perf_counter()
        self.close()
        self._held = held = held_by(self.model)
        with self._turn(), held.lock:
            self.base = held.take(self.model, self._owner, len(prompt_ids) + ROOM)
            self.cache = held.cache
        self.cached, self.root, self._hidden = 0, int(prompt_ids[-1]), None
        total = len(prompt_ids)
        lo = torch.finfo(self.dtype).min
        for a, b in chunks(0, total):
            check_cancel(cancel)
            with self._turn(), held.lock, cache_only(b < total):  # only the last chunk's logits are read
                rows = torch.arange(a, b, device=self.device)
                cols = torch.arange(held.capacity, device=self.device)[None, :] - self.base
                mask = torch.where((cols >= 0) & (cols <= rows[:, None]), 0.0, lo).to(self.dtype)[None, None]
                held.cache.slots.active = rows + self.base
                out = self.model(input_ids=torch.tensor([prompt_ids[a:b]], device=self.device),
                                 position_ids=rows[None], attention_mask=mask,
                                 **cache_arg(self.model, held.cache), use_cache=True, logits_to_keep=1)
                last = out.logits[0, -1].clone()
            self.cached = b
            if on_progress is not None:
                on_progress(b, total)
        self._root_logits = last
        check_cancel(cancel)
        return (time.perf_counter() - t) * 1000

    @property
    def capacity(self) -> int:
        return self._held.capacity

    # -- one step ------------------------------------------------------------------------------------------
    def _logits(self, tree: DraftTree):
        first = self._root_logits is not None
        t1 = time.perf_counter()
        if first and not len(tree):
            return self._root_logits[None], None, first, t1
        root_at = self.cached - 1 if first else self.cached
        lead = [] if first else [self.root]
        rows = len(lead) + len(tree)
        start, end = self._held.regions[self._owner]
        if self.base + self.cached + rows > end:  # the region is full: to one twice as large
            with self._turn(), self._held.lock:
                self.base = self._held.take(self.model, self._owner, max(2 * (end - start), self.cached + rows + ROOM),
                                            keep=(self.base, self.cached))
        at = self.base + self.cached
        part = Part(ids=lead + tree.tokens, positions=tree.position_ids(root_at)[1 if first else 0 :],
                    slots=list(range(at, at + rows)), base=self.base,
                    mask=tree.attention_mask(root_at, self.dtype)[0, 0, 1 if first else 0 :])
        t1 = time.perf_counter()
        if self.batcher is not None:  # batched with other generations' steps
            logits = self.batcher.step(rows, lambda: run_parts(self.model, self._held, [part])[0],
                                       (StaticBackend.run_steps, self._held, part))
        else:
            logits = run_parts(self.model, self._held, [part])[0]
        if first:
            logits = torch.cat([self._root_logits[None].to(logits.dtype), logits])
        return logits, None, first, t1

    def close(self) -> None:
        """Give this generation's region back; the cache and graphs stay for the model's next generations."""
        super().close()
        if self._held is not None:
            with self._held.lock:
                self._held.release(self._owner)
            self._held = None

    @torch.inference_mode()
    def score(self, tree: DraftTree):
        """Every row's logits [1 + n, vocab] for [root + tree]; the cached length stays (the rows written past
        it are hidden from later steps)."""
        keep = self._root_logits
        logits, _, _, _ = self._logits(tree)
        self._root_logits = keep
        return logits.clone()

    def _keep(self, rows: list[int], n: int) -> None:
        """Keep the accepted rows of this step's inputs (input row r sits at slot base + cached + r): only the
        out-of-place ones move; nothing is trimmed."""
        at = self.base + self.cached
        moved = [(at + i, at + r) for i, r in enumerate(rows) if r != i]
        if moved:
            dst = torch.tensor([d for d, _ in moved], device=self.device)
            src = torch.tensor([s for _, s in moved], device=self.device)
            with self._held.lock:
                self._held.move(src, dst)
        self.cached += len(rows)

    def fork(self) -> StaticBackend:
        """A copy with a slot cache of its own (cloned), no captured graphs, the same random stream, and no
        batcher (its steps run alone)."""
        import copy

        twin = copy.copy(self)
        held = Held()
        with self._held.lock:
            held.cache = slot_cache(self.model.config, self.capacity)
            for mine, theirs in zip(held.cache.layers, self._held.cache.layers):
                if theirs.is_initialized:
                    mine.dtype, mine.device, mine.is_initialized = theirs.dtype, theirs.device, True
                    mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
            twin._owner = next(_OWNERS)
            held.regions[twin._owner] = self._held.regions[self._owner]
        twin._held, twin.cache, twin.batcher = held, held.cache, None
        return twin

    @staticmethod
    def run_steps(model, parts: list[tuple]):
        """Several generations' steps ((held, Part) each) as one bucket's forward (`backends.run_steps`)."""
        return run_parts(model, parts[0][0], [p[1] for p in parts])

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
