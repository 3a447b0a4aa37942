"""kill -9 of `ragspec index` at random moments (seeded): the previous version stays searchable and verifies,
and the next run completes and cleans up."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, write_corpus

from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import IndexSettings, RetrieverSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_at_a_random_moment(tmp_path, embedder, seed):
    rng = random.Random(seed)
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "indexes" / "corpus"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    before = Index(target).folder
    for i in range(6):
        (corpus / f"bulk{i}.txt").write_text(" ".join(f"word{i}_{j} alpha beta." for j in range(100)))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "ragspec.cli", "index", str(corpus), "--out", str(target), "--chunk-tokens", "48",
           "--overlap", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    try:
        if seed == 0:  # while starting up and reading
            time.sleep(rng.uniform(0.5, 3.0))
        else:  # somewhere from the first write on: store, embedding, FAISS, BM25, manifest, publish, prune
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline and not list(target.parent.glob(".corpus.tmp-*")):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 4.0))
    finally:
        finished = proc.poll() is not None
        if not finished:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    published = Index(target).folder != before
    print(f"seed {seed}: {'finished before the kill' if finished else 'killed'}, "
          f"{'new version published' if published else 'previous version current'}")
    idx = Index(target, verify=True)
    hits = Retriever(idx, RetrieverSettings(top_n=1), embedder=embedder).search("Black Sea")
    assert hits and hits[0].path.endswith("rivers.txt")
    s = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert s.documents == 9
    assert not list(target.parent.glob(".corpus.tmp-*")) and not list(target.parent.glob(".corpus.link-*"))
    assert len(list(target.parent.glob(".corpus@*"))) <= 2
    Index(target, verify=True)
