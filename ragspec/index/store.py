"""The SQLite half of an index: documents (with their text, which offsets index) and chunks."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

SCHEMA = """
CREATE TABLE documents (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL,          -- relative to the corpus root, '/'-separated
    key TEXT NOT NULL,           -- '' for a whole file, else the JSON record id
    sha256 TEXT NOT NULL,        -- of the source file's bytes
    size INTEGER NOT NULL,
    mtime REAL NOT NULL,
    title TEXT NOT NULL,
    encoding TEXT NOT NULL,
    text TEXT NOT NULL,          -- the document text that chunk offsets index
    UNIQUE (path, key)
);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY,      -- also the FAISS id and the row of embeddings.npy
    document INTEGER NOT NULL REFERENCES documents(id),
    ord INTEGER NOT NULL,
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX chunks_by_document ON chunks(document, ord);
"""


@dataclass(frozen=True)
class ChunkRow:
    id: int
    document: int
    order: int
    start: int
    end: int
    text: str
    path: str
    key: str
    title: str


@dataclass(frozen=True)
class DocumentRow:
    id: int
    path: str
    key: str
    sha256: str
    size: int
    mtime: float
    title: str
    encoding: str


class Store:
    """Read access to `store.sqlite` (opened read-only, safe to share across threads)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)

    def close(self) -> None:
        self._db.close()

    def count_chunks(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def count_documents(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]

    def chunks(self, ids: Iterable[int]) -> list[ChunkRow]:
        """Rows for `ids`, in the order given (missing ids are left out)."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        rows = self._db.execute(
            "SELECT c.id, c.document, c.ord, c.start, c.end, c.text, d.path, d.key, d.title "
            f"FROM chunks c JOIN documents d ON d.id = c.document WHERE c.id IN ({marks})",
            ids,
        ).fetchall()
        by_id = {r[0]: ChunkRow(*r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def all_chunk_texts(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT text FROM chunks ORDER BY id")]

    def documents(self) -> list[DocumentRow]:
        return [
            DocumentRow(*r)
            for r in self._db.execute(
                "SELECT id, path, key, sha256, size, mtime, title, encoding FROM documents ORDER BY id"
            )
        ]

    def document_text(self, document_id: int) -> str:
        row = self._db.execute("SELECT text FROM documents WHERE id = ?", (document_id,)).fetchone()
        if row is None:
            raise KeyError(document_id)
        return row[0]

    def document_full(self, document_id: int) -> tuple[DocumentRow, str]:
        row = self._db.execute(
            "SELECT id, path, key, sha256, size, mtime, title, encoding, text FROM documents WHERE id = ?",
            (document_id,),
        ).fetchone()
        return DocumentRow(*row[:8]), row[8]

    def chunks_of(self, document_id: int) -> list[tuple[int, int, int, int, str]]:
        """(chunk id, order, start, end, text) of one document, in order."""
        return self._db.execute(
            "SELECT id, ord, start, end, text FROM chunks WHERE document = ? ORDER BY ord", (document_id,)
        ).fetchall()


class StoreWriter:
    """Writes a fresh `store.sqlite` (only ever into a new version directory)."""

    def __init__(self, path: Path):
        self._db = sqlite3.connect(path)
        self._db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;")
        self._db.executescript(SCHEMA)
        self._next_chunk = 0

    def add_document(self, *, path, key, sha256, size, mtime, title, encoding, text) -> int:
        cur = self._db.execute(
            "INSERT INTO documents (path, key, sha256, size, mtime, title, encoding, text) VALUES (?,?,?,?,?,?,?,?)",
            (path, key, sha256, size, mtime, title, encoding, text),
        )
        return cur.lastrowid

    def add_chunks(self, document_id: int, chunks: Iterable[tuple[int, int, int, str]]) -> list[int]:
        """Insert (order, start, end, text) rows; chunk ids are assigned densely from 0."""
        ids = []
        rows = []
        for order, start, end, text in chunks:
            rows.append((self._next_chunk, document_id, order, start, end, text))
            ids.append(self._next_chunk)
            self._next_chunk += 1
        self._db.executemany("INSERT INTO chunks (id, document, ord, start, end, text) VALUES (?,?,?,?,?,?)", rows)
        return ids

    def close(self) -> None:
        self._db.commit()
        self._db.close()
