"""Read each source once: the KV of a source piece, computed once behind the prompt's fixed head and reused by
later asks wherever the piece lands in their prompt (position-independent caching: EPIC, CacheBlend,
Block-Attention; see docs/decoding.md "The source cache").

A prompt is cut into the head (system instruction and template up to the sources), the pieces (token ranges of
source text, as the source budget selected them) and the gaps between them (source headers, elision marks, the
question and template tail). At ask time the head's KV is exact (nothing precedes it), each piece's KV comes
from the store re-positioned to its place, the first `recompute` tokens of each piece and every gap are computed
in full over what is assembled before them (EPIC's attention-sink fix), and the tail last.

This module keeps the entries; the backend (backends/source_kv.py) computes, packs and assembles them. An entry
is keyed by the model's fingerprint, the backend, the head's token ids and the piece's token ids, so a changed
document, model, dtype or tokenizer never reuses one. Entries live in memory (LRU, bounded in bytes) and on
disk (bounded in bytes, least recently used evicted); a disk entry carries a checksum, and a damaged or
partial one is deleted and recomputed, never used.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"RSKV1\n"
_HEADER = struct.Struct("<Q32s")  # payload length, sha256 of the payload


def entry_key(model_key: str, head: list[int], piece: list[int]) -> str:
    """The store key of a piece computed behind `head` by the model `model_key` names."""
    h = hashlib.sha256(model_key.encode())
    h.update(b"|head|" + ",".join(map(str, head)).encode())
    h.update(b"|piece|" + ",".join(map(str, piece)).encode())
    return h.hexdigest()


@dataclass
class SourcePlan:
    """How one prompt is assembled: its head and the token ranges of its cached pieces, in order."""

    store: SourceKVStore
    head: int  # prompt tokens [0, head): the fixed head, cached whole
    pieces: list[tuple[int, int]]  # [start, end) of each piece of source text after the head
    recompute: int = 4  # first tokens of each piece computed in full over the assembled context
    blend: float = 0.0  # and this fraction of the other piece tokens, chosen by `select`:
    select: str = "deviation"  # whose layer-1 KV deviates most (CacheBlend), or "attention": the question's most read
    temperature: float = 1.0  # cached piece keys divided by this: what reads them sees logits sharpened (APE)
    # filled by the backend, prompt tokens by where their KV came from: an entry already in the store (reused),
    # an entry this ask computed into the store first (stored: a cold ask), computed in full in place (computed)
    reused: int = 0
    stored: int = 0
    computed: int = 0
    blended: int = 0  # piece tokens recomputed because their KV deviated most (counted in `computed`)
    hits: int = 0  # pieces (the head included) found in the store
    misses: int = 0  # pieces computed for the store by this ask
    fallback: str = ""  # why the prompt was prefilled in full instead (one line), "" when assembled
    note: str = ""  # what of the plan was not applied though it was assembled (one line)


@dataclass
class StoreStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    damaged: int = 0  # disk entries found damaged, deleted and recomputed
    evicted: int = 0


@dataclass
class _Entry:
    value: object
    nbytes: int


@dataclass
class SourceKVStore:
    """Entries in memory (LRU up to `memory_bytes`) and, with `directory`, on disk (up to `disk_bytes`).

    Thread-safe: the server shares one store across requests. Values are opaque here; `get` and `put` take the
    backend's `load(bytes) -> value` and `dump(value) -> bytes` for the disk."""

    memory_bytes: int = 512 << 20
    directory: str | Path | None = None
    disk_bytes: int = 2 << 30
    stats: StoreStats = field(default_factory=StoreStats)

    def __post_init__(self):
        self._memory: OrderedDict[str, _Entry] = OrderedDict()
        self._memory_used = 0
        self._lock = threading.Lock()
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        if self.directory is not None:
            self.directory = Path(self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            found = []
            for p in self.directory.glob("*.kv"):
                try:
                    st = p.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, p.stem, st.st_size))
            for _, key, size in sorted(found):
                self._disk[key] = size

    # -- reading -------------------------------------------------------------------------------------------
    def get(self, key: str, load: Callable[[bytes], object] | None = None):
        """The entry's value, or None: from memory, else from disk (checked, then kept in memory too)."""
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._memory.move_to_end(key)
                self.stats.memory_hits += 1
                return entry.value
        if self.directory is None or load is None or key not in self._disk:
            with self._lock:
                self.stats.misses += 1
            return None
        payload = self._read(key)
        value = None
        if payload is not None:
            try:
                value = load(payload)
            except Exception:  # noqa: BLE001 - a payload the backend cannot read is a damaged entry
                value = None
        if value is None:
            self._drop_file(key)
            with self._lock:
                self.stats.damaged += 1
                self.stats.misses += 1
            return None
        with self._lock:
            self.stats.disk_hits += 1
            if key in self._disk:
                self._disk.move_to_end(key)
        try:
            os.utime(self._path(key))
        except OSError:
            pass
        self._remember(key, value, len(payload))
        return value

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._memory or key in self._disk

    # -- writing -------------------------------------------------------------------------------------------
    def put(self, key: str, value, nbytes: int, dump: Callable[[object], bytes] | None = None) -> None:
        """Keep `value` (about `nbytes` in memory); with a directory and `dump`, write it to disk as well."""
        self._remember(key, value, nbytes)
        if self.directory is None or dump is None or self.disk_bytes <= 0:
            return
        self._write(key, dump(value))

    def _write(self, key: str, payload: bytes) -> None:
        size = len(MAGIC) + _HEADER.size + len(payload)
        if size > self.disk_bytes:
            return
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + _HEADER.pack(len(payload), hashlib.sha256(payload).digest()))
            f.write(payload)
        os.replace(tmp, path)  # a reader sees the old file, the new one or none: never half a file
        with self._lock:
            self._disk[key] = size
            self._disk.move_to_end(key)
            victims = []
            while sum(self._disk.values()) > self.disk_bytes and len(self._disk) > 1:
                victims.append(self._disk.popitem(last=False)[0])
                self.stats.evicted += 1
        for k in victims:
            self._unlink(k)

    def put_payload(self, key: str, payload: bytes) -> None:
        """Write an entry computed elsewhere (a Ray actor's `dump` output) to disk; memory takes it on first use."""
        if self.directory is None:
            raise ValueError("this store keeps no disk entries")
        self._write(key, payload)

    def keys(self) -> set[str]:
        """Every key held, in memory or on disk."""
        with self._lock:
            return set(self._memory) | set(self._disk)

    def clear(self) -> None:
        """Forget every entry, in memory and on disk."""
        with self._lock:
            self._memory.clear()
            self._memory_used = 0
            keys = list(self._disk)
            self._disk.clear()
        for k in keys:
            self._unlink(k)

    @property
    def memory_used(self) -> int:
        return self._memory_used

    @property
    def disk_used(self) -> int:
        with self._lock:
            return sum(self._disk.values())

    # -- internals -----------------------------------------------------------------------------------------
    def _remember(self, key: str, value, nbytes: int) -> None:
        if nbytes > self.memory_bytes:
            return
        with self._lock:
            old = self._memory.pop(key, None)
            if old is not None:
                self._memory_used -= old.nbytes
            self._memory[key] = _Entry(value, nbytes)
            self._memory_used += nbytes
            while self._memory_used > self.memory_bytes:
                _, gone = self._memory.popitem(last=False)
                self._memory_used -= gone.nbytes
                self.stats.evicted += 1

    def _path(self, key: str) -> Path:
        return Path(self.directory) / f"{key}.kv"

    def _read(self, key: str) -> bytes | None:
        """The payload of a disk entry whose magic, length and checksum hold; None otherwise."""
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(len(MAGIC) + _HEADER.size)
                if len(head) != len(MAGIC) + _HEADER.size or not head.startswith(MAGIC):
                    return None
                n, digest = _HEADER.unpack(head[len(MAGIC):])
                payload = f.read(n + 1)
        except OSError:
            return None
        if len(payload) != n or hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def _drop_file(self, key: str) -> None:
        with self._lock:
            self._disk.pop(key, None)
        self._unlink(key)

    def _unlink(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except OSError:
            pass
