"""The relevance gate, a step after retrieval: decline before generating when no source is about the question.

Why: a small generator told to decline "if none of the sources answers" cannot tell when to. Over CLAP NQ
records it was not tuned on, the log-probability Qwen2.5-0.5B gives the decline sentence separates answerable
from unanswerable questions with an AUC of 0.64, and a yes/no check turn 0.58; the embedder's cosine between
the question and the sources does it with 0.84-0.90. So the gate compares the question with every window of two
sentences of each source (pooled from the source's own forward) and each whole source (its text; `retrieve.windows`, which
reads the vectors the index stored and pools only the rest); the score is the mean of the best window's cosine
and the best whole source's. Under the floor it answers `DECLINED`
without running the model, and otherwise asks for an answer without offering to decline (docs/evaluation.md, *Declining*).
Both parts, because each fails where the other holds: a retrieved chunk often holds several topics and its
whole cosine drops (0.35 for a river chunk that says what barges carry on the Rhine, 0.72 for its window),
while a passage from the right page that lacks the asked fact often has one window close to the question's
words. On the tuning records (CLAP NQ 151-300) the window alone separates with AUC 0.86, the whole passage
0.88, their mean 0.90 (held out, CLAP NQ 1-150: 0.84, 0.90, 0.90), measured with windows embedded alone; pooled,
the mean separates with 0.89 (held out 0.91).

A request that is a task on the sources rather than a question about them ("Summarise the notes.", "Translate
this passage") is not gated: it scores low against any source and would be declined (`is_task_on_sources`).

Just over the floor the score is least sure. `prompt.relevance_doubt` sets a band there in which the model
is offered to decline and decides itself, so the generator adds its own judgement where the embedder's is
weakest. The band is measured per generator and embedder (the generator's registry entry, `relevance_band`):
with `relevance_floor: auto` and `relevance_doubt: auto` (the defaults) a generator that has one uses its floor
and its band, and any other uses the embedder's floor alone. A generator that reads its prompts with a second
weight copy (dtype gguf's int8 copy, where the CPU has int8 units) judges the band's questions a little
differently, so its entry may hold a band for that copy (`relevance_band_with_copy`), chosen the same way.

The floor belongs to an embedder (cosines are not comparable across models): `auto` takes the one measured for
it (the registry entry's `relevance_floor`), and an embedder with none leaves the gate off.

As a step (`retrieve.steps`): `run(query, sources)` passes the sources on unchanged with what it found (the
score, whether it declines, whether the score is in the unsure band); a decline ends the chain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ragspec.retrieve.windows import Measured, WindowScorer
from ragspec.settings import parse_floor

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


def calibrated_floor(embedder_name: str) -> float | None:
    """The floor measured for an embedder (registry), or None."""
    from ragspec.models.registry import lookup

    entry = lookup(embedder_name, "embedder")
    floor = entry.extra.get("relevance_floor") if entry else None
    return float(floor) if floor is not None else None


@dataclass
class GateFound:
    """What the gate found: its score (None on a follow-up it did not measure), whether it declines, and whether
    a passing score is in the unsure band (the model is then offered to decline)."""

    score: float | None
    declined: bool = False
    unsure: bool = False

    @property
    def stop(self) -> bool:
        return self.declined


@dataclass
class RelevanceGate:
    embedder: object  # ragspec.models.embedder.Embedder
    floor: float
    doubt: float | None = None  # from the floor up to this score the model is offered to decline
    scorer: WindowScorer | None = field(default=None, repr=False)  # default: this embedder, no stored vectors

    name = "gate"

    def __post_init__(self):
        if self.scorer is None:
            embedder = self.embedder
            self.scorer = WindowScorer(lambda: embedder)

    def score(self, question: str, sources) -> float:
        """The mean of the best cosine between the question and a window of a source and the best between the
        question and a whole source (-1 with no text). Each distinct text is embedded once."""
        return self.measure(question, sources).score

    def measure(self, question: str, sources, wholes: bool = True) -> Measured:
        """The score, and each source's window cosines (what the source budget cuts by), from one embedding
        call. `wholes=False`: windows only (no score), when only the budget needs them."""
        return self.scorer.measure(question, sources, wholes)

    def passes(self, score: float) -> bool:
        return score >= self.floor

    def unsure(self, score: float) -> bool:
        """A passing score under `doubt`: the model, offered to decline, decides."""
        return self.doubt is not None and self.floor <= score < self.doubt

    def run(self, query, sources) -> tuple[list, GateFound]:
        """The step: a conversation's first question is judged (and declined under the floor); a follow-up keeps
        that turn's verdict, and is measured only to know whether it was unsure (with a band)."""
        if query.follow_up and self.doubt is None:
            return sources, GateFound(None)
        score = query.measure(sources, wholes=True).score
        return sources, GateFound(score, not query.follow_up and not self.passes(score), self.unsure(score))


def measured_band(generator_name: str | None, embedder_name: str,
                  copy: str | None = None) -> tuple[float, float] | None:
    """The (floor, doubt) measured for a generator with an embedder (registry), or None. `copy`: the weight copy
    the generator reads prompts with ("int8"; `decoding.prompt_mode.prompt_copy`), whose own band wins where
    one was measured."""
    from ragspec.models.registry import generator_entry

    entry = generator_entry(generator_name) if generator_name else None
    if entry is None:
        return None
    key = embedder_name.lower()
    with_copy = ((entry.extra.get("relevance_band_with_copy") or {}).get(copy) or {}) if copy else {}
    band = with_copy.get(key) or (entry.extra.get("relevance_band") or {}).get(key)
    return (float(band[0]), float(band[1])) if band else None


def resolve_gate(setting, embedder_loader, embedder_name: str, doubt="auto",
                 generator_name: str | None = None, scorer: WindowScorer | None = None,
                 copy: str | None = None) -> RelevanceGate | None:
    """`prompt.relevance_floor` → a gate or None. `setting`: "off", "auto" or a cosine; `embedder_loader()` loads
    the embedder named `embedder_name` (called only when a gate is made); `doubt`: `prompt.relevance_doubt`.

    Both `auto` take the band measured for this generator with this embedder where there is one (its floor and
    its doubt were chosen together), else the embedder's floor with no band. With only one of them `auto`, the
    measured band is not used: an `auto` floor is the embedder's, an `auto` doubt is no band. `scorer`: what
    measures (default: the embedder alone, no stored vectors); `copy`: the generator's prompt copy, if any."""
    if setting is None:
        return None
    floor = parse_floor(setting)
    if floor == "off":
        return None
    band = measured_band(generator_name, embedder_name, copy) if floor == "auto" and doubt == "auto" else None
    if doubt == "auto":
        doubt = band[1] if band else None
    if floor == "auto":
        floor = band[0] if band else calibrated_floor(embedder_name)
        if floor is None:
            return None
    return RelevanceGate(embedder_loader(), floor, doubt, scorer)
