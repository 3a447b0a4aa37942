"""Answer quality: the NQ/SQuAD metrics, refusal detection and citation coverage on hand-made cases, the three
readers on tiny files, and `ragspec eval-answers` run for real (SmolLM2, own passages and a tiny index)."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import write_corpus
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.eval.answers import (
    answer_contains,
    citation_coverage,
    is_refusal,
    normalize,
    pick_records,
    read_records,
    record_sources,
    summarize,
    token_f1,
)
from ragspec.pipeline import DECLINED, Answer, AnswerStats, is_declined
from ragspec.pipeline.prompt import DECLINES, STYLES, SYSTEM, PromptBuilder, SourceText, system_instruction

runner = CliRunner()


# -- metrics -------------------------------------------------------------------------------------------------
def test_normalize_is_squad_style():
    assert normalize("The  Wilhelm, Conrad Röntgen!") == "wilhelm conrad röntgen"
    assert normalize("An apple a day — the end.") == "apple day end"
    assert normalize("“Quoted” (text)") == "quoted text"
    assert normalize("Theatre anatomy") == "theatre anatomy"  # articles only as whole words


def test_answer_contains_any_reference_on_word_boundaries():
    refs = ["Wilhelm Conrad Röntgen", "Röntgen"]
    assert answer_contains("It was awarded to Röntgen, of Germany.", refs)
    assert answer_contains("the first winner was WILHELM CONRAD RÖNTGEN", refs)
    assert not answer_contains("It was awarded to Marie Curie.", refs)
    assert not answer_contains("He was 100 years old", ["10"])  # no match inside a longer token
    assert answer_contains("In 10 minutes.", ["100", "10"])
    assert not answer_contains("anything", ["", "   "])  # empty references never match
    assert not answer_contains("", ["x"])


def test_token_f1_takes_the_best_reference():
    assert token_f1("Wilhelm Conrad Röntgen", ["Röntgen", "Wilhelm Conrad Röntgen"]) == 1.0
    # "the ten minutes" → [ten, minutes]; vs [ten, minutes, or, so]: P 1, R 0.5
    assert token_f1("the ten minutes", ["ten minutes or so"]) == pytest.approx(2 / 3)
    assert token_f1("ten minutes", ["an hour", "ten"]) == pytest.approx(2 / 3)
    assert token_f1("nothing shared", ["ten"]) == 0.0
    assert token_f1("anything", []) == 0.0


def test_refusal_is_the_fixed_declined_string():
    for text in (DECLINED, DECLINED.lower(), DECLINED.rstrip("."), f"**{DECLINED}**", f"  {DECLINED}!\n",
                 f"{DECLINED} The passage is about forests.", f"\"{DECLINED}\"\nsomething else"):
        assert is_declined(text) and is_refusal(text), text
    for text in ("", "Paris.", "The sources do not contain the answer to this question.",
                 "I think the sources do not contain the answer.", "The sources do contain the answer: 10."):
        assert not is_declined(text), text
    for style in STYLES:  # every style tells the model the exact string
        assert DECLINED in SYSTEM[style]
    assert set(STYLES) >= {"quote", "free", "brief"}


def test_decline_phrasing_per_model(tmp_path):
    """`prompt.decline`: both phrasings carry the exact string; `auto` takes the registry's measured choice
    (the 1.5B, by name or hub id: `expected`), else `last_resort`; an explicit value wins; a bad one is refused."""
    from transformers import AutoTokenizer

    from ragspec.models.generator import generator_source
    from ragspec.pipeline import Pipeline
    from ragspec.spec import load_spec

    for style in STYLES:
        for decline in DECLINES:
            assert DECLINED in system_instruction(style, decline)
        assert system_instruction(style) == SYSTEM[style]
    assert system_instruction("quote", "expected") != system_instruction("quote", "last_resort")

    def decline(model, value="auto"):
        return Pipeline({"generator": {"model": model}, "prompt": {"decline": value}}).decline

    assert decline("qwen2.5-coder-1.5b-instruct") == "expected"
    assert decline("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "expected"
    assert decline("qwen2.5-coder-0.5b-instruct") == "last_resort"
    assert decline("some/unknown-model") == "last_resort"
    assert decline("qwen2.5-coder-1.5b-instruct", "last_resort") == "last_resort"
    with pytest.raises(Exception, match="decline"):
        load_spec({"prompt": {"decline": "never"}})
    # the builder puts the chosen phrasing into the rendered prompt
    tok = AutoTokenizer.from_pretrained(generator_source("smollm2-135m-instruct"))
    src = [SourceText(1, "The Danube rises in the Black Forest.")]
    for d in DECLINES:
        text = tok.decode(PromptBuilder(tok, "quote", decline=d).build("Where does it rise?", src).ids)
        assert system_instruction("quote", d) in text


def test_answer_declined_flag_and_json():
    a = Answer("q?", DECLINED, [], [], AnswerStats())
    b = Answer("q?", "Paris.", [], [], AnswerStats())
    assert a.declined is True and b.declined is False
    assert a.as_json()["declined"] is True and b.as_json()["declined"] is False


def test_citation_coverage_counts_answer_words_inside_citations():
    text = "It rises in the Black Forest, they say."  # words: It rises in the Black Forest , they say . = 10
    start = text.index("rises")
    end = text.index(",")
    cites = [{"answer_start": start, "answer_end": end}]  # rises in the Black Forest = 5 words
    assert citation_coverage(text, cites) == pytest.approx(0.5)
    assert citation_coverage(text, []) == 0.0
    assert citation_coverage(text, [{"answer_start": 0, "answer_end": len(text)}]) == 1.0
    assert citation_coverage("", cites) is None


def test_summarize_splits_answerable_and_unanswerable():
    def row(answerable, declined, contains=None, f1=None, cov=None, sp=2.0):
        return {"answerable": answerable, "declined": declined, "answer_contains": contains, "token_f1": f1,
                "citation_coverage": cov, "new_tokens": 10, "decode_ms": 1000.0, "ttft_ms": 500.0,
                "speedup_estimate": sp}

    rows = [row(True, False, True, 1.0, 0.5, 3.0), row(True, True, False, 0.0), row(False, True),
            row(False, False, cov=1.0, sp=1.0)]
    s = summarize(rows, format="clapnq")
    assert s["answer_contains"] == 0.5 and s["token_f1"] == 0.5
    assert s["refusal_rate"] == 0.5 and s["false_refusal_rate"] == 0.5
    assert s["citation_coverage"] == 0.75
    assert s["decode_tokens_per_s"] == 10.0 and s["speedup"] == 2.0 and s["ttft_ms_p50"] == 500.0
    only_answerable = summarize(rows[:2])
    assert only_answerable["refusal_rate"] is None


# -- readers -------------------------------------------------------------------------------------------------
NQ = [
    {"question": "where does the danube rise", "answers": ["the Black Forest", "Black Forest"],
     "ctxs": [{"title": "Danube", "isgold": True, "hasanswer": True,
               "text": "The Danube flows through ten countries. It rises in the Black Forest and empties into the "
                       "Black Sea."}]},
    {"question": "how long should bread dough be kneaded", "answers": ["ten minutes"],
     "ctxs": [{"title": "Bread", "isgold": True, "hasanswer": True,
               "text": "Knead the dough for ten minutes until it is smooth and elastic. Let it rise for an hour."}]},
]
CLAP_ANSWERABLE = [
    {"id": "a1", "input": "what do barges carry on the rhine",
     "passages": [{"title": "Rhine", "text": "The Rhine carries much traffic; barges move coal and grain along it."}],
     "output": [{"answer": "Barges move coal and grain along the Rhine."}, {"answer": "coal and grain"}]},
    {"id": "a2", "input": "at what temperature is bread baked",
     "passages": [{"title": "Bread", "text": "Bake at 230 degrees Celsius for thirty minutes."}],
     "output": [{"answer": "230 degrees Celsius"}]},
]
CLAP_UNANSWERABLE = [
    {"id": "u1", "input": "who was the first king of the rhine valley",
     "passages": [{"title": "Rhine", "text": "The Rhine carries much traffic; barges move coal and grain along it."}],
     "output": [{"answer": "", "selected_sentences": []}]},
]
SPEC_TURN = ("Danube The Danube rises in the Black Forest.\nRhine The Rhine is busy.\nBread Knead for ten minutes.\n"
             "Baking Bake at 230 degrees.\nSea The Black Sea is salty.\nWhere does the Danube rise?")
SPECBENCH = [
    {"question_id": 1, "category": "summarization", "turns": ["Summarize: x"], "reference": []},
    {"question_id": 2, "category": "rag", "turns": [SPEC_TURN], "reference": [["Black Forest", "the Black Forest"]]},
]


def write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def data(tmp_path):
    clap = tmp_path / "clapnq"
    clap.mkdir()
    write_jsonl(clap / "clapnq_dev_answerable.jsonl", CLAP_ANSWERABLE)
    write_jsonl(clap / "clapnq_dev_unanswerable.jsonl", CLAP_UNANSWERABLE)
    return {"nq": write_jsonl(tmp_path / "nq.jsonl.gz", NQ, gz=True), "clapnq": clap,
            "specbench": write_jsonl(tmp_path / "question.jsonl", SPECBENCH)}


def test_readers(data):
    nq = read_records(data["nq"], "nq")
    assert [r.question for r in nq] == [NQ[0]["question"], NQ[1]["question"]]
    assert nq[0].references == ["the Black Forest", "Black Forest"] and nq[0].answerable
    assert nq[0].passages == [("Danube", NQ[0]["ctxs"][0]["text"])]
    assert len(read_records(data["nq"], "nq", limit=1)) == 1

    clap = read_records(data["clapnq"], "clapnq")
    assert [(r.id, r.answerable) for r in clap] == [("a1", True), ("a2", True), ("u1", False)]
    assert clap[0].references == ["Barges move coal and grain along the Rhine.", "coal and grain"]
    assert clap[2].references == []
    assert [r.id for r in read_records(data["clapnq"], "clapnq", limit=1)] == ["a1", "u1"]  # N from each file
    assert [r.id for r in read_records(data["clapnq"] / "clapnq_dev_unanswerable.jsonl", "clapnq")] == ["u1"]
    assert [r.id for r in pick_records(clap, "3,1")] == ["u1", "a1"]  # numbered in the order read

    sb = read_records(data["specbench"], "specbench")
    assert len(sb) == 1 and sb[0].question == "Where does the Danube rise?"
    assert len(sb[0].passages) == 5 and sb[0].references == ["Black Forest", "the Black Forest"]
    sources = record_sources(sb[0])
    assert [s.number for s in sources] == [1, 2, 3, 4, 5] and sources[0].text.startswith("Danube The Danube")
    assert record_sources(nq[0])[0].path == "Danube"


def test_readers_reject_bad_input(tmp_path, data):
    with pytest.raises(RagspecError, match="missing 'question'"):
        read_records(data["clapnq"] / "clapnq_dev_answerable.jsonl", "nq")
    with pytest.raises(RagspecError, match="no rows of category 'rag'"):
        read_records(data["nq"], "specbench")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(RagspecError, match=r"bad.jsonl:1: not JSON"):
        read_records(bad, "nq")
    with pytest.raises(RagspecError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl", "nq")
    with pytest.raises(RagspecError, match="not one of"):
        read_records(bad, "squad")


def test_cli_bad_input_is_one_line(tmp_path, data):
    for args, msg in ((["--data", str(tmp_path / "nope.jsonl"), "--format", "nq"], "does not exist"),
                      (["--data", str(data["nq"]), "--format", "squad"], "is not one of"),
                      (["--data", str(data["nq"]), "--format", "nq", "--style", "poem"], "--style 'poem'"),
                      (["--data", str(data["clapnq"] / "clapnq_dev_answerable.jsonl"), "--format", "nq"],
                       "missing 'question'"),
                      (["--data", str(data["nq"]), "--format", "nq", "--records", "1,9"], "there is no record 9"),
                      (["--data", str(data["nq"]), "--format", "nq", "--records", "a"], "record numbers"),
                      (["--data", str(data["nq"]), "--format", "nq", "--records", "2,2"], "record 2 twice")):
        r = runner.invoke(app, ["eval-answers", *args])
        assert r.exit_code == 2, r.output
        assert msg in r.output and len(r.output.strip().splitlines()) == 1, r.output


# -- real runs (SmolLM2) -------------------------------------------------------------------------------------
KEYS = {"format", "records", "answer_contains", "token_f1", "refusal_rate", "false_refusal_rate",
        "citation_coverage", "ttft_ms_p50", "decode_tokens_per_s", "speedup", "style", "model", "rows"}


@pytest.fixture
def spec_file(tmp_path):
    p = tmp_path / "smol.yaml"
    p.write_text("generator:\n  model: smollm2-135m-instruct\n  max_new_tokens: 8\n"
                 "drafting:\n  method: suffix\n  budget: 16\nretriever:\n  top_n: 2\n")
    return p


def test_eval_answers_over_own_passages_writes_the_schema(tmp_path, data, spec_file):
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["eval-answers", "--data", str(data["clapnq"]), "--format", "clapnq", "--pipeline",
                            str(spec_file), "--style", "brief", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert KEYS <= set(doc)
    assert doc["format"] == "clapnq" and doc["style"] == "brief" and doc["model"] == "smollm2-135m-instruct"
    assert doc["records"] == 3 and doc["answerable"] == 2 and doc["unanswerable"] == 1
    assert doc["refusal_rate"] in (0.0, 1.0) and 0.0 <= doc["false_refusal_rate"] <= 1.0
    assert 0.0 <= doc["answer_contains"] <= 1.0 and 0.0 <= doc["token_f1"] <= 1.0
    assert doc["ttft_ms_p50"] > 0 and doc["decode_tokens_per_s"] > 0
    assert doc["speedup"] is None or doc["speedup"] > 0  # budget 16 (not auto): no cost model, no estimate
    assert doc["backend"] and doc["dtype"] and doc["date"] and "flags" in doc["cpu"]  # what ran, and where
    for row in doc["rows"]:
        assert (row["backend"], row["dtype"]) == (doc["backend"], doc["dtype"])
        assert row["declined"] == is_declined(row["answer"])
        assert row["new_tokens"] <= 8
        assert (row["answer_contains"] is None) == (not row["answerable"])
    assert not (tmp_path / "r.json.tmp").exists()


def test_eval_answers_with_retrieval(tmp_path, data, spec_file, embedder):
    from ragspec.index.builder import build_index
    from ragspec.settings import IndexSettings

    corpus = write_corpus(tmp_path / "corpus")
    index = tmp_path / "index"
    build_index(corpus, index, IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder, show_progress=False)
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["eval-answers", "--data", str(data["nq"]), "--format", "nq", "--retrieve", str(index),
                            "--pipeline", str(spec_file), "--limit", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert KEYS <= set(doc) and doc["records"] == 1 and doc["refusal_rate"] is None
    assert doc["sources"].startswith("retrieved from") and doc["style"] == "quote"
    r = runner.invoke(app, ["eval-answers", "--data", str(data["nq"]), "--format", "nq", "--retrieve",
                            str(tmp_path / "no-index"), "--pipeline", str(spec_file)])
    assert r.exit_code == 2 and "does not exist" in r.output
