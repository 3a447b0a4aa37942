"""Run ragspec as an AVX2-only CPU would, on a CPU with AVX-512: for measuring the AVX2 kernels where no such
machine is at hand. Python imports this file at start-up when its folder is on PYTHONPATH (child processes too):

    PYTHONPATH=examples/avx2_emulation .venv/bin/python examples/source_stats.py indexes/pydoc-topics --ttft

- ragspec sees the CPU's flags without AVX-512, VNNI, AMX or the newer vector extensions (a Zen 3's set), so it
  picks what an AVX2-only CPU gets (no int8 prompt copy, the `vpmaddubsw` integer dot), and its kernels are
  compiled with `-march=znver3`;
- ATen and oneDNN are held to AVX2 by their own variables (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`);
- RAGSPEC_HOME defaults to ~/.cache/ragspec-avx2, so the emulated kernels and measurements stay apart.

What it does not change: llama.cpp (llama-cpp-python is built for the real CPU), PyTorch's own probe of the CPU
(it still sees the host's VNNI, so `torch._int_mm` calls oneDNN, held to AVX2, whose int8 pair sums saturate; a
real AVX2-only CPU gets PyTorch's exact loop, and ragspec calls `_int_mm` only with int8 units), and the core itself. A wider
core runs the same AVX2 code faster than a Zen 3: on a Zen 5 the 1.5B's 1,024-token prefill took 0.41x a real
Zen 3's time (benchmarks.md, *AVX2 on an AVX-512 machine*), so read its times as a lower bound, or scale them by
that ratio. The flags line every benchmark prints says "[AVX2 emulation]".
"""

import os
from pathlib import Path

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
os.environ.setdefault("RAGSPEC_HOME", str(Path.home() / ".cache" / "ragspec-avx2"))

DROPPED = ("avx512", "avx_vnni", "amx", "vaes", "vpclmulqdq", "gfni", "avx_ifma", "avx_vnni_int8")


def _emulate() -> None:
    try:
        import ragspec.cpu_flags as cpu
        import ragspec.runtime.gguf_kernel as kernel
    except ImportError:  # not this project's interpreter: nothing to emulate
        return
    model, flags = cpu.read_cpuinfo()
    kept = tuple(f for f in flags if not f.startswith(DROPPED))
    cpu.read_cpuinfo = lambda: (f"{model} [AVX2 emulation]", kept)
    cpu.native_int8 = lambda: False  # PyTorch's own probe would still find the host's VNNI
    cpu.native_bf16 = lambda: False
    kernel.FLAGS = ["-march=znver3" if f == "-march=native" else f for f in kernel.FLAGS] + ["-mtune=native"]


_emulate()
