"""The relevance gate (`prompt.relevance_floor`): what it embeds, how its floor resolves, and a real pipeline
(SmolLM2, MiniLM) declining off-topic sources without running the model and answering on-topic ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.pipeline import DECLINED, DoneEvent, Pipeline, SourcesEvent, TextEvent
from ragspec.pipeline.prompt import NO_DECLINE, PromptBuilder, SourceText, as_sources, system_instruction
from ragspec.retrieve.relevance import calibrated_floor, is_task_on_sources, resolve_gate
from ragspec.retrieve.windows import windows
from ragspec.settings import parse_floor
from ragspec.spec import load_spec

RIVERS = ("The Danube flows through ten countries. It rises in the Black Forest and empties into the Black Sea.\n\n"
          "The Rhine is shorter but carries more traffic; barges move coal and grain along it.")
BREAD = "Knead the dough for ten minutes until it is smooth. Bake at 230 degrees Celsius for thirty minutes."
QUESTION = "What do barges carry on the Rhine?"
FLOOR = 0.47  # MiniLM's measured floor (registry)


def test_windows_are_sentence_pairs():
    s = SourceText(1, "One. Two? Three!\nFour", title="T")
    assert windows(s) == ["One. Two?", "Two? Three!", "Three! Four"]  # the title is not a window's
    assert windows(SourceText(1, "Just one sentence")) == ["Just one sentence"]
    assert windows(SourceText(1, "  \n ")) == []


def test_a_task_on_the_sources_is_not_a_question_about_them():
    for q in ("Summarise the notes.", "summarize: …", "Translate this passage into French",
              "What does the passage say about barges?", "Rewrite the text in plain English"):
        assert is_task_on_sources(q), q
    for q in (QUESTION, "What does the global statement do?", "what is the highest point above sea level",
              "who signed the documents of surrender", "list the members of the traveling wilburys", ""):
        assert not is_task_on_sources(q), q


def test_the_floor_parses_in_one_place():
    assert parse_floor("auto") == "auto" and parse_floor(" OFF ") == "off"
    assert parse_floor("0.5") == 0.5 and parse_floor(-1) == -1.0
    for bad in ("high", 1.5, "-2", None, True):
        with pytest.raises(RagspecError, match="relevance_floor"):
            parse_floor(bad)


def test_the_floor_resolves_per_embedder():
    loaded = []

    def loader():
        loaded.append(1)
        return "embedder"

    assert resolve_gate("off", loader, "all-minilm-l6-v2") is None
    assert resolve_gate("auto", loader, "BAAI/bge-m3") is None  # no floor measured for it: off
    assert not loaded  # nothing loads for a gate that is off
    assert calibrated_floor("all-minilm-l6-v2") == FLOOR
    assert resolve_gate("auto", loader, "all-minilm-l6-v2").floor == FLOOR
    assert resolve_gate(0.3, loader, "BAAI/bge-m3").floor == 0.3
    with pytest.raises(RagspecError, match="relevance_floor"):
        resolve_gate("sometimes", loader, "all-minilm-l6-v2")


def test_the_band_is_measured_per_generator_and_embedder():
    """Both auto: a generator with a band measured for the embedder takes its floor and doubt (registry); any
    other generator the embedder's floor alone; a floor or doubt given by hand leaves the measured band out."""

    def gate(floor="auto", doubt="auto", generator="qwen2.5-coder-0.5b-instruct", embedder="all-minilm-l6-v2",
             copy=None):
        g = resolve_gate(floor, lambda: "embedder", embedder, doubt, generator, copy=copy)
        return None if g is None else (g.floor, g.doubt)

    assert gate() == (0.415, 0.52) == gate(generator="Qwen/Qwen2.5-Coder-0.5B-Instruct")  # the fast generator
    assert gate(generator="qwen2.5-coder-1.5b-instruct") == (0.435, 0.52)
    # the 1.5B reading its prompts with the int8 copy has its own band; a copy with none measured takes the plain one
    assert gate(generator="qwen2.5-coder-1.5b-instruct", copy="int8") == (0.44, 0.52)
    assert gate(copy="int8") == (0.415, 0.52) == gate(copy="bf16")
    assert gate(generator="qwen2.5-coder-1.5b-instruct", copy="int8", embedder="BAAI/bge-m3") is None
    assert gate(generator="smollm2-135m-instruct") == (FLOOR, None) == gate(generator="./my-model")
    assert gate(doubt=None) == (FLOOR, None) and gate(doubt=0.6) == (FLOOR, 0.6)
    assert gate(floor=0.4) == (0.4, None) and gate(floor=0.4, doubt=0.5) == (0.4, 0.5)
    assert gate(embedder="BAAI/bge-m3") is None  # no floor or band measured for it: off
    assert load_spec(None).prompt.relevance_doubt == "auto"
    assert load_spec(Path(__file__).parents[1] / "pipelines" / "default.yaml").prompt.relevance_doubt == "auto"


def test_the_spec_takes_auto_off_or_a_cosine():
    assert load_spec(None).prompt.relevance_floor == "auto"  # on by default (README, *Declining*)
    assert load_spec({"prompt": {"relevance_floor": 0.5}}).prompt.relevance_floor == 0.5
    for bad in (1.5, "sometimes"):
        with pytest.raises(RagspecError, match="relevance_floor"):
            load_spec({"prompt": {"relevance_floor": bad}})


def test_an_answer_after_the_gate_is_not_offered_to_decline(smol_tok):
    system = system_instruction("quote", NO_DECLINE)
    assert DECLINED not in system and system == system.strip()
    built = PromptBuilder(smol_tok, "quote", decline=NO_DECLINE).build(QUESTION, [SourceText(1, RIVERS)])
    assert DECLINED not in smol_tok.decode(built.ids)


@pytest.fixture(scope="module")
def smol():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_tok(smol):
    return smol[1]


@pytest.fixture(scope="module")
def gated(smol):
    model, tok = smol
    spec = {"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 12},
            "drafting": {"method": "suffix", "budget": 16}, "prompt": {"relevance_floor": "auto"}}
    return Pipeline(spec, model=model, tokenizer=tok)


def test_off_topic_sources_are_declined_without_running_the_model(gated):
    events = list(gated.stream(QUESTION, documents=[BREAD]))
    assert isinstance(events[0], SourcesEvent) and isinstance(events[-1], DoneEvent)
    assert [e.text for e in events if isinstance(e, TextEvent)] == [DECLINED]
    a = events[-1].answer
    assert a.declined and a.text == DECLINED and not a.citations and a.sources[0].text == BREAD
    assert a.stats.new_tokens == 0 and a.stats.steps == 0 and a.stats.prompt_tokens == 0
    assert a.stats.finish_reason == "declined" and a.stats.relevance < FLOOR
    assert a.as_json()["stats"]["relevance"] == round(a.stats.relevance, 3)


def test_on_topic_sources_are_answered(gated):
    a = gated.ask(QUESTION, documents=[BREAD, RIVERS])
    assert a.stats.relevance >= FLOOR and a.stats.new_tokens > 0 and a.stats.finish_reason != "declined"
    # a follow-up turn is not gated (its question alone need not resemble the sources)
    b = gated.ask("And the Danube?", documents=[BREAD], history=[{"role": "user", "content": QUESTION},
                                                                  {"role": "assistant", "content": a.text}])
    assert b.stats.relevance is None and b.stats.new_tokens > 0


def test_an_unsure_score_offers_the_model_to_decline(smol, gated):
    """From the floor up to `relevance_doubt` the model is offered to decline (README, *Declining*)."""
    model, tok = smol
    spec = {"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 12},
            "drafting": {"method": "suffix", "budget": 16},
            "prompt": {"relevance_floor": "auto", "relevance_doubt": 0.99}}
    unsure = Pipeline(spec, model=model, tokenizer=tok)
    docs = [BREAD, RIVERS]
    a, b = unsure.ask(QUESTION, documents=docs), gated.ask(QUESTION, documents=docs)
    assert FLOOR <= a.stats.relevance < 0.99 and a.stats.relevance == pytest.approx(b.stats.relevance, abs=1e-6)  # remembered window embeddings: batch rounding
    sources = as_sources(docs)
    offered = unsure.prompt_builder(12).build(QUESTION, sources).ids
    plain = unsure.prompt_builder(12, NO_DECLINE).build(QUESTION, sources).ids
    assert DECLINED in tok.decode(offered) and DECLINED not in tok.decode(plain)
    assert a.stats.prompt_tokens == len(offered) and b.stats.prompt_tokens == len(plain)
    # under the floor it still declines without running the model
    c = unsure.ask(QUESTION, documents=[BREAD])
    assert c.declined and c.stats.finish_reason == "declined" and c.stats.new_tokens == 0
    with pytest.raises(RagspecError, match="relevance_doubt"):
        load_spec({"prompt": {"relevance_doubt": 1.5}})


def test_the_gate_reads_each_source_in_one_forward():
    """The question is embedded, each source read once (its vector and its windows pooled from one forward), and
    the score is the mean of the best window's and the best whole source's cosine, as reading each apart."""

    from ragspec.models.embedder import load_embedder
    from ragspec.retrieve.relevance import RelevanceGate

    real, seen = load_embedder("all-minilm-l6-v2"), []

    class Counting:  # the real embedder, keeping what it is given
        def encode(self, texts):
            seen.append(("encode", list(texts)))
            return real.encode(texts)

        def encode_windows(self, texts):
            seen.append(("pool", list(texts)))
            return real.encode_windows(texts)

    sources = [SourceText(1, BREAD), SourceText(2, RIVERS)]
    score = RelevanceGate(Counting(), FLOOR).score(QUESTION, sources)
    assert seen == [("encode", [QUESTION]), ("pool", [BREAD, RIVERS])]
    q = real.encode([QUESTION])[0]
    apart = [real.encode_windows([s.text]) for s in sources]
    best_window = max(float((w[0] @ q).max()) for _, w in apart)
    best_whole = max(float(v[0] @ q) for v, _ in apart)
    assert len(apart[0][1][0]) == 1 and len(apart[1][1][0]) == 3  # a two-sentence source is its own only window
    # apart or batched, a vector differs only by padding and reduced-precision rounding
    assert score == pytest.approx((best_window + best_whole) / 2, abs=5e-3)


def test_a_task_on_the_sources_is_not_gated(gated):
    a = gated.ask("Summarise the notes.", documents=[BREAD])
    assert a.stats.relevance is None and a.stats.new_tokens > 0 and a.stats.finish_reason != "declined"


def test_eval_answers_takes_the_floor(tmp_path):
    rows = [{"id": "a", "input": QUESTION, "passages": [{"title": "Rivers", "text": RIVERS}],
             "output": [{"answer": "coal and grain"}]},
            {"id": "u", "input": QUESTION, "passages": [{"title": "Bread", "text": BREAD}], "output": []}]
    data = tmp_path / "clap.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = tmp_path / "smol.yaml"
    spec.write_text("generator:\n  model: smollm2-135m-instruct\n  max_new_tokens: 8\n"
                    "drafting:\n  method: suffix\n  budget: 16\n")
    out = tmp_path / "r.json"
    runner = CliRunner()
    r = runner.invoke(app, ["eval-answers", "--data", str(data), "--format", "clapnq", "--pipeline", str(spec),
                            "--relevance-floor", "auto", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["relevance_floor"] == FLOOR and doc["refusal_rate"] == 1.0
    assert [row["declined"] for row in doc["rows"]] == [False, True]
    assert all(row["relevance"] is not None for row in doc["rows"])
    r = runner.invoke(app, ["eval-answers", "--data", str(data), "--format", "clapnq", "--pipeline", str(spec),
                            "--relevance-floor", "high"])
    assert r.exit_code == 2 and "--relevance-floor" in r.output and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, ["eval-answers", "--data", str(data), "--format", "clapnq", "--pipeline", str(spec),
                            "--relevance-doubt", "0.99", "--limit", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["relevance_floor"] == FLOOR and doc["relevance_doubt"] == 0.99
    for bad in ("sometimes", "1.5"):
        r = runner.invoke(app, ["eval-answers", "--data", str(data), "--format", "clapnq", "--pipeline", str(spec),
                                "--relevance-doubt", bad])
        assert r.exit_code == 2 and "relevance_doubt" in r.output.replace("-", "_"), r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_pooled_sources_are_remembered_across_asks(embedder):
    """The gate reads a source once: a later ask over the same sources embeds only its question, and scores as
    it would from nothing."""
    from ragspec.retrieve.windows import PooledMemo, measure

    sources = [SourceText(1, "The Danube flows through ten countries. It rises in the Black Forest. It ends in "
                             "the Black Sea.", "rivers.txt", title="Rivers"),
               SourceText(2, "Knead the dough for ten minutes. Let it rise for an hour.", "bread.rst")]
    calls = []

    class Counting:
        def encode(self, texts):
            calls.append(list(texts))
            return embedder.encode(texts)

        def encode_windows(self, texts):
            calls.append(list(texts))
            return embedder.encode_windows(texts)

    memo = PooledMemo()
    first = measure(Counting(), "Where does the Danube rise?", sources, memo=memo)
    again = measure(Counting(), "Which sea does the Danube reach?", sources, memo=memo)
    plain = measure(embedder, "Which sea does the Danube reach?", sources)
    assert calls[1] == [s.text for s in sources] and calls[2:] == [["Which sea does the Danube reach?"]]
    # remembered vectors were pooled in another batch: float32 rounds alike, bf16 (the auto choice on CPUs with
    # native bf16) rounds by batch (3e-4 seen on a Zen 4)
    tol = 1e-5 if embedder.dtype == "float32" else 2e-3
    assert abs(again.score - plain.score) < tol and first.score != again.score
    for a, b in zip(again.windows, plain.windows):
        assert np.allclose(a, b, atol=tol)
    small = PooledMemo(capacity=1)
    measure(embedder, "Where does the Danube rise?", sources, memo=small)
    assert len(small.pooled) == 1


def test_a_merged_source_is_judged_whole_by_its_chunks_vectors(embedder):
    """A source of several merged chunks is judged as a whole by the best of its chunks' stored vectors (given as
    one [k, dim] array); its windows are pooled from one forward of its text, as any source's."""
    from ragspec.retrieve.windows import _whole, measure

    chunks = ["The Danube flows through ten countries. It rises in the Black Forest.",
              "Its delta lies in Romania. It ends in the Black Sea."]
    merged = SourceText(1, " ".join(chunks), "rivers.txt")
    other = SourceText(2, "Knead the dough for ten minutes. Let it rise for an hour.", "bread.rst")
    question = "Which sea does the Danube reach?"
    parts = np.asarray(embedder.encode(chunks), dtype=np.float32)
    got = measure(embedder, question, [merged, other], stored={_whole(merged): parts})
    q = embedder.encode([question])[0]
    wholes, wins = embedder.encode_windows([merged.text, other.text])
    best_window = max(float((w @ q).max()) for w in wins)
    best_whole = max(float((parts @ q).max()), float(wholes[1] @ q))
    tol = 1e-4 if embedder.dtype == "float32" else 3e-3  # bf16 vectors round by batch
    assert got.score == pytest.approx((best_window + best_whole) / 2, abs=tol)
    assert [len(w) for w in got.windows] == [3, 1]


def test_merged_neighbours_read_only_the_sentences_around_their_seam(embedder):
    """Neighbouring chunks merged into one source take their chunks' stored windows; the one window across
    the seam is pooled from the sentences around it (`SEAM_CONTEXT` either side), not from the whole text."""
    from ragspec.retrieve.windows import SEAM_CONTEXT, _whole, measure, seam_pieces

    first = ("The Danube rises in the Black Forest. It flows east through Vienna. Barges carry grain on it. "
             "Its water is cold in spring.")
    second = ("Its delta lies in Romania. The delta is home to pelicans. It ends in the Black Sea. "
              "Ships reach the sea at Sulina.")
    merged = SourceText(1, first + " " + second, "rivers.txt")
    question = "Which sea does the Danube reach?"
    wholes, wins = embedder.encode_windows([first, second])
    stored = {_whole(merged): np.stack(wholes)}
    for text, vectors in zip((first, second), wins):
        stored.update(zip(windows(SourceText(0, text)), vectors))
    names = windows(merged)
    assert [n for n in names if n not in stored] == ["Its water is cold in spring. Its delta lies in Romania."]
    (piece, k), = seam_pieces(merged.text, names, stored).values()
    assert piece == ("It flows east through Vienna. Barges carry grain on it. Its water is cold in spring. "
                     "Its delta lies in Romania. The delta is home to pelicans. It ends in the Black Sea.")
    assert k == SEAM_CONTEXT == 2
    pooled = []

    class Counting:  # the real embedder, keeping what it pools
        def encode(self, texts):
            return embedder.encode(texts)

        def encode_windows(self, texts):
            pooled.append(list(texts))
            return embedder.encode_windows(texts)

    got = measure(Counting(), question, [merged], stored=stored)
    assert pooled == [[piece]]
    q = embedder.encode([question])[0]
    seam = embedder.encode_windows([piece])[1][0][k]
    vectors = np.stack([seam if n not in stored else stored[n] for n in names])
    tol = 1e-4 if embedder.dtype == "float32" else 3e-3  # bf16 vectors round by batch
    assert np.allclose(got.windows[0], vectors @ q, atol=tol)
    best_whole = float((np.stack(wholes) @ q).max())
    assert got.score == pytest.approx((float((vectors @ q).max()) + best_whole) / 2, abs=tol)
    # most windows missing (a passage not from the index): read whole
    assert seam_pieces(merged.text, names, {}) is None
