"""A full disk during a build: one clear error, the previous index intact, no half-written version left."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import write_corpus

from ragspec.errors import RagspecError
from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import IndexSettings, RetrieverSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8)


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KB tmpfs (root only: mounting needs CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the full-disk case runs in CI as root")
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: an open SQLite handle may linger


def test_full_disk_keeps_the_previous_index(small_disk, tmp_path, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    target = small_disk / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    before = Index(target).folder
    for i in range(10):  # ~300 KB of text: the store (written before embedding) fills the disk, quickly
        (corpus / f"bulk{i}.txt").write_text(" ".join(f"word{i}_{j} alpha beta." for j in range(1200)))
    with pytest.raises(RagspecError, match=r"no space left on the device while writing .*previous index is unchanged"):
        build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    idx = Index(target, verify=True)
    assert idx.folder == before
    hits = Retriever(idx, RetrieverSettings(top_n=1), embedder=embedder).search("Black Sea")
    assert hits and hits[0].path.endswith("rivers.txt")
    assert not list(small_disk.glob(".idx.tmp-*"))
