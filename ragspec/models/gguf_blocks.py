"""A GGUF's linears in the kernel's layout, packed once per machine and kept beside the converted model.

Why: decoding a GGUF's blocks and re-laying them for the kernel takes 1.8 s (0.5B) and 6.5 s (1.5B) on 2 cores
(with `gguf.GGUFReader`, which turns every metadata value into arrays first, it had taken 14 s and 23 s of every
process's start). The packed tensors are what the kernel reads, so they are kept as one safetensors file under
`$RAGSPEC_HOME/models/` and later loads read that (0.4 and 1.0 GB). The file's name carries
a key: the GGUF's path, size and modification time, the packing code (this module, `gguf_formats.py` and
`int8_linear.quantize_rows`, which makes the int8 copy's numbers) and the head counts Llama's q/k rows are un-permuted by; so a changed file or packing never reuses it. It
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
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ragspec.errors import RagspecError
from ragspec.paths import ragspec_home

log = logging.getLogger(__name__)
ARCHS = ("llama", "qwen2")
PARTS = ("w", "wh", "d", "mn")
COPY = ("q8", "q8s")


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
    q8: torch.Tensor | None = None  # the int8 prompt copy (int8 [rows, cols]) and its scale per row, when kept
    q8s: torch.Tensor | None = None


@functools.lru_cache(maxsize=1)
def packing_digest() -> str:
    """Names the code whose output is kept: the packing (this module), the formats, and the int8 copy's rule. Not
    the modules that run the kernels, so an edit there keeps every machine's packings."""
    import inspect

    from ragspec.models.int8_linear import QMAX, quantize_rows

    here = Path(__file__)
    text = here.read_bytes() + here.with_name("gguf_formats.py").read_bytes()
    text += f"{inspect.getsource(quantize_rows)}|{QMAX}".encode()
    return hashlib.sha256(text).hexdigest()[:10]


def blocks_path(gguf_file, heads: int, kv_heads: int, int8_copy: bool = False) -> Path:
    """Where `gguf_file`'s packing is kept (see the module for what its name's key holds); with the int8 prompt
    copy, a file of its own ("blocks8"), so processes with and without it never remove each other's."""
    src = Path(gguf_file).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}|{packing_digest()}|{heads}|{kv_heads}".encode())
    return ragspec_home() / "models" / f"{src.stem}.{_tag(int8_copy)}-{key.hexdigest()[:12]}.safetensors"


def _tag(int8_copy: bool) -> str:
    return "blocks8" if int8_copy else "blocks"


def packed_blocks(gguf_file, heads: int, kv_heads: int, int8_copy: bool = False) -> tuple[str, dict[str, Packed]]:
    """(architecture, {HF module name: Packed}) for every linear of `gguf_file`, `lm_head` included (from
    `output.weight`, or the tied `token_embd.weight`): read from its packing, or packed here and kept. With
    `int8_copy`, every linear but lm_head also holds its int8 prompt copy (`gguf_formats.int8_copy`): building it
    at load took the 1.5B 11.6 s of every process's start."""
    path = blocks_path(gguf_file, heads, kv_heads, int8_copy)
    got = _read(path)
    if got is not None:
        return got
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process packing it: wait, then read what it wrote
        got = _read(path)
        if got is None:
            from ragspec.console import status

            with status(f"Packing {Path(gguf_file).name}'s blocks for the kernels once (a few seconds; kept "
                        f"in {path.parent})"):
                got = _pack(gguf_file, heads, kv_heads, int8_copy)
                _write(path, *got)
    return got


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str  # ggml's, e.g. Q4_K
    shape: tuple[int, ...]  # ggml's order: the innermost dimension first
    data: np.ndarray  # the raw bytes, uint8 (a view of the mapped file)


def read_tensors(gguf_file) -> tuple[str, dict[str, Tensor]]:
    """(general.architecture, {name: Tensor}) of a GGUF (v2, v3), its metadata skipped but for the architecture
    and the alignment. `gguf.GGUFReader` (the tests' reference) turns every metadata value into arrays first:
    8.5 s for the 1.5B's vocabulary and merges, against well under a second here."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(gguf_file, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise RagspecError(f"{gguf_file} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise RagspecError(f"{gguf_file}: GGUF version {version} is not read here")
    pos = 24

    def string(at):
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind, at) -> int:  # the position past one value of this type
        if kind in _SCALAR:
            return at + _SCALAR[kind]
        if kind == 8:
            return string(at)[1]
        if kind != 9:
            raise RagspecError(f"{gguf_file}: metadata value of unknown type {kind}")
        elem, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if elem in _SCALAR:
            return at + count * _SCALAR[elem]
        for _ in range(count):
            at = skip(elem, at)
        return at

    meta = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and kind == 8:
            meta[key], pos = string(pos)
        elif key == "general.alignment" and kind == 4:
            (meta[key],) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            pos = skip(kind, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, kind, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * size
        tensors[name] = Tensor(name, qtype.name, tuple(int(d) for d in dims),
                               raw[start + offset : start + offset + nbytes])
    return meta.get("general.architecture", ""), tensors


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF metadata type -> bytes


def _pack(gguf_file, heads: int, kv_heads: int, int8_copy: bool = False) -> tuple[str, dict[str, Packed]]:
    from ragspec.models.gguf_formats import hf_module_name

    arch, tensors = read_tensors(gguf_file)
    if arch not in ARCHS:
        raise RagspecError(f"generator dtype gguf knows Llama and Qwen2 GGUFs, not '{arch}'")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied embedding: the head reads the same blocks
    todo = [(target, t) for name, t in tensors.items() if (target := hf_module_name(name)) is not None]
    # numpy lets go of the GIL in the byte shuffles, so the tensors pack side by side on every core
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # at most 8 tensors' copies at once
        packed = pool.map(lambda job: _pack_one(arch, *job, heads, kv_heads, int8_copy), todo)
        return arch, dict(zip((target for target, _ in todo), packed))


def _pack_one(arch: str, target: str, t: Tensor, heads: int, kv_heads: int, int8_copy: bool = False) -> Packed:
    from ragspec.models.gguf_formats import _unpermute_rows, decode_blocks, pack, scale_tensors
    from ragspec.models.gguf_formats import int8_copy as make_copy

    cols, rows = t.shape[:2]  # ggml lists the innermost dimension first
    fmt, q, d, m = decode_blocks(t.data, t.type_name, rows, cols)
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        order = _unpermute_rows(rows, heads if kind == "attn_q" else kv_heads)
        q, d = q[order], d[order]
        m = None if m is None else m[order]
    w, wh = pack(fmt, q)
    sd, smn = scale_tensors(fmt, d, m)
    copy = make_copy(fmt, w, wh, sd, smn, rows, cols) if int8_copy and target != "lm_head" else (None, None)
    return Packed(t.type_name, fmt, rows, cols, w, wh, sd, smn, *copy)


def _write(path: Path, arch: str, packed: dict[str, Packed]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{name}/{p}": getattr(b, p).contiguous() for name, b in packed.items() for p in PARTS + COPY
               if getattr(b, p) is not None}
    meta = {"arch": arch, "linears": json.dumps({n: [b.gguf_type, b.fmt, b.rows, b.cols] for n, b in packed.items()})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: this load goes on without a kept packing
        log.warning("could not keep the packed GGUF blocks in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return
    tag = path.name.split(".")[-2].split("-")[0]  # blocks or blocks8
    stem = path.name.split(f".{tag}-")[0]
    for old in path.parent.glob(f"{stem}.{tag}-*"):  # older packings of this kind and their locks
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
            keys = set(f.keys())
            out = {name: Packed(gt, fmt, rows, cols, *(f.get_tensor(f"{name}/{p}") if f"{name}/{p}" in keys else None
                                                       for p in PARTS + COPY))
                   for name, (gt, fmt, rows, cols) in linears.items()}
        if arch not in ARCHS or not out:
            raise ValueError("no linears")
        return arch, out
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # cut short, damaged, another layout
        log.warning("the packed GGUF blocks in %s did not read back (%s); packing them again", path, exc)
        path.unlink(missing_ok=True)
        return None

