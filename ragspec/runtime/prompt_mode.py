"""Which forwards read prompt positions, for a model that reads a prompt otherwise than a step: with other weights
(dtype gguf's int8 prompt copy, `runtime/gguf_linear.py`) or other attention arithmetic (dtype gguf's prompt rows
in `prompt_attention.cpp`, GEMM-shaped tiles, 2.7-3.5x the step kernel's speed on an AVX2 CPU).

Why by role and not by row count: a prompt read behind a reused prefix, or in chunks of another size, must give
each position the same bits as a whole read, and a draft tree can have as many rows as a prompt chunk. So the
backends mark the forwards that read the prompt's positions but its last, and the model's linears read the mark.
The last prompt token (the first step's root) is read as a step reads it, alone or at the root of the first
tree, and so are the answer's tokens: a cache holds copy-read positions only below the prompt's last token.
"""

from __future__ import annotations

import contextlib
import contextvars

from ragspec.runtime.model_runtime import runtime_of

_READING = contextvars.ContextVar("ragspec_reading_prompt", default=False)


def reading_prompt() -> bool:
    """True inside `prompt_forward()` on this thread."""
    return _READING.get()


@contextlib.contextmanager
def flagged(var: contextvars.ContextVar, value):
    """`var` set to `value` on this thread for the block's forwards, then back (the marks here and in
    `cache_only.py`)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def prompt_forward(on: bool = True):
    """Forwards run inside read prompt positions (all of their rows)."""
    return flagged(_READING, on)


def prompt_copy(model) -> str | None:
    """The weights `model` reads prompt positions with when not its step weights ("int8"), else None."""
    rt = runtime_of(model)
    return rt.prompt_copy if rt is not None else None


def reads_by_role(model) -> bool:
    """Whether `model` reads prompt positions otherwise than steps (a weight copy, or prompt attention of its own):
    then a prompt's last token is read alone, as a step, and a reused prefix keeps only the positions before it."""
    rt = runtime_of(model)
    return rt is not None and (rt.prompt_role or rt.prompt_copy is not None)
