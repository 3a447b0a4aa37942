"""The relevance gate's window vectors, stored with an index: every chunk's two-sentence windows
(`corpus.windows`), each pooled from the chunk's own forward when the index embeds the chunk
(`Embedder.encode_windows`).

Why: the gate and the source budget compare the question with every window of every retrieved source; pooling
them from the chunk's token states costs the build almost nothing beyond the chunks' own embedding (embedding
each window alone, and again after the title, took 6× the chunks' time: 18,351 windows in 121 s against 636
chunks in 20 s), and an ask reads them back instead of embedding them.

On disk: `windows.npy` (float16, one row per window: chunks in id order, each chunk's windows in `window_spans`
order) and `window_offsets.npy` (int64, n_chunks + 1: chunk id → its first row). float16 as `embeddings.npy`:
half the bytes of float32, and its rounding (under 2.5e-4 of a unit vector's component) is below what the
embedder's own batching changes in bfloat16. The manifest records them under `embedder.windows` (count, dtype,
the window definition's version); an index without that entry, or with another definition, is read as having
none (the gate then pools the sources' windows at ask time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ragspec.corpus.windows import WINDOWS_VERSION, sentence_spans, window_runs, window_texts

WINDOWS = "windows.npy"
OFFSETS = "window_offsets.npy"
DTYPE = "float16"


def count_windows(text: str) -> int:
    """len(window_texts(text)) without building the texts."""
    return len(window_runs(len(sentence_spans(text))))


def manifest_entry(rows: int) -> dict:
    return {"file": WINDOWS, "offsets": OFFSETS, "rows": int(rows), "dtype": DTYPE, "version": WINDOWS_VERSION}


def stored(manifest: dict) -> dict | None:
    """The manifest's window entry when its vectors can be read by this ragspec, else None."""
    entry = manifest.get("embedder", {}).get("windows")
    return entry if isinstance(entry, dict) and entry.get("version") == WINDOWS_VERSION else None


class StoredWindows:
    """Read side: the stored window vectors of an index version (memory-mapped)."""

    def __init__(self, folder: Path):
        self.vectors = np.load(Path(folder) / WINDOWS, mmap_mode="r", allow_pickle=False)
        self.offsets = np.load(Path(folder) / OFFSETS, allow_pickle=False)

    def rows(self, chunk_id: int) -> np.ndarray:
        """The chunk's window vectors as stored (float16), in `window_spans` order."""
        return self.vectors[int(self.offsets[chunk_id]):int(self.offsets[chunk_id + 1])]

    def lookup(self, chunks) -> dict[str, np.ndarray]:
        """Window text → its vector (float32) over `chunks` (store.ChunkRow). A chunk whose windows no longer
        count what was stored is left out (its windows are then pooled at ask time)."""
        out: dict[str, np.ndarray] = {}
        for c in chunks:
            if not 0 <= c.id < len(self.offsets) - 1:
                continue
            texts = window_texts(c.text)
            vecs = self.rows(c.id)
            if len(vecs) == len(texts):
                out.update(zip(texts, np.asarray(vecs, dtype=np.float32)))
        return out


def write(folder: Path, texts: Sequence[str], reuse: Sequence[int], previous: StoredWindows | None,
          fresh: Sequence[np.ndarray | None], pool: Callable[[list[str]], list[np.ndarray]], dim: int) -> tuple[int, int]:
    """Write `windows.npy` and `window_offsets.npy` for the chunks `texts` (in new chunk id order).

    A chunk takes `fresh[i]` (its windows pooled when it was embedded) where given, else the previous version's
    rows of chunk `reuse[i]` (-1: none) when `previous` stores as many, else `pool(texts)` pools them now (a
    chunk kept from a version without windows). Returns (windows pooled now or fresh, windows reused)."""
    counts = np.asarray([count_windows(t) for t in texts], dtype=np.int64)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] == 0:  # no chunk has a sentence (nothing to map)
        np.save(Path(folder) / WINDOWS, np.zeros((0, dim), np.float16), allow_pickle=False)
        np.save(Path(folder) / OFFSETS, offsets, allow_pickle=False)
        return 0, 0
    out = np.lib.format.open_memmap(Path(folder) / WINDOWS, mode="w+", dtype=np.float16,
                                    shape=(int(offsets[-1]), dim))
    made = reused = 0
    todo: list[int] = []
    for i, old in enumerate(reuse):
        rows = fresh[i] if i < len(fresh) else None
        if rows is not None and len(rows) == counts[i]:
            made += len(rows)
        else:
            rows = previous.rows(old) if old >= 0 and previous is not None else None
            if rows is None or len(rows) != counts[i]:
                todo.append(i)
                continue
            reused += len(rows)
        out[offsets[i]:offsets[i + 1]] = np.asarray(rows, dtype=np.float16)
    if todo:
        for i, rows in zip(todo, pool([texts[i] for i in todo])):
            out[offsets[i]:offsets[i + 1]] = np.asarray(rows, dtype=np.float16)
            made += len(rows)
    out.flush()
    del out
    np.save(Path(folder) / OFFSETS, offsets, allow_pickle=False)
    return made, reused
