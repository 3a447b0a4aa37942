"""Which low-precision instructions this CPU has: they decide whether bf16 and int8 run natively or emulated."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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
