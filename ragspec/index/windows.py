"""The relevance gate's window vectors, stored with an index: every chunk's two-sentence windows
(`corpus.windows`), alone and after its document's title, embedded by the index's embedder when it is built.

Why: the gate and the source budget compare the question with every window of every retrieved source. Embedding
them per ask was about 2.1 s of a warm 0.5B ask on a 2-core Zen 3 (192 texts for five sources), for texts that
never change between asks; the build embeds them once, and incrementally like the chunk vectors.

On disk: `windows.npy` (float16, one row per window: chunks in id order, each chunk's windows in `window_texts`
order) and `window_offsets.npy` (int64, n_chunks + 1: chunk id → its first row). float16 as `embeddings.npy`:
half the bytes of float32, and its rounding (under 2.5e-4 of a unit vector's component) is below what the
embedder's own batching changes in bfloat16; the gate's decisions were measured the same (docs/indexing.md).
The manifest records them under `embedder.windows` (count, dtype, the window definition's version); an index
without that entry, or with another definition, is read as having none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ragspec.corpus.windows import WINDOWS_VERSION, sentence_spans, window_runs, window_texts

WINDOWS = "windows.npy"
OFFSETS = "window_offsets.npy"
DTYPE = "float16"
BLOCK = 2000  # chunks whose windows are embedded in one go (copies inside a block are embedded once)


def count_windows(text: str, title: str) -> int:
    """len(window_texts(text, title)) without building the texts."""
    n = len(window_runs(len(sentence_spans(text))))
    return n * 2 if (title or "").strip() else n


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
        """The chunk's window vectors as stored (float16), in `window_texts` order."""
        return self.vectors[int(self.offsets[chunk_id]):int(self.offsets[chunk_id + 1])]

    def lookup(self, chunks) -> dict[str, np.ndarray]:
        """Window text → its vector (float32) over `chunks` (store.ChunkRow: text and title). A chunk whose
        windows no longer count what was stored is left out (its windows are then embedded at ask time)."""
        out: dict[str, np.ndarray] = {}
        for c in chunks:
            if not 0 <= c.id < len(self.offsets) - 1:
                continue
            texts = window_texts(c.text, c.title)
            vecs = self.rows(c.id)
            if len(vecs) == len(texts):
                out.update(zip(texts, np.asarray(vecs, dtype=np.float32)))
        return out


def write(folder: Path, chunks: Sequence[tuple[str, str]], reuse: Sequence[int], previous: StoredWindows | None,
          encode: Callable[[list[str], Callable[[int], None]], np.ndarray] | None, dim: int,
          bar=None, task=None) -> tuple[int, int]:
    """Write `windows.npy` and `window_offsets.npy` for `chunks` ((text, title) per new chunk id).

    `reuse[i]`: the previous version's chunk id whose windows chunk i takes as they are (-1: none), read from
    `previous`; the rest are embedded with `encode(texts, on_batch)` in blocks of `BLOCK` chunks, each distinct
    text of a block once. `bar`/`task`: a progress display advanced per window embedded. Returns (windows
    embedded, windows reused)."""
    counts = np.asarray([count_windows(t, title) for t, title in chunks], dtype=np.int64)
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] == 0:  # no chunk has a sentence (nothing to map)
        np.save(Path(folder) / WINDOWS, np.zeros((0, dim), np.float16), allow_pickle=False)
        np.save(Path(folder) / OFFSETS, offsets, allow_pickle=False)
        return 0, 0
    out = np.lib.format.open_memmap(Path(folder) / WINDOWS, mode="w+", dtype=np.float16,
                                    shape=(int(offsets[-1]), dim))
    reused = 0
    todo: list[int] = []
    for i, old in enumerate(reuse):
        if old >= 0 and previous is not None:
            rows = previous.rows(old)
            if len(rows) == counts[i]:
                out[offsets[i]:offsets[i + 1]] = rows
                reused += len(rows)
                continue
        todo.append(i)
    embedded = 0
    for b in range(0, len(todo), BLOCK):
        block = todo[b:b + BLOCK]
        texts = [w for i in block for w in window_texts(*chunks[i])]
        distinct = list(dict.fromkeys(texts))
        tick = (lambda k: bar.advance(task, k)) if bar is not None else (lambda k: None)
        vecs = encode(distinct, tick) if distinct else np.zeros((0, dim), np.float32)
        if bar is not None:
            bar.advance(task, len(texts) - len(distinct))  # copies inside the block: counted, not embedded
        row = {t: k for k, t in enumerate(distinct)}
        k = 0
        for i in block:
            n = int(counts[i])
            out[offsets[i]:offsets[i + 1]] = vecs[[row[t] for t in texts[k:k + n]]].astype(np.float16)
            k += n
        embedded += len(distinct)
    out.flush()
    del out
    np.save(Path(folder) / OFFSETS, offsets, allow_pickle=False)
    return embedded, reused


def to_embed(chunks: Sequence[tuple[str, str]], reuse: Sequence[int], previous: StoredWindows | None) -> int:
    """How many windows `write` will embed (before copies are folded): for the progress display's total."""
    return sum(count_windows(*chunks[i]) for i, old in enumerate(reuse)
               if old < 0 or previous is None or len(previous.rows(old)) != count_windows(*chunks[i]))
