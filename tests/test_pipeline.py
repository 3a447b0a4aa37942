"""The pipeline end to end with real parts (MiniLM index, SmolLM2 generator): ask == stream, citations slice
the documents, events stream before the answer ends, 8 threads at once, context trimming, bad specs, CLI."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from conftest import write_corpus
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.index.builder import build_index
from ragspec.pipeline import CitationEvent, DoneEvent, Pipeline, SourcesEvent, TextEvent
from ragspec.settings import IndexSettings

SPEC = {
    "name": "test",
    "retriever": {"top_n": 3},
    "generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 40},
    "drafting": {"method": "trie", "budget": 16},
}
QUESTIONS = [
    "Which mode opens a file for appending?",
    "Where does the Danube rise and where does it end?",
    "How long should the dough be kneaded?",
    "What do barges carry on the Rhine?",
]


@pytest.fixture(scope="module")
def smol():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def index_path(tmp_path_factory, embedder):
    root = tmp_path_factory.mktemp("pipe")
    corpus = write_corpus(root / "corpus")
    target = root / "indexes" / "corpus"
    build_index(corpus, target, IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder, show_progress=False)
    return target


@pytest.fixture(scope="module")
def pipe(index_path, smol, embedder):
    from ragspec.retrieve.retriever import Retriever
    from ragspec.spec import load_spec

    spec = load_spec(SPEC)
    model, tok = smol
    return Pipeline(spec, Retriever(str(index_path), spec.retriever, embedder=embedder), model=model, tokenizer=tok)


@pytest.fixture(scope="module")
def references(pipe):
    return {q: pipe.ask(q) for q in QUESTIONS}


def doc_slice(c) -> str:
    with open(c.path, encoding="utf-8", newline="") as f:
        return f.read()[c.start : c.end]


def test_ask_and_stream_agree_and_citations_slice_documents(pipe, references):
    for q in QUESTIONS:
        a = references[q]
        events = list(pipe.stream(q))
        assert isinstance(events[0], SourcesEvent) and isinstance(events[-1], DoneEvent)
        text = "".join(e.text for e in events if isinstance(e, TextEvent))
        streamed = [e.citation for e in events if isinstance(e, CitationEvent)]
        assert text == a.text == events[-1].answer.text
        assert streamed == a.citations == events[-1].answer.citations
        assert a.stats.new_tokens > 0 and a.stats.steps > 0 and a.sources
        for c in a.citations:
            assert doc_slice(c) == c.quote
            assert a.text[c.answer_start : c.answer_end].split() == c.quote.split()
    assert any(references[q].citations for q in QUESTIONS), "the quote style should produce some copied spans"


def test_answer_matches_plain_greedy_decoding(pipe, references, smol):
    model, tok = smol
    plain = Pipeline({**SPEC, "drafting": {"method": "none"}}, pipe.retriever, model=model, tokenizer=tok)
    for q in QUESTIONS[:2]:
        assert plain.ask(q).text == references[q].text


def test_repeated_question_drafts_the_earlier_answer(pipe, smol):
    """Cross-request memory (suffix drafting, on by default): the second ask of a question gives the same
    answer in at least 2x fewer steps; with memory off it does not get faster."""
    model, tok = smol
    spec = {**SPEC, "generator": {**SPEC["generator"], "max_new_tokens": 48},
            "drafting": {"method": "suffix", "budget": "auto"}}
    fresh = Pipeline(spec, pipe.retriever, model=model, tokenizer=tok)
    q = QUESTIONS[1]
    first, second = fresh.ask(q), fresh.ask(q)
    assert first.text == second.text
    assert second.stats.steps * 2 <= first.stats.steps, (first.stats.steps, second.stats.steps)
    print(f"repeated question: {first.stats.steps} steps, then {second.stats.steps}")
    off = Pipeline({**spec, "drafting": {"method": "suffix", "budget": "auto", "memory": 0}}, pipe.retriever,
                   model=model, tokenizer=tok)
    a, b = off.ask(q), off.ask(q)
    assert a.text == b.text == first.text and b.stats.steps * 2 > a.stats.steps


def test_events_arrive_before_generation_ends(pipe):
    tokens_at_first_text = None
    answer = None
    for ev in pipe.stream(QUESTIONS[1], max_new_tokens=40):
        if isinstance(ev, TextEvent) and tokens_at_first_text is None and ev.text:
            tokens_at_first_text = len(ev.tokens)
        if isinstance(ev, DoneEvent):
            answer = ev.answer
    assert tokens_at_first_text is not None and tokens_at_first_text < answer.stats.new_tokens


def test_eight_threads_at_once(pipe, references):
    results: dict[int, str] = {}
    errors = []

    def work(i: int):
        try:
            results[i] = pipe.ask(QUESTIONS[i % 4]).text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[i] == references[QUESTIONS[i % 4]].text for i in range(8))


def test_async_ask_and_stream(pipe, references):
    async def go():
        a = await pipe.aask(QUESTIONS[0])
        texts = [ev.text async for ev in pipe.astream(QUESTIONS[0]) if isinstance(ev, TextEvent)]
        return a, "".join(texts)

    a, streamed = asyncio.run(go())
    assert a.text == streamed == references[QUESTIONS[0]].text
    assert [x.text for x in pipe.ask_many(QUESTIONS[:2])] == [references[q].text for q in QUESTIONS[:2]]


def test_oversized_context_is_trimmed_with_a_warning(pipe, smol):
    model, tok = smol
    small = Pipeline({**SPEC, "prompt": {"max_context_tokens": 150}}, pipe.retriever, model=model, tokenizer=tok)
    a = small.ask(QUESTIONS[0], max_new_tokens=8)
    assert a.stats.dropped_sources >= 1 and len(a.sources) == 3 - a.stats.dropped_sources
    assert a.warnings and f"dropped the {a.stats.dropped_sources} lowest-ranked" in a.warnings[0]
    assert a.stats.prompt_tokens <= 150


def test_bad_specs_name_the_key(index_path):
    with pytest.raises(RagspecError, match=r"unknown key 'generator.modle'"):
        Pipeline({"generator": {"modle": "x"}}, index_path)
    with pytest.raises(RagspecError, match="unknown parameter 'depth' for drafting method 'trie'"):
        Pipeline({"drafting": {"method": "trie", "params": {"depth": 3}}}, index_path)
    with pytest.raises(RagspecError, match=r"drafting.method"):
        Pipeline({"drafting": {"method": "medusa"}}, index_path)
    with pytest.raises(RagspecError, match="no index"):
        Pipeline(SPEC).retrieve("anything")


def test_documents_instead_of_retrieval(pipe):
    a = pipe.ask("Where does the Danube end?", documents=["The Danube empties into the Black Sea after 2,850 km."])
    assert a.sources[0].path == "<document 1>" and a.stats.retrieval_ms == 0.0
    for c in a.citations:
        assert "The Danube empties into the Black Sea after 2,850 km."[c.start : c.end] == c.quote


def test_cli_ask_json(index_path, tmp_path):
    spec = tmp_path / "p.yaml"
    spec.write_text("generator:\n  model: smollm2-135m-instruct\n  max_new_tokens: 24\ndrafting:\n  budget: 16\n")
    r = CliRunner().invoke(app, ["ask", QUESTIONS[0], "--index", str(index_path), "--pipeline", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {"question", "text", "citations", "sources", "stats"} <= set(doc)
    assert doc["question"] == QUESTIONS[0] and doc["text"]
    for s in doc["sources"]:
        assert {"source", "path", "start", "end", "score"} <= set(s)
        with open(s["path"], encoding="utf-8", newline="") as f:
            assert f.read()[s["start"] : s["end"]] == s["text"]
    for c in doc["citations"]:
        assert {"source", "path", "start", "end", "quote", "answer_start", "answer_end"} <= set(c)
        with open(c["path"], encoding="utf-8", newline="") as f:
            assert f.read()[c["start"] : c["end"]] == c["quote"]
    r = CliRunner().invoke(app, ["ask", "hello", "--index", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no index" in r.output


def test_answer_budget_below_one_and_overlong_questions_are_one_clear_error(pipe, index_path):
    for bad in (0, -3):
        with pytest.raises(RagspecError, match="max_new_tokens must be at least 1"):
            pipe.ask(QUESTIONS[0], max_new_tokens=bad)
    limit = pipe.spec.prompt.max_question_tokens
    with pytest.raises(RagspecError, match="max_question_tokens"):
        pipe.ask("why " * (limit + 10))
    r = CliRunner().invoke(app, ["ask", QUESTIONS[0], "--index", str(index_path), "--max-new-tokens", "0"])
    assert r.exit_code == 2 and "--max-new-tokens must be at least 1" in r.output


def test_a_pipeline_without_its_index_says_so_before_loading_the_model(tmp_path):
    """`ask` with no index (or a path with none) was one line only after the generator loaded (3-5 s)."""
    from ragspec.spec import load_spec

    for index, expected in ((None, "has no index"), (str(tmp_path / "nowhere"), "no index at")):
        pipe = Pipeline(load_spec({"generator": {"model": "smollm2-135m-instruct"}}), index)
        with pytest.raises(RagspecError, match=expected):
            pipe.ask("What is the capital of Austria?")
        assert pipe._model is None  # nothing was loaded for it


def test_an_answer_budget_past_the_models_window_is_named_as_such():
    """max_new_tokens beyond the model's window was reported as a question over a negative prompt budget."""
    from ragspec.spec import load_spec

    pipe = Pipeline(load_spec({"generator": {"model": "smollm2-135m-instruct"}}))
    with pytest.raises(RagspecError, match=r"max_new_tokens 1000000 leaves 0 tokens of the model's \d+-token window"):
        pipe.ask("Which river flows through Vienna?", documents=["Vienna lies on the Danube."], max_new_tokens=10**6)
