"""The relevance gate's window vectors stored with the index (index/windows.py): pooled from the chunks' own
forward, equal to what an ask pools, incremental like the chunk vectors, added to an index built before them by
indexing again. Real MiniLM (float32, so that ask-time vectors do not move with the batch), real index in a tmp
folder."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import write_corpus

from ragspec.corpus.windows import window_texts
from ragspec.index import manifest, windows
from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.settings import IndexSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8, embed_dtype="float32")
F16 = 2.0 ** -11  # float16's rounding of a component under 1


@pytest.fixture(scope="module")
def f32():
    from ragspec.models.embedder import load_embedder

    return load_embedder("all-minilm-l6-v2", "cpu", "float32", SMALL.chunk_tokens)


def strip_windows(target) -> None:
    """Make `target` an index as built before window vectors existed: no files, no manifest entry."""
    folder = Index(target).folder
    data = json.loads((folder / manifest.MANIFEST).read_text())
    data.pop("checksum")
    del data["embedder"]["windows"]
    for name in (windows.WINDOWS, windows.OFFSETS):
        (folder / name).unlink()
        del data["files"][name]
    manifest.write(folder, data)


def all_rows(idx: Index):
    return idx.store.chunks(range(idx.store.count_chunks()))


def test_stored_windows_equal_those_an_ask_pools(tmp_path, f32):
    target = tmp_path / "idx"
    s = build_index(write_corpus(tmp_path / "corpus"), target, SMALL, embedder=f32, show_progress=False)
    idx = Index(target, verify=True)
    entry = idx.manifest["embedder"]["windows"]
    assert entry["dtype"] == "float16" and entry["rows"] == len(idx.windows.vectors) > 0
    rows = all_rows(idx)
    assert entry["rows"] == sum(len(window_texts(c.text)) for c in rows) == s.windows_embedded
    assert s.windows_reused == 0
    wholes, pooled = f32.encode_windows([c.text for c in rows])  # as the gate pools them at ask time, unrounded
    assert np.abs(wholes - f32.encode([c.text for c in rows])).max() < 1e-5  # the same forward as the chunk's
    assert np.abs(np.asarray(idx.embeddings[:len(rows)], np.float32) - wholes).max() <= F16
    q = f32.encode(["What do barges carry on the Rhine?"])[0]
    for c, ask in zip(rows, pooled):
        got = np.asarray(idx.windows.rows(c.id), np.float32)
        assert got.shape == ask.shape and np.abs(got - ask).max() <= F16
        assert np.abs(got @ q - ask @ q).max() < 1e-3
    known = idx.windows.lookup(rows)
    assert all(t in known for c in rows for t in window_texts(c.text))


def test_incremental_reindex_embeds_only_new_chunks_windows(tmp_path, f32):
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    before = Index(target)
    old = {c.text: np.array(before.windows.rows(c.id)) for c in all_rows(before)}
    assert build_index(corpus, target, SMALL, embedder=f32, show_progress=False).up_to_date

    (corpus / "rivers.txt").write_text("The Nile is the longest river in Africa. It flows north.\n\nIt ends in the sea.")
    (corpus / "new.txt").write_text("Volcanoes erupt when magma reaches the surface. Lava then cools into rock.")
    s = build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    idx = Index(target)
    new_rows = [c for c in all_rows(idx) if c.document in {d.id for d in idx.store.documents()
                                                           if d.path in ("rivers.txt", "new.txt")}]
    fresh = {w for c in new_rows for w in window_texts(c.text)}
    assert s.windows_embedded == sum(len(window_texts(c.text)) for c in new_rows) > 0
    assert s.windows_reused == sum(len(old[c.text]) for c in all_rows(idx) if c not in new_rows) > 0
    for c in all_rows(idx):
        if c not in new_rows:  # the unchanged files' chunks kept their window vectors as they were
            assert np.array_equal(idx.windows.rows(c.id), old[c.text])
    assert len(idx.windows.lookup(new_rows)) == len(fresh)


def test_an_index_without_windows_gets_them_by_indexing_again(tmp_path, f32):
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    strip_windows(target)
    old = Index(target, verify=True)  # still a valid index
    assert old.windows is None
    s = build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    assert not s.up_to_date and s.embedded == 0 and s.reused == s.chunks  # chunk vectors reused
    assert s.windows_embedded > 0 and "no gate window vectors" in " ".join(s.notes)
    assert Index(target, verify=True).windows is not None
    assert build_index(corpus, target, SMALL, embedder=f32, show_progress=False).up_to_date


def test_counts_match_the_window_texts():
    for text in ["One. Two? Three!\nFour", "Just one", "  \n ", "a. b."]:
        assert windows.count_windows(text) == len(window_texts(text))


def test_a_text_over_the_limit_is_pooled_in_pieces_of_whole_sentences(f32):
    from ragspec.corpus.windows import window_spans

    sentences = [f"Sentence {i} says that river {i} carries barges of coal and grain to the sea." for i in range(60)]
    text = " ".join(sentences)
    assert len(f32.tokenizer(text)["input_ids"]) > f32.max_tokens
    _whole, (pooled,) = f32.encode_windows([text])
    assert pooled.shape == (len(window_spans(text)), f32.dim)
    assert np.allclose(np.linalg.norm(pooled, axis=1), 1, atol=1e-5)  # every window pooled, none cut off
    pieces = f32._pieces(text)
    assert len(pieces) > 1 and pieces[0][0] == 0 and pieces[-1][1] == len(text)
    assert all(b > c for (_, b), (c, _) in itertools.pairwise(pieces))  # neighbours share a sentence
    short, (alone,) = f32.encode_windows([sentences[0] + " " + sentences[1]])
    assert alone.shape == (1, f32.dim) and np.abs(short - f32.encode([sentences[0] + " " + sentences[1]])).max() < 1e-5


# -- at ask time: the gate and the budget read them ---------------------------------------------------------------
QUESTIONS = ["What do barges carry on the Rhine?", "Where does the Danube rise?", "How long should dough rise?",
             "What does mode 'a' do when opening a file?", "Who won the 1966 football world cup?"]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory, f32, smol):
    """Two pipelines over the same corpus: one index with stored windows, one built before them."""
    from serve_util import make_pipeline

    root = tmp_path_factory.mktemp("gate")
    corpus = write_corpus(root / "corpus")
    spec = {"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 8},
            "drafting": {"method": "suffix", "budget": 16}, "retriever": {"top_n": 3},
            "prompt": {"relevance_floor": "auto", "relevance_doubt": 0.6}}
    made = []
    for name in ("stored", "old"):
        target = root / name
        build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
        if name == "old":
            strip_windows(target)
        made.append(make_pipeline(target, f32, *smol, spec=spec))
    return made


def test_the_gate_pools_only_what_the_index_does_not_store(pipes, f32):
    """A source the index stores whole pools nothing; merged neighbours pool only the few sentences around each
    seam between their chunks (the window across it), never their whole text."""
    from ragspec.retrieve.windows import WindowScorer, _whole, seam_pieces, stored_vectors, windows

    stored, _ = pipes
    index = stored.retriever.index
    calls = []

    class Counting:  # the real embedder, keeping what it is given
        def encode(self, texts):
            calls.append(("encode", list(texts)))
            return f32.encode(texts)

        def encode_windows(self, texts):
            calls.append(("pool", list(texts)))
            return f32.encode_windows(texts)

    merged = 0
    for q in QUESTIONS:
        sources, _ = stored.retrieve(q)
        calls.clear()
        WindowScorer(lambda: Counting(), lambda: index).measure(q, sources)
        known = stored_vectors(index, sources)
        incomplete = [s for s in sources if not all(w in known for w in windows(s)) or _whole(s) not in known]
        seams = [piece for s in incomplete for piece, _ in seam_pieces(s.text, windows(s), known).values()]
        assert calls == [("encode", [q])] + ([("pool", seams)] if seams else [])
        for s in sources:
            if len(s.locations[0].chunk_ids) == 1:  # one chunk whole: every text it is judged by is stored
                assert all(w in known for w in windows(s)) and _whole(s) in known
            else:  # merged neighbours: their chunks' own vectors stand for the whole, never embedded here
                assert known[_whole(s)].shape[0] == len(s.locations[0].chunk_ids)
                assert s in incomplete
        merged += len(sources) - sum(len(s.locations[0].chunk_ids) == 1 for s in sources)
    assert merged  # the corpus has merged neighbours to read


def test_stored_windows_give_the_gate_and_the_budget_the_same_decisions(pipes):
    """Where every source is one chunk, the stored vectors are those an ask pools: the same scores and cuts as an
    index without them. Merged neighbours' windows inside a chunk take that chunk's context (stored) rather than
    the merged text's, so only the verdict is compared there."""
    stored, old = pipes
    exact = 0
    for q in QUESTIONS:
        a, b = stored.prepare(q), old.prepare(q)
        assert a.declined == b.declined
        assert stored.relevance_gate.unsure(a.relevance) == old.relevance_gate.unsure(b.relevance)
        if any(len(s.locations[0].chunk_ids) > 1 for s in stored.retrieve(q)[0]):
            continue
        exact += 1
        assert a.relevance == pytest.approx(b.relevance, abs=1e-3)
        assert a.built.ids == b.built.ids  # the same instruction and the same sources
        for budget in (1, 24, 60):  # the budget keeps the same windows
            assert stored.prepare(q, source_tokens=budget).built.ids == old.prepare(q, source_tokens=budget).built.ids
    assert exact
    assert any(stored.prepare(q).declined for q in QUESTIONS)
    assert not all(stored.prepare(q).declined for q in QUESTIONS)


def test_an_index_without_windows_still_answers_and_says_once_how_to_add_them(pipes, capsys):
    from ragspec.retrieve import windows as ask_windows

    _, old = pipes
    ask_windows._told.discard(str(old.retriever.index.folder))
    first = old.ask(QUESTIONS[0])
    again = old.ask(QUESTIONS[1])
    assert not first.declined and first.stats.new_tokens > 0 and again.stats.relevance is not None
    said = [line for line in capsys.readouterr().err.splitlines() if "gate windows" in line]
    assert len(said) == 1 and f"ragspec index {old.retriever.index.corpus_root} --out" in said[0]


def test_the_cli_says_what_it_embedded_and_info_whether_they_are_stored(tmp_path):
    from typer.testing import CliRunner

    from ragspec.cli import app

    runner, out = CliRunner(), tmp_path / "idx"
    corpus = write_corpus(tmp_path / "corpus")
    r = runner.invoke(app, ["index", str(corpus), "--out", str(out), "--chunk-tokens", "48", "--overlap", "8"])
    assert r.exit_code == 0 and "gate windows pooled (0 reused)" in r.output, r.output
    assert "gate windows stored (float16)" in runner.invoke(app, ["info", str(out)]).output
    strip_windows(out)
    r = runner.invoke(app, ["info", str(out)])
    assert f"none stored: each ask pools them; ragspec index {corpus} --out {out} adds them" in r.output, r.output
