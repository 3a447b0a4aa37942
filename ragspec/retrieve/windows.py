"""The question against the sources' two-sentence windows: the cosines the relevance gate and the source budget
both judge by, measured once per ask.

Why one place: the gate scores the sources by their best window and best whole source, the budget keeps their
best windows; both compare the question with the same vectors, so one measurement serves both. A window's vector
is pooled from its source's own forward (late chunking, `Embedder.encode_windows`): an index built by this
ragspec stores every chunk's window vectors (`index.windows`) and every chunk's own vector, so a source that is
one index chunk costs the ask no forward but the question's. Neighbouring chunks merged into one source take
their chunks' stored windows and vectors (the best cosine of them as their whole); only a window across a seam
between two chunks is read, in a forward of a few sentences around it. Any other source (a given passage, a cut
source, a chunk of an index built before) is read in one forward of its text. Both are remembered across asks
(`PooledMemo`). An index built before stores none: it still answers, and says once how to add them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ragspec.console import warn
from ragspec.corpus.windows import sentence_spans, window_runs, window_texts


def windows(s) -> list[str]:
    """The names of a source's windows (each run of two consecutive sentences): stored windows are matched by
    them."""
    return window_texts(s.text)


def _whole(s) -> str:
    """A whole source as the gate reads it: its text alone (the embedder truncates a long one)."""
    return s.text.strip()


@dataclass
class Measured:
    """The question against the sources: the gate's score (None when wholes were not wanted) and, per source,
    each window's cosine."""

    score: float | None
    windows: list[np.ndarray]


class PooledMemo:
    """Recent sources' pooled vectors (text → (whole, windows); LRU, `capacity` texts): the same sources come
    back ask after ask (passages given with the question, merged neighbours, an index without stored windows)."""

    def __init__(self, capacity: int = 2_000):
        self.capacity = capacity
        self.pooled: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def pool(self, embedder, texts: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.pooled]
        if todo:
            wholes, wins = embedder.encode_windows(todo)
            for t, w, ws in zip(todo, wholes, wins):
                self.pooled[t] = (np.asarray(w, np.float32), np.asarray(ws, np.float32))
        out = {}
        for t in texts:
            self.pooled.move_to_end(t)
            out[t] = self.pooled[t]
        while len(self.pooled) > self.capacity:
            self.pooled.popitem(last=False)
        return out


def measure(embedder, question: str, sources, wholes: bool = True, lock: threading.Lock | None = None,
            memo: PooledMemo | None = None, stored: dict[str, np.ndarray] | None = None) -> Measured:
    """The question's cosine with every window of every source and (with `wholes`) the gate's score: the mean
    of the best window's and the best whole source's cosine. Window and whole vectors come from `stored` (text
    → vector, from the index) where it has all of a source's, else from one forward of the source's text."""
    per = [windows(s) for s in sources]
    if not any(per):
        return Measured(-1.0 if wholes else None, [np.zeros(0, dtype=np.float32) for _ in sources])
    known = stored or {}

    def complete(s, ws) -> bool:
        return all(w in known for w in ws) and (not wholes or _whole(s) in known)

    # a source whose whole and all but its seams' windows are stored (neighbouring chunks merged) reads only
    # each seam's neighbourhood; any other incomplete source is read whole
    seams, todo = {}, []
    for s, ws in zip(sources, per):
        if ws and not complete(s, ws):
            p = seam_pieces(s.text, ws, known) if not wholes or _whole(s) in known else None
            if p is None:
                todo.append(s.text)
            else:
                seams[s.text] = p
    pieces = [piece for p in seams.values() for piece, _ in p.values()]
    with lock or contextlib.nullcontext():
        q = np.asarray(embedder.encode([question]), dtype=np.float32)[0]
        texts = todo + pieces
        if memo is not None:
            pooled = memo.pool(embedder, texts) if texts else {}
        else:
            got = embedder.encode_windows(list(dict.fromkeys(texts))) if texts else ([], [])
            pooled = dict(zip(dict.fromkeys(texts), zip(*got)))
    if seams:  # the seams' windows join the stored ones
        known = {**known, **{name: pooled[piece][1][k] for p in seams.values() for name, (piece, k) in p.items()}}
    out, best_window, best_whole = [], -1.0, -1.0
    for s, ws in zip(sources, per):
        if not ws:
            out.append(np.zeros(0, dtype=np.float32))
            continue
        if s.text in pooled and s.text not in seams:
            whole, wins = pooled[s.text]
            whole = known.get(_whole(s), whole)  # merged neighbours: their chunks' own vectors
        else:
            whole, wins = known.get(_whole(s)), np.stack([known[w] for w in ws])
        sims = np.asarray(wins, np.float32) @ q
        out.append(sims)
        best_window = max(best_window, float(sims.max()))
        if wholes and whole is not None:
            best_whole = max(best_whole, float(np.max(np.asarray(whole, np.float32) @ q)))
    return Measured((best_window + best_whole) / 2 if wholes else None, out)


SEAM_CONTEXT = 2  # sentences read on each side of a seam's window


def seam_pieces(text: str, names: list[str], known) -> dict[str, tuple[str, int]] | None:
    """For each window of `text` that `known` lacks, the piece of text read for it (the window and up to
    `SEAM_CONTEXT` sentences either side) and the window's index among the piece's: a seam between stored
    chunks costs a forward of a few sentences, not of the whole merged source. None when most windows are
    missing (a source not from the index: read whole)."""
    missing = [i for i, n in enumerate(names) if n not in known]
    if not missing or 2 * len(missing) > len(names):
        return None
    spans = sentence_spans(text)
    runs = window_runs(len(spans))
    out = {}
    for i in missing:
        a, b = runs[i]
        first, last = max(0, a - SEAM_CONTEXT), min(len(spans) - 1, b + SEAM_CONTEXT)
        piece = text[spans[first][0]:spans[last][1]]
        if window_texts(piece)[i - first:i - first + 1] != [names[i]]:  # the piece splits otherwise: read whole
            return None
        out[names[i]] = (piece, i - first)
    return out


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
        warn(f"index {index.path} has no stored gate windows (or windows of an older kind), so each ask pools its "
             f"sources' windows; add them with: ragspec index {index.corpus_root} --out {index.path}")


class WindowScorer:
    """Measures a question against sources (`measure`) with one embedder, reading what the index stores.

    `embedder`: a function that returns the embedder (called on first use); `index`: one that returns the
    opened index, or None. One lock: the embedder is not used by two asks at once."""

    def __init__(self, embedder: Callable[[], object], index: Callable[[], object] | None = None):
        self._load_embedder, self._load_index = embedder, index
        self._embedder = None
        self.lock = threading.Lock()
        self.memo = PooledMemo()  # used under `lock`

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = self._load_embedder()
        return self._embedder

    def measure(self, question: str, sources, wholes: bool = True) -> Measured:
        stored = stored_vectors(self._load_index() if self._load_index else None, sources)
        return measure(self.embedder, question, sources, wholes, self.lock, self.memo, stored)
