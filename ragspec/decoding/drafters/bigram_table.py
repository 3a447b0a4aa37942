"""The model-derived bigram of n-grammys (§4.1): token → k rows of w next tokens, computed by the model on
demand (a callable from the backend; this module stays torch-free), kept in memory and in a per-model SQLite
file, so every token is computed once per model and (k, w), not once per generation.

The file is only a cache: one that SQLite cannot read (half-written, truncated, not a database) is dropped
and rebuilt, and a row whose length or checksum is wrong is recomputed, never trusted.
"""

from __future__ import annotations

import sqlite3
import struct
import zlib
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

RowsFn = Callable[[list[int], int, int], "dict[int, list[list[int]]]"]


class BigramTable:
    def __init__(self, compute: RowsFn | None, k: int, w: int, path: Path | None = None):
        if k < 1 or w < 1:
            raise ValueError(f"need k ≥ 1 and w ≥ 1, got k={k}, w={w}")
        self.compute, self.k, self.w = compute, k, w
        self.path = Path(path) if path is not None else None
        self.rows: dict[int, list[list[int]]] = {}
        self.computed = 0  # tokens the model was run for (not found in memory or on disk)
        self.loaded = 0  # tokens read back from the file
        self.compute_s = 0.0

    def get(self, token: int) -> list[list[int]] | None:
        return self.rows.get(int(token))

    def ensure(self, tokens) -> None:
        """Rows for every token in `tokens`: from memory, else the file, else one batched model call."""
        missing = sorted({int(t) for t in tokens} - self.rows.keys())
        if not missing or self.compute is None:
            return
        if self.path is not None:
            found = self._load(missing)
            self.rows.update(found)
            self.loaded += len(found)
            missing = [t for t in missing if t not in found]
        if not missing:
            return
        import time

        t0 = time.perf_counter()
        new = self.compute(missing, self.k, self.w)
        self.compute_s += time.perf_counter() - t0
        new = {int(t): [[int(x) for x in r[: self.w]] for r in rows[: self.k]] for t, rows in new.items()}
        self.rows.update(new)
        self.computed += len(new)
        if self.path is not None:
            self._store(new)

    # -- the file ------------------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS rows (token INTEGER PRIMARY KEY, data BLOB NOT NULL, crc INTEGER NOT NULL)")
        return db

    def _drop(self) -> None:
        """An unreadable file is not trusted: removed (with its journal), rebuilt on the next store."""
        for p in (self.path, self.path.with_name(self.path.name + "-journal")):
            try:
                p.unlink()
            except OSError:
                pass

    def _pack(self, token: int, rows: list[list[int]]) -> tuple[bytes, int]:
        flat = [x for r in rows for x in r]
        data = struct.pack(f"<{len(flat)}i", *flat)
        return data, zlib.crc32(struct.pack("<i", token) + data)

    def _load(self, tokens: list[int]) -> dict[int, list[list[int]]]:
        if not self.path.exists():
            return {}
        out = {}
        size = 4 * self.k * self.w
        try:
            with closing(self._connect()) as db:
                for a in range(0, len(tokens), 500):
                    part = tokens[a : a + 500]
                    q = f"SELECT token, data, crc FROM rows WHERE token IN ({','.join('?' * len(part))})"
                    for token, data, crc in db.execute(q, part):
                        if not isinstance(data, bytes) or len(data) != size or zlib.crc32(struct.pack("<i", token) + data) != crc:
                            continue  # a bad row is recomputed (and overwritten)
                        flat = struct.unpack(f"<{self.k * self.w}i", data)
                        if min(flat) < 0:
                            continue
                        out[int(token)] = [list(flat[i : i + self.w]) for i in range(0, len(flat), self.w)]
        except sqlite3.OperationalError:  # locked, unreadable: a miss this time
            return out
        except sqlite3.DatabaseError:  # not a database / malformed: dropped, not trusted
            self._drop()
            return {}
        return out

    def _store(self, rows: dict[int, list[list[int]]]) -> None:
        items = [(t, *self._pack(t, r)) for t, r in rows.items()
                 if len(r) == self.k and all(len(x) == self.w for x in r)]
        if not items:
            return
        for _attempt in range(2):
            try:
                with closing(self._connect()) as db:
                    with db:  # one transaction: all rows or none
                        db.executemany("INSERT OR REPLACE INTO rows (token, data, crc) VALUES (?, ?, ?)", items)
                return
            except sqlite3.OperationalError:
                return  # locked or read-only: a cache that cannot be written only costs recomputation
            except sqlite3.DatabaseError:
                self._drop()  # corrupt: start a fresh file once
            except OSError:
                return  # a cache that cannot be written only costs recomputation
