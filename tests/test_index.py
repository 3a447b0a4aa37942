"""Index building with the real MiniLM embedder and real FAISS: offsets, incremental updates, atomic swaps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_corpus

from ragspec.errors import RagspecError
from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import IndexSettings, RetrieverSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8)


def slice_source(hit) -> str:
    with open(hit.path, encoding="utf-8", newline="") as f:
        return f.read()[hit.start : hit.end]


def test_build_and_search_offsets_slice_the_source(corpus, tmp_path, embedder):
    target = tmp_path / "indexes" / "corpus"
    s = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert s.documents == 3 and s.chunks >= 3 and s.embedded == s.chunks
    assert target.is_symlink()
    idx = Index(target, verify=True)
    assert idx.manifest["faiss"]["factory"] == "Flat"
    assert idx.manifest["embedder"]["dimension"] == 384
    r = Retriever(idx, RetrieverSettings(top_n=3), embedder=embedder)
    hits = r.search("how do I open a file for appending")
    assert hits[0].path.endswith("files.md")
    for h in hits:
        assert slice_source(h) == h.text
        assert Path(h.path).is_file()
    assert [h.rank for h in hits] == [1, 2, 3]
    dense = Retriever(idx, RetrieverSettings(mode="dense", top_n=1), embedder=embedder).search("Black Sea river")
    assert dense[0].path.endswith("rivers.txt")
    bm = Retriever(idx, RetrieverSettings(mode="bm25", top_n=1), embedder=embedder).search("knead dough")
    assert bm[0].path.endswith("bread.rst")


def test_incremental_reembeds_only_changes(corpus, tmp_path, embedder):
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    again = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert again.up_to_date and again.embedded == 0
    old_vectors = np.load(Index(target).folder / "embeddings.npy")

    (corpus / "rivers.txt").write_text("The Nile is the longest river in Africa.\n\nIt flows north into the sea.")
    (corpus / "new.txt").write_text("Volcanoes erupt when magma reaches the surface.")
    (corpus / "sub" / "bread.rst").unlink()
    s = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert (s.added, s.changed, s.deleted) == (1, 1, 1)
    idx = Index(target)
    paths = sorted(d.path for d in idx.store.documents())
    assert paths == ["files.md", "new.txt", "rivers.txt"]
    files_chunks = [c for c in idx.store.documents() if c.path == "files.md"]
    assert files_chunks
    # the unchanged file kept its vectors
    new_vectors = np.load(idx.folder / "embeddings.npy")
    n_files = len(idx.store.chunks_of(files_chunks[0].id))
    assert np.array_equal(new_vectors[:n_files], old_vectors[:n_files])
    assert s.embedded < s.chunks
    hits = Retriever(idx, RetrieverSettings(top_n=1), embedder=embedder).search("longest river in Africa")
    assert hits[0].path.endswith("rivers.txt") and slice_source(hits[0]) == hits[0].text
    # a touched (mtime-only) file is re-hashed, not re-embedded
    os.utime(corpus / "new.txt", (time.time() + 5, time.time() + 5))
    t = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert t.embedded == 0 and not t.up_to_date
    assert build_index(corpus, target, SMALL, embedder=embedder, show_progress=False).up_to_date
    assert len(list(target.parent.glob(".idx@*"))) <= 2  # old versions are pruned


def test_changed_settings_rebuild_everything(corpus, tmp_path, embedder):
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    s = build_index(corpus, target, IndexSettings(chunk_tokens=64, overlap=8), embedder=embedder, show_progress=False)
    assert s.embedded == s.chunks and "re-embedding everything" in " ".join(s.notes)


def test_refuses_to_clobber_a_foreign_folder(corpus, tmp_path, embedder):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "precious.txt").write_text("do not delete")
    with pytest.raises(RagspecError, match="not a ragspec index"):
        build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert (target / "precious.txt").read_text() == "do not delete"


def test_missing_corpus_and_index_errors(tmp_path):
    with pytest.raises(RagspecError, match="does not exist"):
        build_index(tmp_path / "nope", tmp_path / "idx", SMALL)
    with pytest.raises(RagspecError, match="no index at"):
        Index(tmp_path / "nothing")


def test_damaged_index_is_reported(corpus, tmp_path, embedder):
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    faiss_file = Index(target).folder / "faiss.index"
    faiss_file.write_bytes(faiss_file.read_bytes()[:10])
    with pytest.raises(RagspecError, match="damaged"):
        Index(target)


def test_sigkill_mid_embedding_keeps_previous_index(tmp_path, embedder):
    """Kill `ragspec index` while it embeds: the old version stays searchable, and a re-run finishes."""
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "indexes" / "corpus"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    before = Index(target).folder
    # enough new text that embedding takes tens of seconds (~35 s on a 2-core Zen 3; it is killed ~1 s in)
    for i in range(40):
        words = " ".join(f"token{i}_{j} alpha beta gamma." for j in range(30))
        (corpus / f"bulk{i:02d}.txt").write_text(words)
    cmd = [sys.executable, "-m", "ragspec.cli", "index", str(corpus), "--out", str(target), "--chunk-tokens", "48",
           "--overlap", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        tmps = list(target.parent.glob(".corpus.tmp-*"))
        if tmps and (tmps[0] / "store.sqlite").exists():  # the store is written: embedding has begun
            time.sleep(1.0)
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the build finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(target.parent.glob(".corpus.tmp-*")), "the killed build left its temporary folder"
    idx = Index(target, verify=True)
    assert idx.folder == before
    hits = Retriever(idx, RetrieverSettings(top_n=1), embedder=embedder).search("Black Sea")
    assert hits and hits[0].path.endswith("rivers.txt")
    s = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert s.added == 40 and not list(target.parent.glob(".corpus.tmp-*"))
    assert "interrupted" in " ".join(s.notes)


def test_reuse_from_seeds_a_twin_without_embedding(corpus, tmp_path, embedder):
    a = tmp_path / "exact"
    build_index(corpus, a, SMALL, embedder=embedder, show_progress=False)
    b = tmp_path / "twin"
    s = build_index(corpus, b, SMALL.model_copy(update={"index_type": "flat", "nprobe": 8}), embedder=embedder,
                    show_progress=False, reuse_from=a)
    assert not s.up_to_date and s.embedded == 0 and s.reused == s.chunks
    twin = Index(b)
    assert twin.store.count_chunks() == Index(a).store.count_chunks()
    hits = Retriever(twin, RetrieverSettings(top_n=1), embedder=embedder).search("knead the dough")
    assert hits[0].path.endswith("bread.rst")
