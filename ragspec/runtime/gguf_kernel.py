"""Build (once per CPU) and load ragspec's C++ CPU kernels: `torch.ops.ragspec_gguf.*` (the GGUF-block linears of
`gguf_kernel.cpp`, the exact attention of `attention_kernel.cpp`, the prompt rows' attention of
`prompt_attention.cpp`, the int8 prompt copy's one-pass steps of `int8_rows.cpp`, and the making of that copy
from the packed blocks at load in `int8_copy.cpp`).

The kernels are compiled with `-march=native` for the CPU they run on: `gguf_kernel.cpp` holds what every CPU runs
and includes one file per instruction set from `cpu/` (AVX2 with VNNI where it has it, AVX-512, AMX, plain C
elsewhere), so the build is keyed by the CPU's flags and the source's hash, kept
under `$RAGSPEC_HOME/kernels/`, and rebuilt only when either changes (about 20 s on 2 cores, shown as it runs:
each source includes only the ATen headers it uses, not `ATen/ATen.h`, which took a Zen 3's build from 34 to 24 s).
`-ffp-contract=off` keeps the float sums exactly as written: the batch invariance depends on it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.paths import ragspec_home
from ragspec.runtime.options import current_options

STEP_SOURCES = [Path(__file__).with_name(name)  # what a forward runs: their digest names its measurements
                for name in ("gguf_kernel.cpp", "attention_kernel.cpp", "prompt_attention.cpp", "int8_rows.cpp")]
SOURCES = STEP_SOURCES + [Path(__file__).with_name("int8_copy.cpp")]  # and what a load runs: all are built
HEADERS = [Path(__file__).with_name("kernel_math.h"),  # included by the sources: in the digest, not compiled alone
           *(Path(__file__).with_name("cpu") / f"{isa}.h" for isa in ("avx2", "avx512", "amx", "plain"))]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """Names the step kernels' sources and flags: measurements of an older build (t(n), the machine table) no
    longer hold once it changes."""
    return _digest(STEP_SOURCES + HEADERS)


def _digest(files: list[Path]) -> str:
    text = b"".join(s.read_bytes() for s in files)
    return hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:10]


def build_key() -> str:
    """Names a build: the CPU's flags and every source (the load-time ones too)."""
    from ragspec.cpu_flags import flags_hash

    return f"gguf-{flags_hash()}-{_digest(SOURCES + HEADERS)}"


def amx_expected() -> bool:
    """Whether the kernels will drive AMX tiles here: the CPU has AMX-INT8 (so `-march=native` builds the tile
    pass) and RAGSPEC_GGUF_AMX is not 0. Read from the flags, without loading the kernels, so a cache key can
    name it."""
    from ragspec.cpu_flags import cpu_flags

    return {"amx_tile", "amx_int8"} <= cpu_flags() and current_options().amx


@functools.lru_cache(maxsize=1)
def load_kernels():
    """`torch.ops.ragspec_gguf`, built here first if this CPU has no build of this source yet."""
    import torch

    if hasattr(torch.ops, "ragspec_gguf") and hasattr(torch.ops.ragspec_gguf, "int8_copy"):
        return torch.ops.ragspec_gguf
    key = build_key()
    folder = ragspec_home() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / "ragspec_gguf.so"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine at a time; the others wait and load it
        if not lib.is_file():
            _build(folder, lib)
    torch.ops.load_library(str(lib))
    return torch.ops.ragspec_gguf


def _build(folder: Path, lib: Path) -> None:
    import os

    from torch.utils import cpp_extension

    from ragspec.console import status

    os.environ.setdefault("MAX_JOBS", "2")
    try:
        with status(f"Compiling ragspec's GGUF kernels for this CPU once (about 20 s; kept in {folder})"):
            cpp_extension.load(name="ragspec_gguf", sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
                               build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja: one clear line
        raise RagspecError(f"generator dtype gguf: its kernels did not build here ({exc.__class__.__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); use dtype float32 or the llama.cpp "
                           "backend") from exc
    built = folder / "ragspec_gguf.so"
    if not built.is_file():
        raise RagspecError(f"generator dtype gguf: the kernel build left no library in {folder}")
    if built != lib:
        built.replace(lib)
