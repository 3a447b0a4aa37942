"""Source trimming: each source cut to the sentence windows that bear on the question, under a token budget.

Why: on a CPU most of an answer's wait is the model reading its prompt, and the prompt carries five whole chunks
though the answer usually sits in one or two of their sentences. This step keeps, over all sources, the
two-sentence windows the embedder scores closest to the question (the relevance gate's windows and their
embeddings, so nothing is embedded twice), best first, until the budget (`prompt.source_tokens`) is spent:
- every kept source first gets its best window (and more, up to `prompt.source_floor` tokens), in rank order; a
  budget smaller than one window still sends the best window of the best source;
- then a kept source's heading line (its first line, when it is one);
- then the remaining windows, best first, wherever they fit;
- a code block or a table is one unit: kept whole or not at all, never cut mid-row.

Every kept piece is a run of whole sentences and an exact slice of the source's text; the pipeline joins them
with an elision mark, maps every offset back to the document and never lets a citation cross a gap.

As a step (`SourceBudget`, `retrieve.steps`): it cuts by the window cosines the gate measured for the question,
or measures them itself (windows only) where no gate ran.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ragspec.corpus.windows import SENTENCE_END, sentence_spans, window_runs, window_texts

__all__ = ["ELISION", "SENTENCE_END", "BudgetFound", "SourceBudget", "SourceUnits", "block_spans",
           "cut_sources", "sentence_spans", "window_runs", "window_texts"]

ELISION = " … "  # between two kept pieces of one source in the prompt


# -- code blocks and tables ------------------------------------------------------------------------------------
_FENCE = re.compile(r"^\s*(```|~~~)")
_UNDERLINE = re.compile(r"^([=\-~^*#+])\1{2,}$")
_TABLE = re.compile(r"^\s*(\|.*\||\+[-=+]+\+|=+( +=+)+)\s*$")


def block_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the parts that must not be cut: fenced code, indented code (4 spaces or a tab, or an
    interactive session's `>>>` lines) and tables (`| a | b |`, reST grid and simple tables)."""
    out: list[tuple[int, int]] = []
    pos, fence, start = 0, False, None
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        code = fence or bool(_FENCE.match(body))
        if _FENCE.match(body):
            fence = not fence
        blocky = code or (body.strip() and (body.startswith(("    ", "\t")) or body.lstrip().startswith(">>>")
                                            or bool(_TABLE.match(body))))
        if blocky and start is None:
            start = pos
        elif not blocky and start is not None and (body.strip() or fence):
            out.append((start, pos))
            start = None
        pos += len(line)
    if start is not None:
        out.append((start, pos))
    stripped = []
    for a, b in out:  # without the whitespace around the block
        part = text[a:b]
        if part.strip():
            stripped.append((a + len(part) - len(part.lstrip()), b - (len(part) - len(part.rstrip()))))
    return stripped


def _is_heading(text: str, span: tuple[int, int]) -> bool:
    """A first sentence that is a heading: a Markdown `#` line, a line underlined in reST, or a short line with
    no closing punctuation followed by a line break."""
    a, b = span
    line = text[a:b]
    if "\n" in line or a != len(text) - len(text.lstrip()):
        return False
    if line.startswith("#"):
        return True
    rest = text[b:].lstrip(" \t")
    if rest.startswith("\n") or rest.startswith("\r"):
        nxt = rest.lstrip("\r\n").split("\n", 1)[0].strip()
        if nxt and len(set(nxt)) == 1 and nxt[0] in "=-~^*#+" and len(nxt) >= max(3, len(line) // 2):
            return True
        return len(line) <= 80 and line[-1:] not in ".!?;:,"
    return False


# -- the source as units ---------------------------------------------------------------------------------------
@dataclass
class SourceUnits:
    """A source cut into units (sentences; a code block or table is one unit) and its windows over them."""

    text: str
    units: list[tuple[int, int]]  # character spans, in order
    windows: list[set[int]]  # the units each window of the gate covers (window order = `window_texts` runs)
    heading: int | None  # the unit that is the source's heading line, if any

    @classmethod
    def of(cls, text: str) -> SourceUnits:
        spans = sentence_spans(text)
        blocks = block_spans(text)
        units: list[tuple[int, int]] = []
        unit_of: list[int] = []  # per sentence: its unit
        for k, (a, b) in enumerate(spans):
            block = next(((x, y) for x, y in blocks if a < y and x < b), None)
            if units and block is not None and units[-1][1] > block[0] and units[-1][0] < block[1]:
                units[-1] = (min(units[-1][0], a), max(units[-1][1], b))  # still inside the same block
            elif k == 1 and _UNDERLINE.match(text[a:b]) and block is None:
                units[-1] = (units[-1][0], b)  # a reST title's underline belongs to it
            else:
                units.append((a, b))
            unit_of.append(len(units) - 1)
        windows = [{unit_of[i], unit_of[j]} for i, j in window_runs(len(spans))]
        heading = 0 if spans and _is_heading(text, spans[0]) and units[0][0] == spans[0][0] else None
        return cls(text, units, windows, heading)


def cut_sources(sources: Sequence[SourceUnits], window_scores: Sequence[Sequence[float]], budget: int,
                count_tokens: Callable[[list[str]], list[int]], floor: int = 0) -> list[list[tuple[int, int]]]:
    """For each source (in rank order) the spans of its text to send, in order; [] drops it.

    `window_scores[i][w]`: the question's cosine with window w of source i; `budget`: tokens over all sources'
    kept text; `floor`: tokens each kept source is given at least (its best window when 0). Adjacent kept units
    form one span (with the text between them), so a source kept whole is one span over all its text."""
    texts = [s.text[a:b] for s in sources for a, b in s.units]
    counts = count_tokens(texts) if texts else []
    cost: list[list[int]] = []
    k = 0
    for s in sources:
        cost.append(list(counts[k:k + len(s.units)]))
        k += len(s.units)
    chosen: list[set[int]] = [set() for _ in sources]
    spent = 0

    def take(i: int, units: set[int], force: bool = False) -> bool:
        nonlocal spent
        new = units - chosen[i]
        extra = sum(cost[i][u] for u in new)
        if not force and spent + extra > budget:
            return False
        chosen[i] |= new
        spent += extra
        return True

    def ranked(i: int) -> list[int]:
        scores = window_scores[i]
        return sorted(range(len(sources[i].windows)), key=lambda w: -float(scores[w]) if w < len(scores) else 0.0)

    # every source its best window (and up to `floor` tokens), best-ranked first; the first source always
    for i, s in enumerate(sources):
        order = ranked(i)
        if not order:
            continue
        if not take(i, s.windows[order[0]], force=(i == 0)):
            continue
        for w in order[1:]:
            if sum(cost[i][u] for u in chosen[i]) >= floor:
                break
            take(i, s.windows[w])
    # a kept source's heading line comes along when it fits
    for i, s in enumerate(sources):
        if chosen[i] and s.heading is not None:
            take(i, {s.heading})
    # then every other window, best first, wherever it fits
    rest = sorted(((float(window_scores[i][w]), -i, w) for i, s in enumerate(sources) for w in range(len(s.windows))
                   if w < len(window_scores[i]) and chosen[i]), reverse=True)
    for _, neg_i, w in rest:
        take(-neg_i, sources[-neg_i].windows[w])
    return [_spans(s, chosen[i]) for i, s in enumerate(sources)]


def _spans(source: SourceUnits, chosen: set[int]) -> list[tuple[int, int]]:
    if not chosen:
        return []
    if len(chosen) == len(source.units):
        return [(0, len(source.text))]  # kept whole: the source's text as it was
    out: list[tuple[int, int]] = []
    last = -2
    for u in sorted(chosen):
        a, b = source.units[u]
        if u == last + 1 and out:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
        last = u
    return out


@dataclass
class BudgetFound:
    """What the budget did: its token count and how many sources it dropped."""

    budget: int
    dropped: int
    stop = False


@dataclass
class SourceBudget:
    """The step: sources cut to `budget` tokens of their best windows (`cut_sources`), renumbered in rank order.
    `count_tokens(texts)`: the generator's token count of each text; `floor`: `prompt.source_floor`. A source is
    cut with its `cut(spans)` (pipeline.prompt.SourceText)."""

    budget: int
    count_tokens: Callable[[list[str]], list[int]]
    floor: int = 0

    name = "budget"

    def run(self, query, sources) -> tuple[list, BudgetFound]:
        scores = query.measure(sources, wholes=False).windows
        spans = cut_sources([SourceUnits.of(s.text) for s in sources], scores, self.budget, self.count_tokens,
                            self.floor)
        kept = [s.cut(sp) for s, sp in zip(sources, spans) if sp]
        kept = [k if k.number == i else replace(k, number=i) for i, k in enumerate(kept, 1)]
        return kept, BudgetFound(self.budget, len(sources) - len(kept))
