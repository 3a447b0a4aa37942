"""The relevance gate: decline before generating when no source is about the question.

Why: a small generator told to decline "if none of the sources answers" cannot tell when to. Over CLAP NQ
records it was not tuned on, the log-probability Qwen2.5-0.5B gives the decline sentence separates answerable
from unanswerable questions with an AUC of 0.64, and a yes/no check turn 0.58; the embedder's cosine between
the question and the sources does it with 0.84-0.90. So the pipeline embeds the question, every window of two
sentences of each source (alone, and after its title) and each whole source (its text); the score is
the mean of the best window's cosine and the best whole source's. Under the floor it answers `DECLINED`
without running the model, and otherwise asks for an answer without offering to decline (docs/evaluation.md, *Declining*).
Both parts, because each fails where the other holds: a retrieved chunk often holds several topics and its
whole cosine drops (0.35 for a river chunk that says what barges carry on the Rhine, 0.72 for its window),
while a passage from the right page that lacks the asked fact often has one window close to the question's
words. On the tuning records (CLAP NQ 151-300) the window alone separates with AUC 0.86, the whole passage
0.88, their mean 0.90 (held out, CLAP NQ 1-150: 0.84, 0.90, 0.90).

A request that is a task on the sources rather than a question about them ("Summarise the notes.", "Translate
this passage") is not gated: it scores low against any source and would be declined (`is_task_on_sources`).

Just over the floor the score is least sure. `prompt.relevance_doubt` sets a band there in which the model
is offered to decline and decides itself, so the generator adds its own judgement where the embedder's is
weakest. The band is measured per generator and embedder (the generator's registry entry, `relevance_band`):
with `relevance_floor: auto` and `relevance_doubt: auto` (the defaults) a generator that has one uses its floor
and its band, and any other uses the embedder's floor alone.

The floor belongs to an embedder (cosines are not comparable across models): `auto` takes the one measured for
it (the registry entry's `relevance_floor`), and an embedder with none leaves the gate off.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ragspec.retrieve.trim import best_of_titled, window_texts
from ragspec.settings import parse_floor


def windows(s) -> list[str]:
    """What the gate embeds for a source: each run of two consecutive sentences, alone and with the source's
    title in front (a title names what a passage is about; a file's first line taken as its title may not)."""
    return window_texts(s.text, getattr(s, "title", "") or "")


# A request whose first word is one of these asks for something done to the sources, not found in them.
_TASK_VERBS = frozenset("""summarise summarize summarized summarised summary tl;dr tldr translate rewrite rephrase
paraphrase shorten condense simplify proofread reformat format outline restate reword""".split())
# ... and so does one that points at the sources themselves.
_DEICTIC = re.compile(r"\b(?:these|this|those|above|given|provided|following|attached)\s+"
                      r"(?:sources?|notes?|documents?|texts?|passages?|articles?|pages?|excerpts?|paragraphs?)\b"
                      r"|\bthe\s+(?:sources?|notes|passages?|above|text|excerpts?)\b", re.IGNORECASE)


def is_task_on_sources(question: str) -> bool:
    """True for a request that is a task on the sources ("Summarise the notes.", "What does the passage say
    about …?"): the gate does not apply to it, and the model is offered to decline as without a gate."""
    words = question.strip().lower().split()
    if not words:
        return False
    return words[0].strip(",.:;!?") in _TASK_VERBS or bool(_DEICTIC.search(question))


def _whole(s) -> str:
    """A whole source as the gate embeds it: its text alone (the embedder truncates a long one). Not after its
    title, unlike the windows: on the tuning records a title in front lowered the whole source's separation
    (CLAP NQ 151-300 AUC 0.874 with it, 0.880 without; the mean score's 0.878 against 0.901)."""
    return s.text.strip()


def calibrated_floor(embedder_name: str) -> float | None:
    """The floor measured for an embedder (registry), or None."""
    from ragspec.models.registry import lookup

    entry = lookup(embedder_name, "embedder")
    floor = entry.extra.get("relevance_floor") if entry else None
    return float(floor) if floor is not None else None


@dataclass
class Measured:
    """The question against the sources: the gate's score (None when wholes were not embedded) and, per source,
    each window's cosine (the best of the window alone and after the title)."""

    score: float | None
    windows: list[np.ndarray]


class EmbeddingMemo:
    """The embeddings of recent window and source texts (LRU, `capacity` texts): the same sources come back ask
    after ask, and embedding their windows again was 2.1 s of a 0.5B ask's wait on a 2-core Zen 3."""

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
            memo: EmbeddingMemo | None = None) -> Measured:
    """Embed the question, every window of every source and (with `wholes`) every whole source, each distinct
    text once, in one call (with `memo`: only the texts it does not remember)."""
    per = [windows(s) for s in sources]
    wins = [w for ws in per for w in ws]
    whole = [_whole(s) for s in sources if s.text.strip()] if wholes else []
    if not wins:
        return Measured(-1.0 if wholes else None, [np.zeros(0, dtype=np.float32) for _ in sources])
    texts = [question, *wins, *whole]
    unique = list(dict.fromkeys(texts))  # a source of one or two sentences is its own only window
    with lock or contextlib.nullcontext():
        if memo is not None:
            vecs = memo.encode(embedder, unique, keep=1)
        else:
            vecs = np.asarray(embedder.encode(unique), dtype=np.float32)
    row = {t: i for i, t in enumerate(unique)}
    sims = vecs[[row[t] for t in texts[1:]]] @ vecs[0]
    score = float((sims[:len(wins)].max() + sims[len(wins):].max()) / 2) if wholes else None
    out, k = [], 0
    for s, ws in zip(sources, per):
        n = len(ws) // 2 if (getattr(s, "title", "") or "").strip() else len(ws)  # then the same after the title
        out.append(best_of_titled(sims[k:k + len(ws)], n))
        k += len(ws)
    return Measured(score, out)


@dataclass
class RelevanceGate:
    embedder: object  # ragspec.models.embedder.Embedder
    floor: float
    doubt: float | None = None  # from the floor up to this score the model is offered to decline
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    memo: EmbeddingMemo = field(default_factory=EmbeddingMemo, repr=False)  # used under `lock`

    def score(self, question: str, sources) -> float:
        """The mean of the best cosine between the question and a window of a source and the best between the
        question and a whole source (-1 with no text). Each distinct text is embedded once."""
        return self.measure(question, sources).score

    def measure(self, question: str, sources, wholes: bool = True) -> Measured:
        """The score, and each source's window cosines (what the source budget cuts by), from one embedding
        call. `wholes=False`: windows only (no score), when only the budget needs them."""
        return measure(self.embedder, question, sources, wholes, self.lock, self.memo)

    def passes(self, score: float) -> bool:
        return score >= self.floor

    def unsure(self, score: float) -> bool:
        """A passing score under `doubt`: the model, offered to decline, decides."""
        return self.doubt is not None and self.floor <= score < self.doubt


def measured_band(generator_name: str | None, embedder_name: str) -> tuple[float, float] | None:
    """The (floor, doubt) measured for a generator with an embedder (registry), or None."""
    from ragspec.models.registry import generator_entry

    entry = generator_entry(generator_name) if generator_name else None
    band = (entry.extra.get("relevance_band") or {}).get(embedder_name.lower()) if entry else None
    return (float(band[0]), float(band[1])) if band else None


def resolve_gate(setting, embedder_loader, embedder_name: str, doubt="auto",
                 generator_name: str | None = None) -> RelevanceGate | None:
    """`prompt.relevance_floor` → a gate or None. `setting`: "off", "auto" or a cosine; `embedder_loader()` loads
    the embedder named `embedder_name` (called only when a gate is made); `doubt`: `prompt.relevance_doubt`.

    Both `auto` take the band measured for this generator with this embedder where there is one (its floor and
    its doubt were chosen together), else the embedder's floor with no band. With only one of them `auto`, the
    measured band is not used: an `auto` floor is the embedder's, an `auto` doubt is no band."""
    if setting is None:
        return None
    floor = parse_floor(setting)
    if floor == "off":
        return None
    band = measured_band(generator_name, embedder_name) if floor == "auto" and doubt == "auto" else None
    if doubt == "auto":
        doubt = band[1] if band else None
    if floor == "auto":
        floor = band[0] if band else calibrated_floor(embedder_name)
        if floor is None:
            return None
    return RelevanceGate(embedder_loader(), floor, doubt)
