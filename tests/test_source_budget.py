"""The source budget (`prompt.source_tokens`): sources cut to the sentence windows that bear on the question.

Every kept piece is an exact slice of its document, for random documents and questions; a citation of an answer
copied from a cut source slices the document exactly and never crosses a gap; `off` (and a budget larger than
the sources) gives today's prompt token for token; a budget smaller than one window still sends the best window
of the best source; a code block or a table is kept whole or not at all; bad values are one clear line. Real
parts: MiniLM, SmolLM2's tokenizer and model, a built index."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ragspec.corpus.windows import window_spans
from ragspec.errors import RagspecError
from ragspec.pipeline.attribution import CopyMatcher
from ragspec.pipeline.prompt import SourceText
from ragspec.retrieve.trim import ELISION, SourceUnits, block_spans, cut_sources, window_runs, window_texts
from ragspec.settings import parse_source_tokens

SMOL = "smollm2-135m-instruct"
_GATE_SPLIT = re.compile(r"(?<=[.!?;])\s+|\n+")


def gate_windows_before(text: str, title: str) -> list[str]:
    """The relevance gate's windows as it computed them before the budget shared its split."""
    parts = [p.strip() for p in _GATE_SPLIT.split(text) if p.strip()]
    runs = [" ".join(parts[i:i + 2]) for i in range(max(len(parts) - 1, 1))] if parts else []
    return runs + ([f"{title}. {r}" for r in runs] if title else [])


words = st.sampled_from("the river open file mode append rises flows sea forest Danube write end 42 x_y é".split())
sentence = st.lists(words, min_size=1, max_size=8).map(" ".join).flatmap(
    lambda s: st.sampled_from([".", "!", "?", ";", ""]).map(lambda p: s + p))
code = st.lists(words, min_size=1, max_size=4).map(lambda w: "    " + " ".join(w) + "()")
table = st.lists(words, min_size=2, max_size=3).map(lambda w: "| " + " | ".join(w) + " |")
blocks = st.one_of(
    st.lists(sentence, min_size=1, max_size=4).map(" ".join),
    st.lists(code, min_size=1, max_size=3).map(lambda ls: "Example::\n\n" + "\n".join(ls)),
    st.lists(table, min_size=2, max_size=3).map("\n".join),
)
documents = st.lists(blocks, min_size=1, max_size=6).flatmap(
    lambda bs: st.sampled_from(["\n\n", "\n", " "]).map(lambda sep: sep.join(bs)))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab .!?;\n\t", max_size=40))
def test_the_budget_scores_the_gates_own_windows(text):
    assert window_texts(text) == gate_windows_before(text, "")
    spans = window_spans(text)  # what a window's vector is pooled over: from its first sentence to its last
    assert len(spans) == len(window_texts(text))
    for (a, b), w in zip(spans, window_texts(text)):
        assert text[a:b].split() == w.split()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=documents, prefix=st.text(alphabet="xyz \n", max_size=20), data=st.data())
def test_every_kept_piece_is_an_exact_slice_of_its_document(doc, prefix, data):
    """Random documents (prose, indented code, tables), random window scores and budgets."""
    document = prefix + doc + "\nTail."
    start, end = len(prefix), len(prefix) + len(doc)
    src = SourceText(1, document[start:end], "d.txt", start, end)
    units = SourceUnits.of(src.text)
    n = len(units.windows)
    scores = [data.draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n))]
    budget = data.draw(st.integers(1, 120))
    spans = cut_sources([units], scores, budget, lambda ts: [len(t.split()) for t in ts])[0]
    assert spans, "the best source always sends something"
    assert all(a < b for a, b in spans) and all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(spans))
    for a, b in block_spans(src.text):  # a code block or table: whole or not at all
        inside = [(x, y) for x, y in spans if x < b and a < y]
        assert not inside or any(x <= a and b <= y for x, y in inside), (src.text[a:b], spans)
    cut = src.cut(spans)
    assert cut.text == ELISION.join(src.text[a:b] for a, b in spans)
    for t0, t1, d in cut.text_pieces():
        assert document[d:d + t1 - t0] == cut.text[t0:t1]
        for c in range(t0, t1 + 1):
            assert document[cut.document_offset(c):cut.document_offset(t1)] == cut.text[c:t1]
    if spans == [(0, len(src.text))]:
        assert cut is src and not cut.pieces


def test_a_budget_smaller_than_a_window_sends_the_best_window_of_the_best_source():
    text = "Rivers flow. The Danube rises in the Black Forest. It ends in the Black Sea. Bread is baked."
    units = SourceUnits.of(text)
    best = 1  # the window "The Danube rises … It ends …"
    scores = [[0.1, 0.9, 0.2], [0.95, 0.1, 0.1]]
    spans = cut_sources([units, units], scores, 1, lambda ts: [len(t) for t in ts])
    first, second = spans
    assert [text[a:b] for a, b in first] == [" ".join(text[a:b] for a, b in
                                                      (units.units[u] for u in sorted(units.windows[best])))]
    assert second == []  # the budget is spent: the second source is dropped, not cut to nothing
    assert window_runs(1) == [(0, 0)] and window_runs(0) == []


def test_a_code_block_and_a_table_are_units():
    text = ("Use it like this::\n\n    with open(f) as fh:\n        fh.write(x)\n\nThen it is closed.\n\n"
            "| mode | meaning |\n| a | append |\n\nThat is all.")
    units = SourceUnits.of(text)
    kept = [text[a:b] for a, b in units.units]
    assert "with open(f) as fh:\n        fh.write(x)" in kept
    assert "| mode | meaning |\n| a | append |" in kept


def test_a_heading_comes_along_with_its_source():
    text = "Built-in Functions\n==================\n\nA sentence here. The answer is 42. Other text follows."
    units = SourceUnits.of(text)
    assert units.heading == 0 and text[slice(*units.units[0])] == "Built-in Functions\n=================="
    spans = cut_sources([units], [[0.0, 0.0, 0.9, 0.1]], 12, lambda ts: [len(t.split()) for t in ts])[0]
    kept = [text[a:b] for a, b in spans]
    assert kept[0].startswith("Built-in Functions") and any("42" in k for k in kept)


def test_citations_of_a_cut_source_slice_the_document_and_never_cross_a_gap():
    document = ("Intro line. The Danube rises in the Black Forest in Germany. Unrelated middle sentence here. "
                "It empties into the Black Sea after ten countries. Outro.")
    src = SourceText(1, document, "rivers.txt", 0, len(document))
    a = document.index("The Danube")
    b = document.index("Unrelated")
    c = document.index("It empties")
    d = document.index("Outro")
    cut = src.cut([(a, b - 1), (c, d - 1)])
    assert cut.pieces == [(a, b - 1), (c, d - 1)] and ELISION in cut.text
    m = CopyMatcher([cut])
    answer = ("The Danube rises in the Black Forest in Germany. It empties into the Black Sea after ten "
              "countries.")
    m.feed(answer)
    cites = m.finish()
    assert cites, "copied spans are cited"
    for ci in cites:
        assert document[ci.start:ci.end] == ci.quote
        assert ci.locations[0]["start"] == ci.start and document[ci.start:ci.end] == ci.locations[0]["quote"]
        assert not (ci.start < b - 1 and ci.end > c), "a citation crossed the elision"
    # words that join across the gap ("Germany. It empties") exist in the prompt text only through the mark
    m = CopyMatcher([cut])
    m.feed("in Germany. It empties into")
    assert all(document[ci.start:ci.end] == ci.quote for ci in m.finish())


def test_auto_takes_the_budget_measured_for_the_generator():
    """`auto` (the default) is the registry's measured budget: 256 for the 0.5B, 384 for the default 1.5B's
    retrieved sources, none (whole sources) for a generator nobody measured; `off` and a number override it."""
    from ragspec.pipeline import Pipeline

    qwen = {"model": "qwen2.5-coder-0.5b-instruct"}
    assert Pipeline({"generator": qwen}).source_budget == 256
    assert Pipeline({"generator": qwen, "prompt": {"source_tokens": "off"}}).source_budget is None
    assert Pipeline({"generator": qwen, "prompt": {"source_tokens": 512}}).source_budget == 512
    assert Pipeline({"generator": {"model": SMOL}}).source_budget is None
    # the 1.5B: its budget measured on retrieved sources only; passages given to the ask go whole
    default = Pipeline({})
    assert default.source_budget == 384 == default.resolve_source_budget(retrieved=True)
    assert default.resolve_source_budget(retrieved=False) is None and default.resolve_source_budget(512, False) == 512
    assert Pipeline({"generator": qwen}).resolve_source_budget(retrieved=False) == 256  # the 0.5B's holds for both


def test_bad_values_are_one_clear_line():
    from ragspec.spec import load_spec

    for bad in (0, -5, "lots", 1.5, True):
        with pytest.raises(RagspecError, match=r"source_tokens must be auto, off or a number of tokens"):
            load_spec({"prompt": {"source_tokens": bad}})
    assert parse_source_tokens("OFF") == "off" and parse_source_tokens("512") == 512
    from ragspec.cli import app

    for args in (["ask", "q", "--index", "nowhere", "--source-tokens", "lots"],
                 ["eval-answers", "--data", "x", "--format", "nq", "--source-tokens", "0"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "--source-tokens must be auto, off or a number of tokens" in r.output, r.output
        assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1, r.output


# -- with real models --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe(tmp_path_factory, embedder):
    from serve_util import SPEC, build_test_index, make_pipeline

    from ragspec.models.generator import load_generator

    index_path = build_test_index(tmp_path_factory.mktemp("budget"), embedder)
    spec = {**SPEC, "prompt": {"relevance_floor": "off"}, "retriever": {"top_n": 3}}
    return make_pipeline(index_path, embedder, *load_generator(SMOL), spec=spec)


QUESTIONS = ["Where does the Danube rise and where does it end?", "How long should the dough be kneaded?",
             "What does mode 'a' do when opening a file?"]


def test_off_gives_todays_prompt_token_for_token(pipe):
    from ragspec.pipeline.prompt import PromptBuilder

    for q in QUESTIONS:
        sources, _ = pipe.retrieve(q)
        before = PromptBuilder(pipe.tokenizer, pipe.spec.prompt.style, None, None).build(q, sources)
        off = pipe.prepare(q, source_tokens="off").built
        assert off.ids == before.ids and off.source_budget is None
        large = pipe.prepare(q, source_tokens=10**6).built  # every window fits: every source whole
        assert large.ids == before.ids and all(not s.pieces for s in large.sources)


def test_a_cut_prompt_is_smaller_and_keeps_the_best_window(pipe):
    for q in QUESTIONS:
        off = pipe.prepare(q, source_tokens="off").built
        cut = pipe.prepare(q, source_tokens=1).built
        assert len(cut.sources) == 1 and len(cut.ids) < len(off.ids) and cut.source_budget == 1
        whole = off.sources[0]
        assert cut.sources[0].number == 1 and cut.sources[0].path == whole.path
        for t0, t1, d in cut.sources[0].text_pieces():  # exact slices of the document
            assert whole.text[d - whole.start:d - whole.start + t1 - t0] == cut.sources[0].text[t0:t1]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(question=st.lists(words, min_size=1, max_size=6).map(" ".join), budget=st.integers(1, 80))
def test_random_questions_cut_exact_slices(pipe, question, budget):
    prepared = pipe.prepare(question, source_tokens=budget)
    for s in prepared.sources:
        text = open(s.path, encoding="utf-8", newline="").read()
        for t0, t1, d in s.text_pieces():
            assert text[d:d + t1 - t0] == s.text[t0:t1]


def test_answers_from_cut_sources_cite_exact_document_slices(pipe):
    for q in QUESTIONS[:2]:
        answer = pipe.ask(q, source_tokens=24)
        assert answer.stats.source_budget == 24 and 0 < answer.stats.source_tokens
        assert answer.stats.source_tokens < pipe.ask(q, source_tokens="off", max_new_tokens=1).stats.source_tokens
        for c in answer.citations:
            with open(c.path, encoding="utf-8", newline="") as f:
                assert f.read()[c.start:c.end] == c.quote
        doc = answer.as_json()
        for s in doc["sources"]:
            with open(s["path"], encoding="utf-8", newline="") as f:
                text = f.read()
            assert ELISION.join(text[a:b] for a, b in s["pieces"]) == s["text"]
