"""Which low-precision instructions this CPU has: they decide whether bf16 and int8 run natively or emulated."""

from __future__ import annotations

import functools
import hashlib


@functools.lru_cache(maxsize=1)
def read_cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(model name, every flag) of the first CPU in /proc/cpuinfo; ("", ()) where there is none (not Linux)."""
    model, flags = "", ()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo (empty where there is none)."""
    return frozenset(read_cpuinfo()[1])


def flags_hash() -> str:
    """A short key of every flag: a native build or a measurement holds for this set only."""
    return hashlib.md5(" ".join(read_cpuinfo()[1]).encode()).hexdigest()[:8]


def native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512_BF16 or AMX-BF16); elsewhere bf16 is converted and runs slower
    than float32."""
    import torch

    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return True
    cpu = torch.cpu  # no /proc/cpuinfo: ask PyTorch's cpuinfo
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def native_int8() -> bool:
    """int8 dot products with int32 accumulation in hardware (AVX512-VNNI, AVX-VNNI or AMX-INT8): what
    makes `torch._int_mm` fast; without them it is PyTorch's reference loop."""
    import torch

    if cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return True
    return bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())
