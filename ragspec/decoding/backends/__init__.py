"""Verifier backends: `transformers` (a Hugging Face model, the default) and `llama.cpp` (a GGUF run by
llama-cpp-python). The loop asks `make_backend` for one per generation; nothing else looks at which.
`calibrate` has the model's backend measure the forward cost t(n) the draft budget plans with."""

from __future__ import annotations

import fcntl
import threading
import weakref
from pathlib import Path

from ragspec.decoding.backends.base import Backend, StepResult
from ragspec.decoding.budget import SIZES, CostModel
from ragspec.paths import ragspec_home, read_json, write_json

NAMES = ("transformers", "llama.cpp")


def is_llama(model) -> bool:
    return type(model).__name__ == "LlamaCppModel"  # by name: no llama_cpp import to ask


def backend_class(model):
    """The backend class that runs this loaded model."""
    if is_llama(model):
        from ragspec.decoding.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend
    from ragspec.decoding.backends.static_verifier import StaticBackend, wanted
    from ragspec.decoding.backends.transformers import TransformersBackend

    return StaticBackend if wanted(model) else TransformersBackend


_batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_batchers_guard = threading.Lock()


def step_batcher(model, lock: threading.Lock | None = None):
    """The model's `StepBatcher` (one per model object, made on first call with the model's `lock`) where its
    backend can batch steps across generations (the transformers backends), else None (llama.cpp): its
    generations keep the model to themselves. Without `lock`: the existing one, if any."""
    with _batchers_guard:
        found = _batchers.get(model)
        if found is not None or lock is None or is_llama(model):
            return found
        from ragspec.decoding.step_batcher import StepBatcher

        ref = weakref.ref(model)  # the batcher must not keep its model alive
        made = _batchers[model] = StepBatcher(lock, lambda payloads: run_steps(ref(), payloads))
        return made


def run_steps(model, payloads: list[tuple]):
    """Several generations' steps as one forward, where one backend made them all: each payload is (that
    backend's batched runner, its step's data). Each step's logits, or None where they cannot share one."""
    runner = payloads[0][0]
    if any(p[0] is not runner for p in payloads):
        return None
    return runner(model, [p[1:] for p in payloads])


def make_backend(model, sampling, hidden_layer=None, attention_heads=(), predictions=False,
                 batcher=None) -> Backend:
    """A fresh verifier for one generation on `model`. `predictions`: return every row's argmax per step.
    PLD+ drafters (hidden states, attention rows) run on the dynamic transformers backend. `batcher`: a
    `step_batcher.StepBatcher`, taken by the backends whose steps can share forwards (the transformers ones,
    without PLD+'s hidden states or attention rows); the others run without it."""
    cls = backend_class(model)
    if hidden_layer is not None or attention_heads:
        from ragspec.decoding.backends.transformers import TransformersBackend

        cls = TransformersBackend if cls.__name__ == "StaticBackend" else cls
    kw = {"predictions": True} if predictions else {}
    if batcher is not None and cls.__name__ in ("TransformersBackend", "StaticBackend") and hidden_layer is None \
            and not attention_heads:
        kw["batcher"] = batcher
    return cls(model, sampling, hidden_layer=hidden_layer, attention_heads=attention_heads, **kw)


def describe(model) -> str:
    """Which verifier runs this model's generations, in words (for benchmark records)."""
    cls = backend_class(model)
    if cls.__name__ != "StaticBackend":
        return cls.name
    graphs = next(model.parameters()).device.type == "cuda" and cls.graphs_wanted(model)
    return "transformers static cache" + (" + CUDA graphs" if graphs else "")


def cost_key(model) -> str:
    """The calibration cache key of a loaded model (its backend decides what goes in it)."""
    return backend_class(model).cost_key(model)


STOP_MS = 1000.0  # t(n) measurement: no larger size once a forward takes this long
BUSY = 0.7  # a t(n) measurement that got less than this share of its cores ran beside another job
TRIES = 3  # loads that measure contended figures (again) before they are kept as they are


def calibrate(model, context: int = 384, repeats: int = 3, cache_dir: Path | None = None, force: bool = False,
              sizes=SIZES, progress=None) -> CostModel:
    """Measure (or load) t(n): the median wall time of a forward of n tokens over a `context`-token cache.
    The model's backend measures (transformers or llama.cpp); the cache file is keyed by its `cost_key`.
    `progress(line)` hears when it measures (8 s for the 0.5B, 14 s for the 1.5B on dtype gguf, 2 cores).
    Figures measured beside another job (under BUSY of the process's cores, measured again at once) would plan
    every later ask's drafts with a slow machine's costs: they are kept marked, and the next loads measure again,
    TRIES in all, keeping the least contended. Past budget.ALWAYS, sizes after the first forward of STOP_MS are not
    measured: no draft tree that big pays, and `CostModel.time` extrapolates from the last two (a Zen 3's 1.5B
    spent 17 of its 31 s on t(64…256))."""
    backend = backend_class(model)
    folder = cache_dir or ragspec_home() / "calibration"
    path = folder / f"{backend.cost_key(model)}.json"
    if not force and (data := read_json(path)) is not None and not _measure_again(data):
        return _costs(data)
    folder.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    # one measurement per key at a time: two processes loading one model together (a server and a notebook)
    # would each measure beside the other, slowly and wrongly; the second waits and reads the first's figures
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = None if force else read_json(path)
        if old is not None and not _measure_again(old):
            return _costs(old)
        say(f"measuring this model's step cost for the draft budget once (forwards of {sizes[0]}-{sizes[-1]} "
            f"tokens, or until one takes {STOP_MS / 1000:g} s; kept in {path})" if old is None else
            f"measuring this model's step cost again: the kept figures were measured beside another job "
            f"({old['cpu_share']:.0%} of the cores; try {old.get('tries', 1) + 1} of {TRIES})")
        threads = _cpu_threads(model)
        ms, share = _measure(backend, model, context, repeats, sizes, threads)
        if share is not None and share < BUSY:
            say(f"the step cost measurement got {share:.0%} of its cores (another job ran): measuring again…")
            ms, share = max((ms, share), _measure(backend, model, context, repeats, sizes, threads),
                            key=lambda r: r[1])
        tries = old.get("tries", 1) + 1 if old is not None else 1
        measured = list(sizes)[:len(ms)]
        if old is not None and share is not None and old["cpu_share"] > share:  # the old figures were less disturbed
            measured, ms, share = old["sizes"], old["ms"], old["cpu_share"]
        contended = share is not None and share < BUSY
        data = CostModel(measured, ms).as_dict() | {
            "context": context, "key": path.stem, "backend": backend.name, "threads": threads,
            "cpu_share": share, "contended": contended, "tries": tries}
        write_json(path, data)
        if contended:
            say(f"the step cost was measured beside another job ({share:.0%} of the cores): used for now, "
                + ("measured again at the next load" if tries < TRIES else f"kept after {tries} tries"))
    return _costs(data)


def _cpu_threads(model) -> int | None:
    """The threads a forward of `model` runs on, or None on a GPU (its CPU time says nothing of contention)."""
    if is_llama(model):
        return model.n_threads
    import torch

    return torch.get_num_threads() if next(model.parameters()).device.type == "cpu" else None


def _measure(backend, model, context, repeats, sizes, threads) -> tuple[list[float], float | None]:
    """The backend's t(n) and the share of `threads` cores this process got while measuring them."""
    import resource
    import time

    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    ms = backend.measure_costs(model, context, repeats, list(sizes), stop_ms=STOP_MS)
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return ms, (round(cpu_s / ((w1 - w0) * threads), 2) if threads else None)


def _measure_again(data: dict) -> bool:
    return bool(data.get("contended")) and data.get("tries", 1) < TRIES


def _costs(data: dict) -> CostModel:
    return CostModel(data["sizes"], data["ms"])


__all__ = ["NAMES", "Backend", "StepResult", "backend_class", "calibrate", "cost_key", "describe", "is_llama", "make_backend"]
