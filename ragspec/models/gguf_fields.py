"""transformers' GGUF config and tokenizer, from one fast pass over the metadata.

Why: transformers reads a GGUF's config and tokenizer through `gguf.GGUFReader`, which makes a numpy view of every
metadata value. For the Qwen models' 151,646 tokens and 151,387 merges that took 30 s for the tokenizer and 18 s
more for the config, on a new machine's first ask (`gguf_cache.ensure_meta`). `FieldsReader` gives transformers
the same `fields` and `tensors` from one pass in plain Python (about a second), and `fast_reader()` lends it to
transformers while the metadata folder is made. Values it does not read (an array of arrays) send the call back
to `gguf.GGUFReader`.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}


class NotRead(Exception):
    """A metadata value of a kind this reader leaves to `gguf.GGUFReader`."""


@dataclass
class Field:
    """One metadata key as `gguf.ReaderField` shows it to transformers: `parts[i]` for each `i` in `data` is one
    value (a 1-element sequence for a number, the bytes of a string); `types` is [type] or [9, element type]."""

    name: str
    types: list[int]
    parts: object
    data: list[int]


@dataclass(frozen=True)
class TensorName:
    name: str


class FieldsReader:
    """What transformers reads of a `gguf.GGUFReader(path)`: `fields` (key → Field) and `tensors` (their names)."""

    def __init__(self, path, mode: str = "r"):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            self.fields, self.tensors = read_fields(buf)


def read_fields(buf) -> tuple[dict[str, Field], list[TensorName]]:
    if bytes(buf[:4]) != b"GGUF":
        raise NotRead("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]), at + 8 + n

    fields = {"GGUF.version": Field("GGUF.version", [4], [(version,)], [0]),  # as GGUFReader lists them
              "GGUF.tensor_count": Field("GGUF.tensor_count", [10], [(n_tensors,)], [0]),
              "GGUF.kv_count": Field("GGUF.kv_count", [10], [(n_kv,)], [0])}
    for _ in range(n_kv):
        key, pos = string(pos)
        name = key.decode("utf-8")
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if kind in _SCALAR:
            fields[name] = Field(name, [kind], [struct.unpack_from(_SCALAR[kind], buf, pos)], [0])
            pos += struct.calcsize(_SCALAR[kind])
        elif kind == 8:
            value, pos = string(pos)
            fields[name] = Field(name, [8], [value], [0])
        elif kind == 9:
            elem, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if elem in _NUMPY:
                values = np.frombuffer(buf, dtype=_NUMPY[elem], count=count, offset=pos).copy()
                pos += values.nbytes
                parts = values.reshape(-1, 1)
            elif elem == 8:
                parts = []
                for _ in range(count):
                    value, pos = string(pos)
                    parts.append(value)
            else:
                raise NotRead(f"{name}: an array of type {elem}")
            fields[name] = Field(name, [9, elem], parts, list(range(count)))
        else:
            raise NotRead(f"{name}: a value of type {kind}")
    tensors = []
    for _ in range(n_tensors):
        tname, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * n_dims + 12
        tensors.append(TensorName(tname.decode("utf-8")))
    return fields, tensors


def _reader(path, mode: str = "r"):
    """`FieldsReader(path)`, or `gguf.GGUFReader` itself for a file with values it does not read."""
    try:
        return FieldsReader(path, mode)
    except NotRead:
        from gguf.gguf_reader import GGUFReader

        return GGUFReader(path, mode)


@contextlib.contextmanager
def fast_reader():
    """transformers' GGUF loading (config and tokenizer) reads the metadata with `FieldsReader` meanwhile (the
    name `gguf.GGUFReader` lent; `gguf.gguf_reader.GGUFReader` stays the class). The ragspec runtime reads GGUFs
    with its own code, never through that name."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    gguf.GGUFReader = _reader
    try:
        yield
    finally:
        gguf.GGUFReader = GGUFReader
