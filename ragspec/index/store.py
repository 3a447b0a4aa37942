"""The SQLite half of an index: documents (with their text, which offsets index, and their metadata) and chunks
(with the hash of their normalised text, so copies of one paragraph are found without comparing texts)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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
    file_type TEXT NOT NULL,     -- the file's suffix without the dot ('txt', 'jsonl', ...)
    meta TEXT NOT NULL,          -- JSON object: a JSON record's other scalar fields ({} for files)
    UNIQUE (path, key)
);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY,      -- also the FAISS id and the row of embeddings.npy
    document INTEGER NOT NULL REFERENCES documents(id),
    ord INTEGER NOT NULL,
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    text TEXT NOT NULL,
    hash TEXT NOT NULL           -- text_hash(text): equal for copies that differ only in whitespace
);
CREATE INDEX chunks_by_document ON chunks(document, ord);
CREATE INDEX chunks_by_hash ON chunks(hash);
"""


def text_hash(text: str) -> str:
    """sha1 of the text with whitespace runs collapsed and ends stripped (copies re-wrapped still match)."""
    return hashlib.sha1(" ".join(text.split()).encode("utf-8")).hexdigest()


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
    hash: str = ""


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
            "SELECT c.id, c.document, c.ord, c.start, c.end, c.text, d.path, d.key, d.title, c.hash "
            f"FROM chunks c JOIN documents d ON d.id = c.document WHERE c.id IN ({marks})",
            ids,
        ).fetchall()
        by_id = {r[0]: ChunkRow(*r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def copies(self, hashes: Iterable[str]) -> dict[str, list[int]]:
        """Chunk ids per text hash, ascending: every copy of each text."""
        hashes = list(dict.fromkeys(hashes))
        out: dict[str, list[int]] = {h: [] for h in hashes}
        for start in range(0, len(hashes), 500):
            part = hashes[start:start + 500]
            marks = ",".join("?" * len(part))
            for cid, h in self._db.execute(f"SELECT id, hash FROM chunks WHERE hash IN ({marks}) ORDER BY id", part):
                out[h].append(cid)
        return out

    def chunk_documents(self) -> list[int]:
        """The document id of every chunk, by chunk id (ids are dense from 0)."""
        return [r[0] for r in self._db.execute("SELECT document FROM chunks ORDER BY id")]

    def metadata(self) -> list[tuple[int, dict]]:
        """(document id, filterable fields) of every document: path, title, type, modified, key and a JSON
        record's own scalar fields (the built-in ones win a clash)."""
        out = []
        for did, path, key, title, mtime, ftype, meta in self._db.execute(
                "SELECT id, path, key, title, mtime, file_type, meta FROM documents ORDER BY id"):
            fields = json.loads(meta)
            fields.update(path=path, key=key, title=title, type=ftype, modified=mtime)
            out.append((did, fields))
        return out

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

    def document_full(self, document_id: int) -> tuple[DocumentRow, str, str, dict]:
        """(row, text, file type, record metadata) of one document."""
        row = self._db.execute(
            "SELECT id, path, key, sha256, size, mtime, title, encoding, text, file_type, meta FROM documents "
            "WHERE id = ?", (document_id,),
        ).fetchone()
        return DocumentRow(*row[:8]), row[8], row[9], json.loads(row[10])

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

    def add_document(self, *, path, key, sha256, size, mtime, title, encoding, text, file_type="", meta=None) -> int:
        cur = self._db.execute(
            "INSERT INTO documents (path, key, sha256, size, mtime, title, encoding, text, file_type, meta) "
            "VALUES (?,?,?,?,?,?,?,?,?,?)",
            (path, key, sha256, size, mtime, title, encoding, text, file_type,
             json.dumps(meta or {}, ensure_ascii=False, sort_keys=True)),
        )
        return cur.lastrowid

    def add_chunks(self, document_id: int, chunks: Iterable[tuple[int, int, int, str]]) -> list[int]:
        """Insert (order, start, end, text) rows; chunk ids are assigned densely from 0."""
        ids = []
        rows = []
        for order, start, end, text in chunks:
            rows.append((self._next_chunk, document_id, order, start, end, text, text_hash(text)))
            ids.append(self._next_chunk)
            self._next_chunk += 1
        self._db.executemany("INSERT INTO chunks (id, document, ord, start, end, text, hash) VALUES (?,?,?,?,?,?,?)",
                             rows)
        return ids

    def close(self) -> None:
        self._db.commit()
        self._db.close()
