"""The relevance gate's window vectors stored with the index (index/windows.py): equal to what an ask embeds,
incremental like the chunk vectors, added to an index built before them by indexing again. Real MiniLM (float32,
so that ask-time embeddings do not move with the batch), real index in a tmp folder."""

from __future__ import annotations

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


def test_stored_windows_equal_those_an_ask_embeds(tmp_path, f32):
    target = tmp_path / "idx"
    s = build_index(write_corpus(tmp_path / "corpus"), target, SMALL, embedder=f32, show_progress=False)
    idx = Index(target, verify=True)
    entry = idx.manifest["embedder"]["windows"]
    assert entry["dtype"] == "float16" and entry["rows"] == len(idx.windows.vectors) > 0
    rows = all_rows(idx)
    texts = [w for c in rows for w in window_texts(c.text, c.title)]
    assert entry["rows"] == len(texts) and s.windows_embedded == len(set(texts)) and s.windows_reused == 0
    assert all(c.title for c in rows)  # every chunk here has titled windows too
    known = idx.windows.lookup(rows)
    ask = f32.encode(texts)  # as the gate embeds them at ask time: another batch, unrounded
    got = np.stack([known[t] for t in texts])
    assert np.abs(got - ask).max() <= F16
    q = f32.encode(["What do barges carry on the Rhine?"])[0]
    assert np.abs(got @ q - ask @ q).max() < 1e-3
    assert np.argmax(got @ q) == np.argmax(ask @ q)


def test_incremental_reindex_embeds_only_new_chunks_windows(tmp_path, f32):
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    before = Index(target)
    old = {(c.text, c.title): np.array(before.windows.rows(c.id)) for c in all_rows(before)}
    assert build_index(corpus, target, SMALL, embedder=f32, show_progress=False).up_to_date

    (corpus / "rivers.txt").write_text("The Nile is the longest river in Africa. It flows north.\n\nIt ends in the sea.")
    (corpus / "new.txt").write_text("Volcanoes erupt when magma reaches the surface. Lava then cools into rock.")
    s = build_index(corpus, target, SMALL, embedder=f32, show_progress=False)
    idx = Index(target)
    new_rows = [c for c in all_rows(idx) if c.document in {d.id for d in idx.store.documents()
                                                           if d.path in ("rivers.txt", "new.txt")}]
    fresh = {w for c in new_rows for w in window_texts(c.text, c.title)}
    assert s.windows_embedded == len(fresh) > 0
    assert s.windows_reused == sum(len(old[c.text, c.title]) for c in all_rows(idx) if c not in new_rows) > 0
    for c in all_rows(idx):
        if c not in new_rows:  # the unchanged files' chunks kept their window vectors as they were
            assert np.array_equal(idx.windows.rows(c.id), old[c.text, c.title])
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
    for text, title in [("One. Two? Three!\nFour", "T"), ("Just one", ""), ("  \n ", "T"), ("a. b.", " ")]:
        assert windows.count_windows(text, title) == len(window_texts(text, title))
