"""ragspec: retrieval-augmented generation whose drafts are copied from the retrieved context."""

__version__ = "0.1.0"

import os as _os

from ragspec.cpu_flags import cpu_flags as _cpu_flags
from ragspec.errors import RagspecError

# oneDNN's AMX matmul kernels change a row's bits with the number of rows beside it (a bf16 linear on an Intel Xeon
# with AMX: 6 of 40 rows differed alone and batched), which would break greedy identity for `dtype: bfloat16`;
# its AVX-512 BF16 kernels do not. So unless the user chose, oneDNN stops short of AMX (read at its first use, so
# set before torch runs anything). ragspec's own GGUF kernel drives the AMX tiles itself, rows independent.
if "amx_bf16" in _cpu_flags():
    _os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

__all__ = ["Answer", "Pipeline", "RagspecError", "__version__"]


def __getattr__(name: str):
    """`ragspec.Pipeline` / `ragspec.Answer` without importing torch for every `import ragspec`."""
    if name in ("Pipeline", "Answer"):
        import ragspec.pipeline as p

        return getattr(p, name)
    raise AttributeError(f"module 'ragspec' has no attribute {name!r}")
