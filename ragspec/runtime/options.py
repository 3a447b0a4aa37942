"""The runtime's options: set in the spec (`generator.runtime`), overridden by the environment, read here alone.

Why one place: each option changes which kernels a forward runs (and some the bits it computes), so the machine
table's and t(n)'s keys must name every one of them, and a reader must find them all. A pipeline builds its
`RuntimeOptions` once (`runtime_options(spec values)`); loading a model runs under them (`options_in_effect`), and
the model keeps them (`ModelRuntime.options`). An environment variable, where set, wins over the spec (for
comparisons and for machines that need one; docs/decoding.md says what each does):

| spec `generator.runtime` | variable | default |
|---|---|---|
| prompt_copy: auto, int8, int8-mlp, bf16, off | RAGSPEC_GGUF_PROMPT (int8, int8-mlp, bf16 or 1, 0) | auto: the model's measured copy (registry `prompt_copy`) |
| q8k: auto, on, off | RAGSPEC_GGUF_Q8K (1, 0) | auto: where AMX runs |
| amx: true, false | RAGSPEC_GGUF_AMX (0: off) | true (the kernels' switch is one per process) |
| int8_kernel: auto, int_mm, fp32 | RAGSPEC_INT8_KERNEL | auto: `int_mm` where int8 units run it |
| step_forward: true, false | RAGSPEC_STEP_FORWARD (0: off) | true |
| packed_linear: true, false | RAGSPEC_PACKED_LINEAR (0: off) | true |
| exact_attention: true, false | RAGSPEC_EXACT_ATTENTION (0: off) | true |
| static_verifier: auto, on, off | RAGSPEC_STATIC_VERIFIER | auto: on CUDA |
| cuda_graphs: true, false | RAGSPEC_CUDA_GRAPHS (0: off) | true |
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields, replace


@dataclass(frozen=True)
class RuntimeOptions:
    prompt_copy: str | None = None  # "int8", "int8-mlp", "bf16"/"1", "0" (none) as set, lower-cased; None: the model's own
    q8k: bool | None = None  # None: where AMX runs
    amx: bool = True
    int8_kernel: str | None = None  # None: chosen by the CPU
    step_forward: bool = True
    packed_linear: bool = True
    exact_attention: bool = True
    static_verifier: str = "auto"  # auto, or on / off as set
    cuda_graphs: bool = True

    def key(self) -> str:
        """Names the options for a measurement's key."""
        return "|".join("-" if v is None else str(v) for v in astuple(self))


_SWITCHES = ("amx", "step_forward", "packed_linear", "exact_attention", "cuda_graphs")  # on unless set to 0
_ENV = {"prompt_copy": "RAGSPEC_GGUF_PROMPT", "q8k": "RAGSPEC_GGUF_Q8K", "amx": "RAGSPEC_GGUF_AMX",
        "int8_kernel": "RAGSPEC_INT8_KERNEL", "step_forward": "RAGSPEC_STEP_FORWARD",
        "packed_linear": "RAGSPEC_PACKED_LINEAR", "exact_attention": "RAGSPEC_EXACT_ATTENTION",
        "static_verifier": "RAGSPEC_STATIC_VERIFIER", "cuda_graphs": "RAGSPEC_CUDA_GRAPHS"}


def _from_spec(name: str, value):
    """A spec value (validated by `settings.RuntimeSettings`) as the option holds it."""
    if name == "prompt_copy":
        return {"auto": None, "off": "0"}.get(value, value)
    if name == "q8k":
        return {"auto": None, "on": True, "off": False}[value]
    if name == "int8_kernel":
        return None if value == "auto" else value
    return value


def _from_env(name: str, raw: str):
    """An environment variable's text as the option holds it (None: the variable does not decide)."""
    raw = raw.strip()
    if name in _SWITCHES:
        return raw != "0"
    if name == "prompt_copy":
        return raw.lower()
    if name == "q8k":
        return raw == "1" if raw in ("0", "1") else None
    if name == "int8_kernel":
        return raw or None
    return raw.lower() or "auto"  # static_verifier


def runtime_options(spec: Mapping | None = None) -> RuntimeOptions:
    """The options of a spec's `generator.runtime` values (`spec`; None: every default), each overridden by its
    environment variable where set. The environment is read here, and nowhere else in the runtime."""
    values = {f.name: _from_spec(f.name, spec[f.name]) for f in fields(RuntimeOptions) if spec and f.name in spec}
    return overridden(RuntimeOptions(**values))


def overridden(options: RuntimeOptions) -> RuntimeOptions:
    """`options` with each option whose environment variable is set now taken from it. What a generation chooses
    as it starts (the static verifier, CUDA graphs) reads its model's options so, a variable set since the load
    included."""
    values = {}
    for name, var in _ENV.items():
        raw = os.environ.get(var)
        if raw is not None:
            got = _from_env(name, raw)
            if got is not None:
                values[name] = got
    return replace(options, **values) if values else options


_CURRENT: contextvars.ContextVar[RuntimeOptions | None] = contextvars.ContextVar("ragspec_runtime_options",
                                                                                default=None)


@contextlib.contextmanager
def options_in_effect(options: RuntimeOptions):
    """Loading and preparing a model runs under these options (the code that builds its parts reads them)."""
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)


def current_options() -> RuntimeOptions:
    """The options in effect: a load's (`options_in_effect`), else the defaults with the environment's overrides
    (read at each call: a test or a bench may set a variable)."""
    return _CURRENT.get() or runtime_options()
