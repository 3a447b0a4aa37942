"""A GGUF's linears in the kernel's layout, packed once per machine and kept beside the converted model.

Why: decoding a GGUF's blocks and re-laying them for the kernel takes 1.8 s (0.5B) and 6.5 s (1.5B) on 2 cores
(with `gguf.GGUFReader`, which turns every metadata value into arrays first, it had taken 14 s and 23 s of every
process's start). The packed tensors are what the kernel reads, so they are kept as one safetensors file under
`$RAGSPEC_HOME/models/` and later loads read that (0.4 and 1.0 GB). The file's name carries
a key: the GGUF's path, size and modification time, the packing code (this module, `gguf_formats.py` and
the head counts Llama's q/k rows are un-permuted by; so a changed file or packing never reuses it. It
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ragspec.errors import RagspecError
from ragspec.paths import ragspec_home
from ragspec.runtime.gguf_file import ARCHS, parse_header

log = logging.getLogger(__name__)
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
    """Names the code whose output is kept: the packing (this module) and the formats. Not the modules that run
    the kernels, so an edit there keeps every machine's packings."""
    here = Path(__file__)
    text = here.read_bytes() + here.with_name("gguf_formats.py").read_bytes()
    return hashlib.sha256(text).hexdigest()[:10]


def _source(gguf):
    from ragspec.runtime.gguf_file import GGUFSource, file_source

    return gguf if isinstance(gguf, GGUFSource) else file_source(gguf)


def blocks_path(gguf, heads: int, kv_heads: int) -> Path:
    """Where the packing of `gguf` (a path or a `GGUFSource`) is kept (see the module for what its name's key
    holds)."""
    src = _source(gguf)
    key = hashlib.sha256(f"{src.key}|{packing_digest()}|{heads}|{kv_heads}".encode())
    return ragspec_home() / "models" / f"{src.name}.blocks-{key.hexdigest()[:12]}.safetensors"


def packed_blocks(gguf, heads: int, kv_heads: int) -> tuple[str, dict[str, Packed]]:
    """(architecture, {HF module name: Packed}) for every linear of `gguf` (a path or a `GGUFSource`), `lm_head`
    included (from `output.weight`, or the tied `token_embd.weight`): read from its packing, or packed here and
    kept (an embedded model's parts checked against their sha256 first). The int8 prompt copy is not kept: it
    is made from these when first needed (`int8_copy.cpp`, 1 byte a weight that disk need not hold twice)."""
    src = _source(gguf)
    path = blocks_path(src, heads, kv_heads)
    got = _read(path)
    if got is not None:
        return got
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process packing it: wait, then read what it wrote
        got = _read(path)
        if got is None:
            from ragspec.console import status

            with status(f"Packing {src.label}'s blocks for the kernels once (a few seconds; kept in "
                        f"{path.parent})"):
                src.verify()
                if _write(path, *_pack(src, heads, kv_heads, lazy=True)):
                    got = _read(path)  # each linear was written as packed: the whole packing held once, here
                if got is None:  # not kept (a full or read-only disk): packed again, held in memory
                    got = _pack(src, heads, kv_heads)
        from ragspec.memory import release_freed

        release_freed()  # the packing's buffers
    return got


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str  # ggml's, e.g. Q4_K
    shape: tuple[int, ...]  # ggml's order: the innermost dimension first
    span: Callable[[int, int], np.ndarray]  # bytes [lo, hi) of the tensor: a view of the mapped part where it can
    nbytes: int

    @property
    def data(self) -> np.ndarray:
        """The raw bytes, uint8: a view of the mapped file (a copy where the tensor straddles two parts)."""
        return self.span(0, self.nbytes)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The bytes of rows `ids` of a 2-D tensor, [len(ids), bytes a row], read without the rest of the table."""
        width = self.nbytes // self.shape[1]
        return np.stack([self.span(int(i) * width, (int(i) + 1) * width) for i in ids]) if len(ids) else \
            np.empty((0, width), np.uint8)


def read_tensors(gguf) -> tuple[str, dict[str, Tensor]]:
    """(general.architecture, {name: Tensor}) of a GGUF (v2, v3; a path or a `GGUFSource` in parts), its metadata
    skipped but for the architecture and the alignment. Each tensor's bytes are a view of its mapped part (copied
    only where one straddles two parts). `gguf.GGUFReader` (the tests' reference) turns every metadata value into
    arrays first: 8.5 s for the 1.5B's vocabulary and merges, against well under a second here."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ragspec.runtime.gguf_file import GGUFSource, file_source

    source = gguf if isinstance(gguf, GGUFSource) else file_source(gguf) if Path(gguf).suffix == ".gguf" else None
    parts = source.parts if source is not None else (Path(gguf),)
    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in parts]
    label = source.label if source is not None else str(gguf)
    try:
        meta, infos, start = source.parsed() if source is not None else parse_header(memoryview(maps[0]))
    except RagspecError as exc:
        raise RagspecError(exc.args[0] if source is not None else f"{label}: {exc}") from None
    except struct.error:
        raise RagspecError(f"{label}: the GGUF header is cut short") from None
    ends = np.cumsum([len(m) for m in maps])

    def span(lo: int, hi: int) -> np.ndarray:
        pieces = []
        while True:  # a loop, not a recursion: a function that refers to itself is a cycle, and the cycle kept
            i = int(np.searchsorted(ends, lo, side="right"))  # every page the packing read mapped until a gc
            base = ends[i] - len(maps[i])
            if hi <= ends[i]:
                pieces.append(maps[i][lo - base : hi - base])
                return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)  # straddles a part boundary
            pieces.append(maps[i][lo - base :])
            lo = int(ends[i])

    tensors = {}
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * size
        at = start + offset
        if at + nbytes > ends[-1]:
            raise RagspecError(f"{label}: tensor {name} runs past the end of the file")
        tensors[name] = Tensor(name, qtype.name, tuple(int(d) for d in dims),
                               functools.partial(lambda lo, hi, at: span(at + lo, at + hi), at=at), nbytes)
    return meta.get("general.architecture", ""), tensors




def _pack(gguf, heads: int, kv_heads: int, lazy: bool = False):
    """(architecture, {HF module name: Packed}); with `lazy`, the linears as an iterator of (name, Packed) pairs,
    packed as they are taken (so a writer holds a few at a time, not the model's worth)."""
    from ragspec.runtime.gguf_formats import hf_module_name

    arch, tensors = read_tensors(gguf)
    if arch not in ARCHS:
        raise RagspecError(f"generator dtype gguf knows Llama and Qwen2 GGUFs, not '{arch}'")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]  # tied embedding: the head reads the same blocks
    todo = [(target, t) for name, t in tensors.items() if (target := hf_module_name(name)) is not None]
    # numpy lets go of the GIL in the byte shuffles, so the tensors pack side by side on every core
    def packed():
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # ≤ 8 tensors' copies at once
            yield from zip((target for target, _ in todo),
                           pool.map(lambda job: _pack_one(arch, *job, heads, kv_heads), todo))

    return (arch, packed()) if lazy else (arch, dict(packed()))


def _pack_one(arch: str, target: str, t: Tensor, heads: int, kv_heads: int) -> Packed:
    from ragspec.runtime.gguf_formats import _unpermute_rows, decode_blocks, pack, scale_tensors

    cols, rows = t.shape[:2]  # ggml lists the innermost dimension first
    fmt, q, d, m = decode_blocks(t.data, t.type_name, rows, cols)
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        order = _unpermute_rows(rows, heads if kind == "attn_q" else kv_heads)
        q, d = q[order], d[order]
        m = None if m is None else m[order]
    w, wh = pack(fmt, q)
    sd, smn = scale_tensors(fmt, d, m)
    return Packed(t.type_name, fmt, rows, cols, w, wh, sd, smn)


_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float32: "F32", torch.float16: "F16", torch.int16: "I16",
           torch.int32: "I32", torch.bfloat16: "BF16"}


def _write(path: Path, arch: str, packed) -> bool:
    """The (name, Packed) pairs as one safetensors file, each tensor written as it comes (the header, padded with
    spaces as the format allows, goes in front at the end): a packing is never held whole to be written.
    Older packings of the same GGUF are removed then. False where it could not be kept."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    entries, linears, offset = {}, {}, 0
    try:
        with open(tmp, "wb") as f:
            f.seek(8 + _HEADER_ROOM)
            for name, b in packed:
                linears[name] = [b.gguf_type, b.fmt, b.rows, b.cols]
                if len(linears) * _HEADER_PER_LINEAR > _HEADER_ROOM:
                    raise OSError("more linears than the header has room for")
                for part in PARTS:
                    t = getattr(b, part)
                    if t is None:
                        continue
                    data = t.contiguous().view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
                    f.write(memoryview(data))
                    entries[f"{name}/{part}"] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                                                 "data_offsets": [offset, offset + data.nbytes]}
                    offset += data.nbytes
            head = json.dumps({"__metadata__": {"arch": arch, "linears": json.dumps(linears)}, **entries},
                              separators=(",", ":")).encode()
            if len(head) > _HEADER_ROOM:
                raise OSError("the header outgrew its room")
            f.seek(0)
            f.write(struct.pack("<Q", _HEADER_ROOM) + head + b" " * (_HEADER_ROOM - len(head)))
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: this load goes on without a kept packing
        log.warning("could not keep the packed GGUF blocks in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return False
    stem = path.name.split(".blocks-")[0]
    for old in [*path.parent.glob(f"{stem}.blocks-*"), *path.parent.glob(f"{stem}.blocks8-*")]:
        if not old.name.startswith(path.name):  # older packings and their locks (blocks8: with the int8 copy kept)
            old.unlink(missing_ok=True)
    return True


_HEADER_PER_LINEAR = 1024  # bytes of safetensors header a linear may take (its 4-6 entries: ~600)
_HEADER_ROOM = 2048 * _HEADER_PER_LINEAR  # 2 MB of room in front: models of up to 2,048 linears


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
                                                       for p in PARTS))
                   for name, (gt, fmt, rows, cols) in linears.items()}
        if arch not in ARCHS or not out:
            raise ValueError("no linears")
        return arch, out
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # cut short, damaged, another layout
        log.warning("the packed GGUF blocks in %s did not read back (%s); packing them again", path, exc)
        path.unlink(missing_ok=True)
        return None

