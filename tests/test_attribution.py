"""The copy matcher: exact document offsets, streaming in any pieces gives the same citations, ties, limits;
QuoteSum markup parsing and teacher-forced provenance."""

from __future__ import annotations

import random

from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.eval.attribution import strip_markup, teacher_forced_sources
from ragspec.pipeline.attribution import CopyMatcher
from ragspec.pipeline.prompt import SourceText

DOC_A = "Intro line.\nThe Danube flows through ten countries,\nmore than any other river in the world. It ends."
DOC_B = "Bread: knead the dough for ten minutes until it is smooth. The state legislature met in Oklahoma City."
DOC_C = "Elsewhere. The state legislature met in Oklahoma City in special session."


def sources() -> list[SourceText]:
    a0 = DOC_A.index("The Danube")
    return [
        SourceText(1, DOC_A[a0:], path="a.txt", start=a0),
        SourceText(2, DOC_B, path="b.txt"),
        SourceText(3, DOC_C, path="c.txt"),
    ]


DOCS = {"a.txt": DOC_A, "b.txt": DOC_B, "c.txt": DOC_C}
ANSWER = ("It flows through ten countries, more than any other river in the world. You should knead the dough "
          "for ten minutes. Nothing else.")


def test_quotes_slice_the_documents_exactly():
    m = CopyMatcher(sources())
    m.feed(ANSWER)
    m.finish()
    cites = m.citations
    assert [c.source for c in cites] == [1, 2]
    for c in cites:
        assert DOCS[c.path][c.start : c.end] == c.quote
        # the answer span has the same words; only whitespace may differ
        assert ANSWER[c.answer_start : c.answer_end].split() == c.quote.split()
    assert cites[0].quote == "flows through ten countries,\nmore than any other river in the world."
    assert cites[1].quote == "knead the dough for ten minutes"


def test_streaming_in_random_pieces_gives_the_same_citations():
    whole = CopyMatcher(sources())
    whole.feed(ANSWER)
    whole.finish()
    rng = random.Random(0)
    for _ in range(20):
        m = CopyMatcher(sources())
        streamed = []
        i = 0
        while i < len(ANSWER):
            j = min(len(ANSWER), i + rng.randint(1, 7))
            streamed += m.feed(ANSWER[i:j])
            i = j
        streamed += m.finish()
        assert streamed == whole.citations


def test_short_common_runs_are_not_citations():
    m = CopyMatcher(sources(), min_words=3, min_chars=10)
    m.feed("Is it the world?")
    assert m.finish() == []


def test_ambiguous_span_follows_the_next_citation_source():
    # "The state legislature met in Oklahoma City" is in sources 2 and 3; the words after it only in 3
    m = CopyMatcher(sources())
    m.feed("The state legislature met in Oklahoma City, later in special session.")
    m.finish()
    assert [c.source for c in m.citations] == [3, 3]
    m = CopyMatcher(sources())
    m.feed("The state legislature met in Oklahoma City, they said.")
    m.finish()
    assert [c.source for c in m.citations] == [2]  # no other evidence: the best-ranked source


def test_drafted_occurrence_breaks_a_remaining_tie():
    srcs = sources()
    m = CopyMatcher(srcs)
    m.hint(3, DOC_C.index("The state legislature"))
    m.feed("The state legislature met in Oklahoma City, they said.")
    m.finish()
    assert [c.source for c in m.citations] == [3]


def test_strip_quotesum_markup():
    text, spans = strip_markup("[ 2 Denitrification ] releases gas. It [ 1 can lead to isotopic fractionation. ]")
    assert text == "Denitrification releases gas. It can lead to isotopic fractionation."
    assert [(text[s:e], k) for s, e, k in spans] == [("Denitrification", 2), ("can lead to isotopic fractionation.", 1)]


def test_teacher_forced_provenance_points_at_equal_tokens():
    prompt = [5, 6, 7, 8, 9, 10, 11, 1, 2]
    answer = [7, 8, 9, 10, 3, 4]
    src = teacher_forced_sources(PromptLookupDrafter(num_tokens=4, max_ngram=1), prompt, answer, [])
    assert len(src) == len(answer)
    for tok, p in zip(answer, src):
        assert p == -1 or prompt[p] == tok
    assert src[1:4] == [3, 4, 5]  # after the first (model-made) 7, the drafts copy 8 9 10 from the prompt
