"""The question against the sources' two-sentence windows: the cosines the relevance gate and the source budget
both judge by, measured once per ask.

Why one place: the gate scores the sources by their best window and best whole source, the budget keeps their
best windows; both compare the question with the same texts (`windows`: each window alone and after the
source's title, `corpus.windows`), so one measurement serves both. Why stored vectors: those texts never change
between asks, and embedding them was about 2.1 s of a warm 0.5B ask (192 texts for five sources, 2-core Zen 3).
An index built by this ragspec holds every chunk's window vectors (`index.windows`) and every chunk's own
vector; a source that is an index chunk, or neighbouring chunks merged, takes from them every text whose
vector is stored — matched by the exact text, so a window that spans a chunk boundary of a merged source, a
cut source's or a given passage's, is embedded here instead — and only the rest (always the question) is
embedded, remembered across asks (`EmbeddingMemo`). An index built before stores none: it still answers,
embedding at ask time as before, and says once how to add them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ragspec.console import warn
from ragspec.corpus.windows import window_texts
from ragspec.retrieve.trim import best_of_titled


def windows(s) -> list[str]:
    """What the gate embeds for a source: each run of two consecutive sentences, alone and with the source's
    title in front (a title names what a passage is about; a file's first line taken as its title may not)."""
    return window_texts(s.text, getattr(s, "title", "") or "")


def _whole(s) -> str:
    """A whole source as the gate embeds it: its text alone (the embedder truncates a long one). Not after its
    title, unlike the windows: on the tuning records a title in front lowered the whole source's separation
    (CLAP NQ 151-300 AUC 0.874 with it, 0.880 without; the mean score's 0.878 against 0.901)."""
    return s.text.strip()


@dataclass
class Measured:
    """The question against the sources: the gate's score (None when wholes were not embedded) and, per source,
    each window's cosine (the best of the window alone and after the title)."""

    score: float | None
    windows: list[np.ndarray]


class EmbeddingMemo:
    """The embeddings of recent window and source texts (LRU, `capacity` texts): the same sources come back ask
    after ask (passages given with the question, or an index without stored windows)."""

    def __init__(self, capacity: int = 20_000):
        self.capacity = capacity
        self.vectors: OrderedDict[str, np.ndarray] = OrderedDict()

    def encode(self, embedder, texts: list[str], keep: int) -> np.ndarray:
        """Vectors of `texts`, embedding only those not remembered; the first `keep` (the question) are embedded
        every time and never remembered."""
        todo = [t for i, t in enumerate(texts) if i < keep or t not in self.vectors]
        fresh = np.asarray(embedder.encode(todo), dtype=np.float32) if todo else None
        got = dict(zip(todo, fresh)) if todo else {}
        out = np.stack([got[t] if t in got else self.vectors[t] for t in texts])
        for i, t in enumerate(texts):
            if i >= keep:
                self.vectors[t] = out[i]
                self.vectors.move_to_end(t)
        while len(self.vectors) > self.capacity:
            self.vectors.popitem(last=False)
        return out


def measure(embedder, question: str, sources, wholes: bool = True, lock: threading.Lock | None = None,
            memo: EmbeddingMemo | None = None, stored: dict[str, np.ndarray] | None = None) -> Measured:
    """Embed the question, every window of every source and (with `wholes`) every whole source, each distinct
    text once, in one call: only the texts `stored` (text → vector, from the index) lacks, and with `memo` only
    those it does not remember either."""
    per = [windows(s) for s in sources]
    wins = [w for ws in per for w in ws]
    whole = [_whole(s) for s in sources if s.text.strip()] if wholes else []
    if not wins:
        return Measured(-1.0 if wholes else None, [np.zeros(0, dtype=np.float32) for _ in sources])
    texts = [question, *wins, *whole]
    unique = list(dict.fromkeys(texts))  # a source of one or two sentences is its own only window
    known = stored or {}
    todo = [t for i, t in enumerate(unique) if i == 0 or t not in known]  # the question always
    with lock or contextlib.nullcontext():
        if memo is not None:
            fresh = memo.encode(embedder, todo, keep=1)
        else:
            fresh = np.asarray(embedder.encode(todo), dtype=np.float32)
    vector = dict(zip(todo, fresh))
    single = [t for t in unique if t in vector or known[t].ndim == 1]
    vecs = np.stack([vector[t] if t in vector else known[t] for t in single])
    by_text = dict(zip(single, vecs @ vecs[0]))
    for t in unique:  # a source over several chunks: the best of its chunks' own vectors
        if t not in by_text:
            by_text[t] = float(np.max(known[t] @ vecs[0]))
    sims = np.asarray([by_text[t] for t in texts[1:]], dtype=np.float32)
    score = float((sims[:len(wins)].max() + sims[len(wins):].max()) / 2) if wholes else None
    out, k = [], 0
    for s, ws in zip(sources, per):
        n = len(ws) // 2 if (getattr(s, "title", "") or "").strip() else len(ws)  # then the same after the title
        out.append(best_of_titled(sims[k:k + len(ws)], n))
        k += len(ws)
    return Measured(score, out)


def chunk_ids(s) -> list[int]:
    """The index chunks a source's text spans: every chunk of its first location (neighbours merged into one
    span), else its own chunk; [] for a passage that is not from the index."""
    locations = getattr(s, "locations", None) or []
    ids = list(getattr(locations[0], "chunk_ids", []) or []) if locations else []
    own = getattr(s, "chunk_id", -1)
    return ids or ([own] if own is not None and own >= 0 else [])


_told: set[str] = set()  # indexes already said to have no stored windows (once per process)


def stored_vectors(index, sources) -> dict[str, np.ndarray]:
    """Text → vector for every window and whole-chunk text of `sources` that `index` stores: the windows of
    the chunks each source spans, a chunk's own vector for a source that is that one chunk whole, and for a
    source of several merged chunks their vectors as one [k, dim] array (`measure` takes the best cosine)."""
    if index is None:
        return {}
    ids = sorted({c for s in sources for c in chunk_ids(s)})
    if not ids:
        return {}
    rows = index.store.chunks(ids)
    stored = index.windows
    if stored is None:
        _say_how_to_add(index)
        out = {}
    else:
        out = stored.lookup(rows)
    by_id = {r.id: r for r in rows}
    for s in sources:
        ids = chunk_ids(s)
        text = _whole(s)
        if text in out:
            continue
        row = by_id.get(ids[0]) if len(ids) == 1 else None
        if row is not None and row.text == text:
            out[text] = np.asarray(index.embeddings[row.id], dtype=np.float32)
        elif len(ids) > 1 and all(i in by_id for i in ids):
            # neighbours merged into one source: its chunks' own vectors [k, dim] stand for the whole, the best
            # of them its cosine (embedding a merged text at ask time took 70-150 ms of a 0.5B ask on 2 cores,
            # and the embedder cuts it at its token limit)
            out[text] = np.stack([np.asarray(index.embeddings[i], dtype=np.float32) for i in ids])
    return out


def _say_how_to_add(index) -> None:
    key = str(index.folder)
    if key not in _told:
        _told.add(key)
        warn(f"index {index.path} has no stored gate windows (built before ragspec stored them), so each ask embeds "
             f"its sources' windows; add them with: ragspec index {index.corpus_root} --out {index.path}")


class WindowScorer:
    """Measures a question against sources (`measure`) with one embedder, reading what the index stores.

    `embedder`: a function that returns the embedder (called on first use); `index`: one that returns the
    opened index, or None. One lock: the embedder is not used by two asks at once."""

    def __init__(self, embedder: Callable[[], object], index: Callable[[], object] | None = None):
        self._load_embedder, self._load_index = embedder, index
        self._embedder = None
        self.lock = threading.Lock()
        self.memo = EmbeddingMemo()  # used under `lock`

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = self._load_embedder()
        return self._embedder

    def measure(self, question: str, sources, wholes: bool = True) -> Measured:
        stored = stored_vectors(self._load_index() if self._load_index else None, sources)
        return measure(self.embedder, question, sources, wholes, self.lock, self.memo, stored)
