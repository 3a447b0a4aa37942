"""The copy matcher: exact document offsets, streaming in any pieces gives the same citations, ties, limits;
QuoteSum markup parsing and teacher-forced provenance."""

from __future__ import annotations

import random
import re

from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.eval.attribution import Prepared, cross_validate, fold_of, strip_markup, teacher_forced_sources
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


# -- words shared by two sources ------------------------------------------------------------------------------
CURIE_1 = "Marie Curie was born in Warsaw in 1867. She won the Nobel Prize in Physics in 1903."
CURIE_2 = "Pierre Curie shared with his wife the Nobel Prize in Physics for research on radiation phenomena."
CURIE_ANSWER = "Marie Curie was born in Warsaw. Her husband got the Nobel Prize in Physics, for his radiation research."


def test_context_disambiguates_words_found_in_two_sources():
    # "the Nobel Prize in Physics" is in both sources, no citation follows it, the previous one is source 1;
    # the answer's words around it ("husband", "his", "radiation", "research", ...) are source 2's
    srcs = [SourceText(1, CURIE_1, path="1"), SourceText(2, CURIE_2, path="2")]
    got = {}
    for rule in ("neighbours", "context", "neighbours-context"):
        m = CopyMatcher(srcs, disambiguation=rule)
        m.feed(CURIE_ANSWER)
        m.finish()
        got[rule] = [(c.quote, c.source) for c in m.citations]
    assert got["neighbours"] == [("Marie Curie was born in Warsaw", 1), ("the Nobel Prize in Physics", 1)]
    assert got["context"] == [("Marie Curie was born in Warsaw", 1), ("the Nobel Prize in Physics", 2)]
    assert got["neighbours-context"] == got["neighbours"]  # the previous citation's source comes first there


def test_context_rule_streams_like_the_whole_text():
    srcs = [SourceText(1, CURIE_1, path="1"), SourceText(2, CURIE_2, path="2")]
    whole = CopyMatcher(srcs, disambiguation="context")
    whole.feed(CURIE_ANSWER)
    whole.finish()
    rng = random.Random(1)
    for _ in range(10):
        m = CopyMatcher(srcs, disambiguation="context")
        i = 0
        while i < len(CURIE_ANSWER):
            j = min(len(CURIE_ANSWER), i + rng.randint(1, 9))
            m.feed(CURIE_ANSWER[i:j])
            i = j
        m.finish()
        assert m.citations == whole.citations


# -- K-fold selection -----------------------------------------------------------------------------------------
def test_folds_are_deterministic_and_hold_each_record_out_once():
    folds = fold_of(23, 5)
    assert folds == fold_of(23, 5)
    assert sorted(set(folds)) == [0, 1, 2, 3, 4]
    assert len(folds) == 23  # one fold per record: each record is held out exactly once
    assert [folds.count(f) for f in range(5)] == [5, 5, 5, 4, 4]


def _prepared(summary: str, gold: list[tuple[str, int]], srcs: list[SourceText]) -> Prepared:
    spans = [(summary.index(q), summary.index(q) + len(q), k) for q, k in gold]
    return Prepared(summary, spans, srcs, [], [(m.start(), m.end()) for m in re.finditer(r"\S+", summary)])


SEINE = [SourceText(1, "The Seine river flows through Paris and then north to the sea.", path="1")]
# a two-word copy the annotator marked (rewards min_words 2) / one they did not (punishes it)
MARKED = _prepared("Paris lies on the Seine river, a fact.", [("Seine river", 1)], SEINE)
UNMARKED = _prepared("A Seine river is long, a fact.", [], SEINE)
LONG = _prepared("It flows through Paris and so on.", [("flows through Paris and", 1)], SEINE)


def test_a_folds_setting_is_chosen_without_its_held_out_records():
    grid = [{"min_words": 2, "min_chars": 1000}, {"min_words": 3, "min_chars": 1000}]
    recs = [UNMARKED, MARKED, UNMARKED, UNMARKED, MARKED, UNMARKED]  # fold i % 3
    cv = cross_validate(recs, 3, grid)
    assert [f["records"] for f in cv["folds"]] == [2, 2, 2]
    chosen = [f["setting"] for f in cv["folds"]]
    # swap the records held out in fold 0 (records 0 and 3) for others: fold 0's choice stays, its score moves
    swapped = list(recs)
    swapped[0] = swapped[3] = MARKED
    cv2 = cross_validate(swapped, 3, grid)
    assert cv2["folds"][0]["setting"] == chosen[0]
    assert cv2["folds"][0]["attribution"] != cv["folds"][0]["attribution"]
    # the training folds do decide: only marked two-word copies to learn from, min_words 2 wins; long copies
    # and unmarked two-word ones, min_words 3
    assert cross_validate([MARKED] * 6, 3, grid)["folds"][0]["setting"] == grid[0]
    assert cross_validate([LONG, UNMARKED] * 3, 3, grid)["folds"][0]["setting"] == grid[1]
    assert set(cv["mean"]) == {"copied", "attribution"} and set(cv["spread"]["attribution"]["f1"]) == {"min", "max", "std"}


def test_chars_one_word_and_skip_question():
    srcs = [SourceText(1, "According to the report, Denitrification releases nitrogen gas.", path="1")]
    m = CopyMatcher(srcs, min_words=3, min_chars=10)
    m.feed("According to me, Denitrification happens.")
    m.finish()
    assert [c.quote for c in m.citations] == ["According to", "Denitrification"]
    m = CopyMatcher(srcs, min_words=3, min_chars=10, chars_one_word=True)  # two short words: no citation
    m.feed("According to me, Denitrification happens.")
    m.finish()
    assert [c.quote for c in m.citations] == ["Denitrification"]
    m = CopyMatcher(srcs, min_words=3, min_chars=10, question="What does denitrification release?")
    m.feed("According to me, Denitrification happens. It releases nitrogen gas.")
    m.finish()
    assert [c.quote for c in m.citations] == ["According to", "releases nitrogen gas."]


def test_worst_fold_criterion_counts_the_weakest_training_fold():
    from ragspec.eval.attribution import PRF, select

    # setting 0: perfect on group A, poor on group B; setting 1: good on both
    a, b = [0], [1]
    counts = [[(PRF(), PRF(10, 10, 10)), (PRF(), PRF(2, 10, 10))],
              [(PRF(), PRF(8, 8, 10)), (PRF(), PRF(8, 8, 10))]]
    assert select(counts, [a, b], 0.0, "pooled") == 1  # pooled F1: 0.60 vs 0.89
    counts[0][1] = (PRF(), PRF(7, 7, 10))
    assert select(counts, [a, b], 0.0, "pooled") == 0  # pooled F1: 0.92 vs 0.89
    assert select(counts, [a, b], 0.0, "worst-fold") == 1  # the weaker group's F1: 0.82 vs 0.89
