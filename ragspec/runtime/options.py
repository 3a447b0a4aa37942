"""The runtime's switches, read from the environment in this one place.

Why one place: each switch changes which kernels a forward runs (and some the bits it computes), so the machine
table's key must name every one of them, and a reader must find them all. They are overrides for comparisons and
for machines that need one (docs/decoding.md says what each does); unset, each takes the measured default.

| variable | field | default |
|---|---|---|
| RAGSPEC_GGUF_PROMPT | prompt_copy | unset: the model's measured copy (registry `prompt_copy`) |
| RAGSPEC_GGUF_Q8K | q8k | unset: where AMX runs |
| RAGSPEC_GGUF_AMX | amx | on |
| RAGSPEC_INT8_KERNEL | int8_kernel | unset: `int_mm` where int8 units run it |
| RAGSPEC_STEP_FORWARD | step_forward | on |
| RAGSPEC_PACKED_LINEAR | packed_linear | on |
| RAGSPEC_EXACT_ATTENTION | exact_attention | on |
| RAGSPEC_STATIC_VERIFIER | static_verifier | auto |
| RAGSPEC_CUDA_GRAPHS | cuda_graphs | on |
"""

from __future__ import annotations

import os
from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class RuntimeOptions:
    prompt_copy: str | None  # as set (lower-cased), None when unset
    q8k: bool | None  # None: where AMX runs
    amx: bool
    int8_kernel: str | None  # None: chosen by the CPU
    step_forward: bool
    packed_linear: bool
    exact_attention: bool
    static_verifier: str  # auto, or on / off as set
    cuda_graphs: bool

    def key(self) -> str:
        """Names the options for a measurement's key."""
        return "|".join("-" if v is None else str(v) for v in astuple(self))


def _off(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return os.environ.get(name, "1").strip() == "0"


def runtime_options() -> RuntimeOptions:
    """The options as the environment sets them now (read at each call: a test or a bench may set one)."""
    copy = os.environ.get("RAGSPEC_GGUF_PROMPT")
    q8k = os.environ.get("RAGSPEC_GGUF_Q8K", "").strip()
    return RuntimeOptions(
        prompt_copy=copy.strip().lower() if copy is not None else None,
        q8k=q8k == "1" if q8k in ("0", "1") else None,
        amx=not _off("RAGSPEC_GGUF_AMX"),
        int8_kernel=os.environ.get("RAGSPEC_INT8_KERNEL") or None,
        step_forward=not _off("RAGSPEC_STEP_FORWARD"),
        packed_linear=not _off("RAGSPEC_PACKED_LINEAR"),
        exact_attention=not _off("RAGSPEC_EXACT_ATTENTION"),
        static_verifier=os.environ.get("RAGSPEC_STATIC_VERIFIER", "auto").strip().lower() or "auto",
        cuda_graphs=not _off("RAGSPEC_CUDA_GRAPHS"),
    )
