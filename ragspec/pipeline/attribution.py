"""Copied-span attribution: which stretches of the answer are verbatim copies of a source, and from where.

The answer is cut into words (`\\w+` runs and single punctuation marks) as it streams; a greedy left-to-right
matcher keeps, for the current run of answer words, every source position where that run occurs verbatim
(never across two sources). When the next word breaks every such occurrence the run closes, and if it is long
enough (`min_words` words, or `min_chars` characters for one long rare word) it becomes a citation at once.
If a later start inside the run continues with the breaking word, the run's tail moves to that match (when
that loses no qualifying words), so a quote's first words are not glued to the end of the previous one.
Whether a span counts as copied does not depend on the drafter: every span is found by the matcher, drafted or
not. When the same words occur in several sources the choice waits for the next citation, then (rule
`context`, the default) takes the source whose words around the occurrence share the most words with the
answer's own words around the span (those no citation explains), else the next citation's source (if that
one is ambiguous too, the sources the two share), else the previous citation's, else the source the accepted
draft tokens were copied from, else the best-ranked. (`neighbours`, the rule before: the same without the
context and the shared sources. The drafter only breaks the last ties: the trie's occurrence choice is
frequency-ranked, not source-aware.) On the 5 QuoteSum folds at 3 words / 10 chars, `context` moved
attribution precision per fold by 0, -.004, +.007, 0, +.003 (2 spans fixed, 1 broken; docs/evaluation.md).

Offsets: `start`/`end` index the document, and `document_text[start:end] == quote` exactly. A source found in
several places (copies of one paragraph, chunks contained in it) gives each citation every location whose text
holds the quote's words in order, the source's own first, each with its own exact slice. The answer's span
`answer_text[answer_start:answer_end]` has the same words and punctuation; only whitespace between them may
differ (a line break in the source can be a space in the answer).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from ragspec.pipeline.prompt import SourceText

WORD = re.compile(r"\w+|[^\w\s]")
OPENERS = set("([{<«“‘\"'")
# how a run whose words occur in several sources picks one (see CopyMatcher._resolve)
DISAMBIGUATIONS = ("neighbours", "context", "neighbours-context")
CONTEXT_WORDS = 12  # answer words each side of an ambiguous span compared with each source around it


@dataclass
class Citation:
    source: int  # the source number shown to the model
    path: str
    start: int  # character offsets into the document
    end: int
    quote: str  # document_text[start:end]
    answer_start: int  # character offsets into the answer text
    answer_end: int
    key: str = ""  # JSON record id for record-style documents
    # every place the quote is found, this one first: {"path", "key", "start", "end", "quote", "document_id"}
    locations: list = field(default_factory=list)

    def as_json(self) -> dict:
        return asdict(self)


def word_span(text: str, words: list[str]) -> tuple[int, int] | None:
    """(start, end) of the first place in `text` where `words` occur in order with only whitespace between."""
    found = [(m.group(), m.start(), m.end()) for m in WORD.finditer(text)]
    tokens = [w for w, _, _ in found]
    n = len(words)
    for i in range(len(tokens) - n + 1):
        if tokens[i:i + n] == words:
            return found[i][1], found[i + n - 1][2]
    return None


def quote_locations(src: SourceText, c0: int, c1: int) -> list[dict]:
    """The quote `src.text[c0:c1]` in every location of its source that holds it (the source's own first)."""
    quote = src.text[c0:c1]
    out = [{"path": src.path, "key": src.key, "start": src.document_offset(c0), "end": src.document_offset(c1),
            "quote": quote,
            "document_id": src.document_id}]
    words = WORD.findall(quote)
    for loc in src.locations[1:]:
        span = word_span(loc.text, words)
        if span is not None and not any(o["document_id"] == loc.document_id and o["start"] == loc.start + span[0]
                                        for o in out):
            a, b = span
            out.append({"path": loc.path, "key": loc.key, "start": loc.start + a, "end": loc.start + b,
                        "quote": loc.text[a:b], "document_id": loc.document_id})
    return out


class CopyMatcher:
    """Feed it the answer text as it grows; it returns citations as their spans close."""

    def __init__(self, sources: list[SourceText], min_words: int = 3, min_chars: int = 12,
                 disambiguation: str = "context", chars_one_word: bool = False, question: str | None = None):
        """`min_words` words make a run a citation, or `min_chars` characters (with `chars_one_word`, only a
        run of one word qualifies that way: a long rare name, not two short common words). With `question`,
        a run the question holds word for word (case aside) is no citation: it restates the question."""
        if disambiguation not in DISAMBIGUATIONS:
            raise ValueError(f"disambiguation must be one of {DISAMBIGUATIONS}, not {disambiguation!r}")
        self.disambiguation = disambiguation
        self.sources = {s.number: s for s in sources}
        self.min_words, self.min_chars, self.chars_one_word = min_words, min_chars, chars_one_word
        self.question = [w.lower() for w in WORD.findall(question)] if question else []
        self.emitting: tuple[int, int] | None = None  # answer span of the run being cited (context excludes it)
        self.words: list[str | None] = []  # context words; None separates sources
        self.where: list[tuple[int, int, int]] = []  # (source number, char start, char end) per context word
        self.positions: dict[str, list[int]] = defaultdict(list)
        for s in sources:
            for t0, t1, _ in s.text_pieces():  # a cut source's pieces: no run crosses an elision mark
                for m in WORD.finditer(s.text, t0, t1):
                    self.positions[m.group()].append(len(self.words))
                    self.words.append(m.group())
                    self.where.append((s.number, m.start(), m.end()))
                self.words.append(None)
                self.where.append((0, 0, 0))
        self.hints: dict[int, list[int]] = defaultdict(list)  # source → sorted char offsets drafts came from
        self.text = ""
        self.scanned = 0  # answer characters already cut into words
        self.run: list[tuple[int, int]] = []  # answer (start, end) of the current run's words
        self.cands: list[int] = []  # context word positions where the current run starts
        self.last_source = 0
        self.pending = None  # an ambiguous citation waiting for the next one
        self.citations: list[Citation] = []

    def hint(self, source: int, char: int) -> None:
        """An accepted draft token was copied from `char` in source `source`."""
        bisect.insort(self.hints[source], char)

    def feed(self, text: str) -> list[Citation]:
        """Append answer text; return the citations whose spans closed."""
        self.text += text
        return self._scan(final=False)

    def finish(self) -> list[Citation]:
        out = self._scan(final=True)
        out += self._close()
        return out

    # -- matching ------------------------------------------------------------------------------------------
    def _scan(self, final: bool) -> list[Citation]:
        out = []
        for m in WORD.finditer(self.text, self.scanned):
            if not final and m.end() == len(self.text) and m.group()[-1:].isalnum():
                break  # a word still being written
            out += self._word(m.group(), m.start(), m.end())
            self.scanned = m.end()
        return out

    def _word(self, w: str, a: int, b: int) -> list[Citation]:
        out = []
        if self.run:
            k = len(self.run)
            nxt = [p for p in self.cands if self.words[p + k] == w]
            if nxt:
                self.cands = nxt
                self.run.append((a, b))
                return out
            j, cands = self._back_off(w)
            if j:
                # a later start inside the run continues with `w`: the run's tail belongs to that match
                head, self.run = self.run[:j], self.run[j:] + [(a, b)]
                out = self._emit(head, self.cands) if self._qualifies(head) else []
                self.cands = cands
                return out
            out = self._emit(self.run, self.cands) if self._qualifies(self.run) else []
        self.cands = list(self.positions.get(w, ()))
        self.run = [(a, b)] if self.cands else []
        return out

    def _back_off(self, w: str) -> tuple[int, list[int]]:
        """The first j such that run[j:] + [w] occurs in one source, when taking it loses nothing: j == 1
        (the new run is already as long as the old), or the old run's head run[:j] qualifies on its own."""
        words = [self.text[a:b] for a, b in self.run] + [w]
        for j in range(1, len(self.run)):
            if j > 1 and not self._qualifies(self.run[:j]):
                continue
            cands = [p for p in self.positions.get(words[j], ())
                     if all(self.words[p + i] == words[j + i] for i in range(1, len(words) - j))]
            if cands:
                return j, cands
        return 0, []

    def _is_word(self, a: int) -> bool:
        return self.text[a].isalnum() or self.text[a] == "_"

    def _qualifies(self, run: list[tuple[int, int]]) -> bool:
        lead = next((i for i, (a, _) in enumerate(run) if self._is_word(a)), len(run))
        run = run[lead:]
        if not run:
            return False
        words = sum(1 for a, _ in run if self._is_word(a))
        if words >= self.min_words:
            return True
        return (words == 1 or not self.chars_one_word) and run[-1][1] - run[0][0] >= self.min_chars

    def _close(self) -> list[Citation]:
        run, cands = self.run, self.cands
        self.run, self.cands = [], []
        out = self._emit(run, cands) if run and self._qualifies(run) else []
        return out + self._resolve(None)

    def _emit(self, run: list[tuple[int, int]], cands: list[int]) -> list[Citation]:
        """Cite a qualifying run. When its words occur in several sources the choice waits for the next
        citation (see `_resolve`)."""
        lead = next(i for i, (a, _) in enumerate(run) if self._is_word(a))  # a quote starts at a word
        run, cands = run[lead:], [p + lead for p in cands]
        while self.text[run[-1][0]] in OPENERS:  # … and does not end by opening a bracket or quote
            run = run[:-1]
        if self.question and self._in_question(run):
            return []
        by_source: dict[int, int] = {}
        drafted: dict[int, int] = {}
        for p in cands:
            by_source.setdefault(self.where[p][0], p)
            if self._drafted(p, len(run)):
                drafted.setdefault(self.where[p][0], p)
        self.emitting = (run[0][0], run[-1][1])
        if len(by_source) == 1:
            out = self._resolve(next(iter(by_source))) + [self._cite(run, next(iter(by_source.values())))]
        else:
            out = self._resolve(set(by_source))
            self.pending = (run, by_source, drafted)
        self.emitting = None
        return out

    def _in_question(self, run: list[tuple[int, int]]) -> bool:
        words = [self.text[a:b].lower() for a, b in run]
        while words and not words[-1][0].isalnum():  # a closing full stop or comma is no part of the match
            words.pop()
        n, q = len(words), self.question
        return n > 0 and any(q[i:i + n] == words for i in range(len(q) - n + 1))

    def _resolve(self, next_source: int | set | None) -> list[Citation]:
        """Settle a pending ambiguous citation. `neighbours`: the next citation's source, else the previous
        one's (quotes come in runs from one source), else the source the drafts copied, else the best-ranked.
        `context`: first the source whose words around the occurrence share the most words with the answer
        around the span (`_context`), then as `neighbours`. `neighbours-context`: the neighbours first, the
        context before the drafts. Both newer rules, when the next citation is itself ambiguous (`next_source`
        is then its set of sources), keep only the sources the two share, if any."""
        if self.pending is None:
            return []
        run, by_source, drafted = self.pending
        self.pending = None
        if isinstance(next_source, set):  # the next citation is ambiguous too
            shared = next_source & set(by_source)
            next_source = None
            if shared and self.disambiguation != "neighbours":  # the sources both may come from
                by_source = {s: p for s, p in by_source.items() if s in shared}
                if len(by_source) == 1:
                    return [self._cite(run, next(iter(by_source.values())))]
        if self.disambiguation == "context":
            by_source = self._best_context(run, by_source)
            if len(by_source) == 1:
                return [self._cite(run, next(iter(by_source.values())))]
        for s in (next_source, self.last_source):
            if s in by_source:
                return [self._cite(run, by_source[s])]
        if self.disambiguation == "neighbours-context":
            by_source = self._best_context(run, by_source)
            if len(by_source) == 1:
                return [self._cite(run, next(iter(by_source.values())))]
        drafted = {s: p for s, p in drafted.items() if s in by_source}
        if drafted:
            return [self._cite(run, next(iter(drafted.values())))]
        return [self._cite(run, by_source[min(by_source)])]

    def _best_context(self, run: list[tuple[int, int]], by_source: dict[int, int]) -> dict[int, int]:
        """The tied sources whose context scores highest (all of them when none scores above the rest)."""
        scores = {s: self._context(run, p) for s, p in by_source.items()}
        best = max(scores.values())
        return {s: p for s, p in by_source.items() if scores[s] == best}

    def _context(self, run: list[tuple[int, int]], p: int) -> int:
        """How many distinct words (lower-cased, punctuation aside) of the answer's CONTEXT_WORDS words before and
        after the span (those written so far, outside every citation: the words the answer wrote around its
        quotes) occur in the CONTEXT_WORDS words before and after the
        occurrence at context position p, in its source. The span's own words are the same in every source,
        so this is the evidence the words around it give."""
        n = CONTEXT_WORDS
        cited = [(c.answer_start, c.answer_end) for c in self.citations] + ([self.emitting] if self.emitting else [])

        def free(m) -> bool:  # a word no citation explains (a quote's own words are the neighbours' evidence)
            return m.group()[0].isalnum() and not any(a <= m.start() < b for a, b in cited)

        before = [m.group() for m in WORD.finditer(self.text[: run[0][0]]) if free(m)][-n:]
        after = [m.group() for m in WORD.finditer(self.text, run[-1][1], self.scanned) if free(m)][:n]
        answer = {w.lower() for w in before + after}
        near = set()
        for walk in (range(p - 1, max(p - n, 0) - 1, -1), range(p + len(run), min(p + len(run) + n, len(self.words)))):
            for q in walk:
                if self.words[q] is None:  # the end of the source
                    break
                near.add(self.words[q].lower())
        return len(answer & near)

    def _cite(self, run: list[tuple[int, int]], p: int) -> Citation:
        num, c0, _ = self.where[p]
        _, _, c1 = self.where[p + len(run) - 1]
        src = self.sources[num]
        cit = Citation(num, src.path, src.document_offset(c0), src.document_offset(c1), src.text[c0:c1], run[0][0],
                       run[-1][1], src.key,
                       quote_locations(src, c0, c1))
        self.last_source = num
        self.citations.append(cit)
        return cit

    def _drafted(self, p: int, length: int) -> bool:
        num, c0, _ = self.where[p]
        c1 = self.where[p + length - 1][2]
        hs = self.hints.get(num)
        if not hs:
            return False
        i = bisect.bisect_left(hs, c0 - 1)  # a token's offset may include the space before a word
        return i < len(hs) and hs[i] < c1
