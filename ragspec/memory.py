"""Give freed heap back to the system after a load.

Why: loading a model, a tokenizer or an embedder frees many small buffers (parsed JSON, metadata, float copies
on the way to bfloat16). glibc keeps such memory in its arenas, so the process's resident size stays at the load's
peak, and later allocations (the prompt's activations, the KV cache) add to it. `malloc_trim` returns what is
free; on the 0.5B's first ask it is about 0.1 GB. A no-op where the C library has no `malloc_trim` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim(0)`, over all arenas)."""
    trim = _trim()
    if trim is not None:
        trim(0)
