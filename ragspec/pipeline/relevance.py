"""The relevance gate: decline before generating when no passage of the sources is about the question.

Why: a small generator told to decline "if none of the sources answers" cannot tell when to. Over CLAP NQ
records it was not tuned on, the log-probability Qwen2.5-0.5B gives the decline sentence separates answerable
from unanswerable questions with an AUC of 0.64, and a yes/no check turn 0.58; the embedder's cosine between
the question and the sources does it with 0.83-0.88. So the pipeline embeds the question and every window of
two sentences of each source (alone, and after its title); when the best cosine is under the floor it answers
`DECLINED` without running the model, and otherwise asks for an answer without offering to decline (README,
*Declining*). Windows, not whole sources: a retrieved chunk often holds several topics, and the whole chunk's
cosine then drops (0.35 for a river chunk that says what barges carry on the Rhine, 0.72 for its window), so a
floor on whole chunks would decline questions the sources answer.

The floor belongs to an embedder (cosines are not comparable across models): `auto` takes the one measured for
it (the registry entry's `relevance_floor`), and an embedder with none leaves the gate off.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

import numpy as np

from ragspec.errors import RagspecError


_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|\n+")


def windows(s) -> list[str]:
    """What the gate embeds for a source: each run of two consecutive sentences, alone and with the source's
    title in front (a title names what a passage is about; a file's first line taken as its title may not)."""
    title = (getattr(s, "title", "") or "").strip()
    parts = [p.strip() for p in _SENTENCE_END.split(s.text) if p.strip()]
    runs = [" ".join(parts[i:i + 2]) for i in range(max(len(parts) - 1, 1))] if parts else []
    return runs + ([f"{title}. {r}" for r in runs] if title else [])


def calibrated_floor(embedder_name: str) -> float | None:
    """The floor measured for an embedder (registry), or None."""
    from ragspec.models.registry import lookup

    entry = lookup(embedder_name, "embedder")
    floor = entry.extra.get("relevance_floor") if entry else None
    return float(floor) if floor is not None else None


@dataclass
class RelevanceGate:
    embedder: object  # ragspec.models.embedder.Embedder
    floor: float
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def score(self, question: str, sources) -> float:
        """The best cosine between the question and a window of a source (-1 with no text)."""
        texts = [w for s in sources for w in windows(s)]
        if not texts:
            return -1.0
        with self.lock:
            vecs = np.asarray(self.embedder.encode([question] + texts), dtype=np.float32)
        return float((vecs[1:] @ vecs[0]).max())

    def passes(self, score: float) -> bool:
        return score >= self.floor


def resolve_gate(setting, embedder_loader, embedder_name: str) -> RelevanceGate | None:
    """`prompt.relevance_floor` → a gate or None. `setting`: "off", "auto" or a cosine; `embedder_loader()` loads
    the embedder named `embedder_name` (called only when a gate is made)."""
    if setting is None or setting == "off":
        return None
    if setting == "auto":
        floor = calibrated_floor(embedder_name)
        if floor is None:
            return None
    else:
        try:
            floor = float(setting)
        except (TypeError, ValueError):
            raise RagspecError(f"prompt.relevance_floor must be auto, off or a cosine in [-1, 1], not {setting!r}") from None
    return RelevanceGate(embedder_loader(), floor)
