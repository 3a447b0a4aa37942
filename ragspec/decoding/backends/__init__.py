"""Verifier backends: `transformers` (a Hugging Face model, the default) and `llama.cpp` (a GGUF run by
llama-cpp-python). The loop asks `make_backend` for one per generation; nothing else looks at which.
`calibrate` has the model's backend measure the forward cost t(n) the draft budget plans with."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ragspec.decoding.backends.base import Backend, StepResult
from ragspec.decoding.budget import SIZES, CostModel
from ragspec.paths import ragspec_home

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


def make_backend(model, sampling, hidden_layer=None, attention_heads=(), predictions=False) -> Backend:
    """A fresh verifier for one generation on `model`. `predictions`: return every row's argmax per step.
    PLD+ drafters (hidden states, attention rows) run on the dynamic transformers backend."""
    cls = backend_class(model)
    if hidden_layer is not None or attention_heads:
        from ragspec.decoding.backends.transformers import TransformersBackend

        cls = TransformersBackend if cls.__name__ == "StaticBackend" else cls
    if predictions:
        return cls(model, sampling, hidden_layer=hidden_layer, attention_heads=attention_heads, predictions=True)
    return cls(model, sampling, hidden_layer=hidden_layer, attention_heads=attention_heads)


def describe(model) -> str:
    """Which verifier runs this model's generations, in words (for benchmark records)."""
    cls = backend_class(model)
    if cls.__name__ != "StaticBackend":
        return cls.name
    graphs = next(model.parameters()).device.type == "cuda" and cls.graphs_wanted()
    return "transformers static cache" + (" + CUDA graphs" if graphs else "")


def cost_key(model) -> str:
    """The calibration cache key of a loaded model (its backend decides what goes in it)."""
    return backend_class(model).cost_key(model)


def calibrate(model, context: int = 384, repeats: int = 3, cache_dir: Path | None = None, force: bool = False,
              sizes=SIZES, progress=None) -> CostModel:
    """Measure (or load) t(n): the median wall time of a forward of n tokens over a `context`-token cache.
    The model's backend measures (transformers or llama.cpp); the cache file is keyed by its `cost_key`.
    `progress(line)` hears when it measures (8 s for the 0.5B, 14 s for the 1.5B on dtype gguf, 2 cores)."""
    backend = backend_class(model)
    folder = cache_dir or ragspec_home() / "calibration"
    path = folder / f"{backend.cost_key(model)}.json"
    if path.exists() and not force:
        return _read_costs(path)
    folder.mkdir(parents=True, exist_ok=True)
    # one measurement per key at a time: two processes loading one model together (a server and a notebook)
    # would each measure beside the other, slowly and wrongly; the second waits and reads the first's figures
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and not force:
            return _read_costs(path)
        if progress is not None:
            progress(f"measuring this model's step cost for the draft budget once (forwards of {sizes[0]}-"
                     f"{sizes[-1]} tokens; kept in {path})")
        ms = backend.measure_costs(model, context, repeats, list(sizes))
        model_cost = CostModel(list(sizes), ms)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(model_cost.as_dict() | {"context": context, "key": path.stem,
                                                         "backend": backend.name}, indent=2))
        tmp.replace(path)
    return model_cost


def _read_costs(path: Path) -> CostModel:
    data = json.loads(path.read_text())
    return CostModel(data["sizes"], data["ms"])


__all__ = ["NAMES", "Backend", "StepResult", "backend_class", "calibrate", "cost_key", "describe", "is_llama", "make_backend"]
