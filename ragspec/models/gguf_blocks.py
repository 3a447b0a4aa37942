"""A GGUF's linears in the kernel's layout, packed once per machine and kept beside the converted model.

Why: `gguf.GGUFReader` parses every metadata field of a file (the 1.5B's vocabulary and merges: 8.5 s), and
decoding the blocks and re-laying them for the kernel takes as long again: loading dtype gguf spent 14 s (0.5B)
and 23 s (1.5B) of every process's start there, on 2 cores. The packed tensors are what the kernel reads, so they
are kept as one safetensors file under `$RAGSPEC_HOME/models/` and later loads read that. The file's name carries
a key: the GGUF's path, size and modification time, the packing code (this module's and `gguf_linear.py`'s
source) and the head counts Llama's q/k rows are un-permuted by; so a changed file or packing never reuses it. It
is written under a temporary name and renamed when complete (one writer at a time, by a lock), older packings of
the same GGUF are removed then, and a file that does not read back whole is deleted and packed again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ragspec.errors import RagspecError
from ragspec.paths import ragspec_home

log = logging.getLogger(__name__)
ARCHS = ("llama", "qwen2")
PARTS = ("w", "wh", "d", "mn")


@dataclass(frozen=True)
class Packed:
    """One linear's blocks as `GGUFLinear` holds them: kernel format, the GGUF's type, [rows, cols] of the weight."""

    gguf_type: str
    fmt: str
    rows: int
    cols: int
    w: torch.Tensor
    wh: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor


@functools.lru_cache(maxsize=1)
def packing_digest() -> str:
    here = Path(__file__)
    text = here.read_bytes() + here.with_name("gguf_linear.py").read_bytes()
    return hashlib.sha256(text).hexdigest()[:10]


def blocks_path(gguf_file, heads: int, kv_heads: int) -> Path:
    """Where `gguf_file`'s packing is kept (see the module for what its name's key holds)."""
    src = Path(gguf_file).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}|{packing_digest()}|{heads}|{kv_heads}".encode())
    return ragspec_home() / "models" / f"{src.stem}.blocks-{key.hexdigest()[:12]}.safetensors"


def packed_blocks(gguf_file, heads: int, kv_heads: int) -> tuple[str, dict[str, Packed]]:
    """(architecture, {HF module name: Packed}) for every linear of `gguf_file`, `lm_head` included (from
    `output.weight`, or the tied `token_embd.weight`): read from its packing, or packed here and kept."""
    path = blocks_path(gguf_file, heads, kv_heads)
    got = _read(path)
    if got is not None:
        return got
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process packing it: wait, then read what it wrote
        got = _read(path)
        if got is None:
            from ragspec.console import status

            with status(f"Packing {Path(gguf_file).name}'s blocks for the kernels once (15-25 s; kept in "
                        f"{path.parent})"):
                got = _pack(gguf_file, heads, kv_heads)
                _write(path, *got)
    return got


def _pack(gguf_file, heads: int, kv_heads: int) -> tuple[str, dict[str, Packed]]:
    from gguf import GGUFReader

    from ragspec.models.gguf_linear import _unpermute_rows, decode_blocks, hf_module_name, pack, scale_tensors

    reader = GGUFReader(str(gguf_file))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in ARCHS:
        raise RagspecError(f"generator dtype gguf knows Llama and Qwen2 GGUFs, not '{arch}'")
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied embedding: the head reads the same blocks
    out = {}
    for name, t in tensors.items():
        target = hf_module_name(name)
        if target is None:
            continue
        cols, rows = (int(n) for n in t.shape[:2])  # ggml lists the innermost dimension first
        fmt, q, d, m = decode_blocks(t.data, t.tensor_type.name, rows, cols)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            order = _unpermute_rows(rows, heads if kind == "attn_q" else kv_heads)
            q, d = q[order], d[order]
            m = None if m is None else m[order]
        w, wh = pack(fmt, q)
        sd, smn = scale_tensors(fmt, d, m)
        out[target] = Packed(t.tensor_type.name, fmt, rows, cols, w, wh, sd, smn)
    return arch, out


def _write(path: Path, arch: str, packed: dict[str, Packed]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{name}/{p}": getattr(b, p).contiguous() for name, b in packed.items() for p in PARTS}
    meta = {"arch": arch, "linears": json.dumps({n: [b.gguf_type, b.fmt, b.rows, b.cols] for n, b in packed.items()})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: this load goes on without a kept packing
        log.warning("could not keep the packed GGUF blocks in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return
    stem = path.name.split(".blocks-")[0]
    for old in path.parent.glob(f"{stem}.blocks-*"):  # older packings and their locks
        if not old.name.startswith(path.name):
            old.unlink(missing_ok=True)


def _read(path: Path) -> tuple[str, dict[str, Packed]] | None:
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            arch, linears = meta["arch"], json.loads(meta["linears"])
            out = {name: Packed(gt, fmt, rows, cols, *(f.get_tensor(f"{name}/{p}") for p in PARTS))
                   for name, (gt, fmt, rows, cols) in linears.items()}
        if arch not in ARCHS or not out:
            raise ValueError("no linears")
        return arch, out
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # cut short, damaged, another layout
        log.warning("the packed GGUF blocks in %s did not read back (%s); packing them again", path, exc)
        path.unlink(missing_ok=True)
        return None

