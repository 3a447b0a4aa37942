"""`--executor ray`: indexing as a Ray Data stage and serving as Ray Serve replicas, on a local Ray
(`num_cpus=2`) that this module starts and stops. Skipped where the `ray` extra is not installed."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ragspec.errors import RagspecError  # noqa: E402 - after the skip that guards them
from ragspec.index.builder import build_index  # noqa: E402
from ragspec.settings import IndexSettings  # noqa: E402

SETTINGS = IndexSettings(embedder="all-minilm-l6-v2", index_type="flat", chunk_tokens=128, overlap=16)
QUERIES = [
    "What does the global statement do?", "How are default argument values evaluated?",
    "What happens when an exception is raised in a finally clause?", "How does assert behave with -O?",
    "Which operators can be overloaded for arithmetic?", "What is an augmented assignment?",
    "How do attribute references work on class instances?", "What does the break statement do in a loop?",
    "How are binary bitwise operations defined?", "How are Boolean operations short-circuited?",
    "What is a code object?", "How does the async for statement iterate?", "What is the await expression?",
    "How do you call a function with keyword arguments?", "What does the assignment statement bind?",
    "How is a class definition executed?", "What are atoms in expressions?", "How does comparison chaining work?",
    "What is an asynchronous context manager?", "What does the continue statement do?",
]


def pydoc_corpus(folder: Path, n: int) -> Path:
    """The first `n` pydoc topics (real CPython text), one file each."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(topics)[:n]:
        (folder / f"{name}.txt").write_text(topics[name], encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return pydoc_corpus(tmp_path_factory.mktemp("ray") / "pydoc", 20)


def store_rows(index_path: Path):
    """Documents and chunks as the store holds them (ids, offsets, text) — what both builds must share."""
    from ragspec.index.reader import Index

    idx = Index(index_path)
    db = sqlite3.connect(idx.folder / "store.sqlite")
    try:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
        chunk_cols = [r[1] for r in db.execute("pragma table_info(chunks)")]
        doc_cols = [c for c in (r[1] for r in db.execute("pragma table_info(documents)")) if c not in ("mtime",)]
        chunks = db.execute(f"select {','.join(chunk_cols)} from chunks order by id").fetchall()
        documents = db.execute(f"select {','.join(doc_cols)} from documents order by id").fetchall()
    finally:
        db.close()
    settings = {k: v for k, v in idx.manifest.items() if k not in ("created", "files", "corpus", "checksum")}
    idx.close()
    assert "chunks" in tables and chunks
    return documents, chunks, settings


def top_ids(index_path: Path, k: int, embedder) -> list[list[int]]:
    """The index's own top-k chunk ids for each query (FAISS, before any fusion or merging)."""
    from ragspec.index import faiss_index
    from ragspec.index.reader import Index

    idx = Index(index_path)
    queries = np.stack([embedder.encode_query(q) for q in QUERIES])
    _, ids = faiss_index.search(idx.faiss, queries, k)
    idx.close()
    return ids.tolist()


def test_ray_build_equals_the_local_build(local_ray, docs, tmp_path):
    """The same index from Ray actors as from one process. In float32: the actors embed other batches than the
    local build, and bf16 embeddings move with the batch by an ulp where the CPU's kernels are not row-independent
    (oneDNN's AVX-512 BF16 path on an Intel Xeon flipped a near-tie at rank 5), which is not what this tests."""
    from ragspec.cluster.indexing import RayExecutor
    from ragspec.models.embedder import load_embedder

    settings = SETTINGS.model_copy(update={"embed_dtype": "float32"})
    embedder = load_embedder("all-minilm-l6-v2", "cpu", "float32", 256)

    local = build_index(docs, tmp_path / "local", settings, embedder=embedder, show_progress=False)
    on_ray = build_index(docs, tmp_path / "ray", settings, show_progress=False,
                         executor=RayExecutor(embed_actors=2))
    assert (on_ray.documents, on_ray.chunks, on_ray.embedded) == (local.documents, local.chunks, local.chunks)
    assert store_rows(tmp_path / "ray") == store_rows(tmp_path / "local")
    assert top_ids(tmp_path / "ray", 5, embedder) == top_ids(tmp_path / "local", 5, embedder)

    # IVF twins of each (their own vectors, re-used): recall@10 of the Ray one against the local one
    ivf = settings.model_copy(update={"index_type": "auto", "faiss_factory": "IVF2,Flat", "nprobe": 1})
    for name in ("local", "ray"):
        s = build_index(docs, tmp_path / f"{name}-ivf", ivf, show_progress=False, reuse_from=tmp_path / name)
        assert s.embedded == 0 and s.factory == "IVF2,Flat"
    a, b = top_ids(tmp_path / "local-ivf", 10, embedder), top_ids(tmp_path / "ray-ivf", 10, embedder)
    recall = np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b)])
    assert recall >= 0.99, recall

    # incremental: only the changed file goes to the cluster
    first = min(docs.iterdir())
    changed = tmp_path / "changed"
    changed.mkdir()
    for p in docs.iterdir():
        (changed / p.name).write_text(p.read_text(encoding="utf-8") + ("\n\nEdited." if p == first else ""),
                                      encoding="utf-8")
    s = build_index(changed, tmp_path / "ray", settings, show_progress=False, executor=RayExecutor())
    assert (s.changed, s.added, s.deleted) == (1, 0, 0)  # same relative paths: files compare by content
    assert s.reused + s.embedded == s.chunks and 0 < s.embedded < s.chunks


def ray_worker_pids(tag: str) -> list[int]:
    """Processes whose title names `tag` (Ray titles an actor process `ray::<its class>`)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if tag in cmd and cmd.startswith("ray::"):
                out.append(int(d))
    return out


def test_killed_worker_mid_build_completes_or_keeps_the_previous_index(local_ray, docs, tmp_path, embedder):
    from ragspec.cluster.indexing import RayExecutor
    from ragspec.index.reader import Index

    target = tmp_path / "idx"
    small = pydoc_corpus(tmp_path / "small", 5)
    build_index(small, target, SETTINGS, embedder=embedder, show_progress=False)
    before = store_rows(target)
    result: dict = {}

    def run():
        try:
            result["summary"] = build_index(docs, target, SETTINGS, show_progress=False,
                                            executor=RayExecutor(embed_actors=2))
        except RagspecError as exc:
            result["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    killed = None
    deadline = time.monotonic() + 120
    while worker.is_alive() and killed is None and time.monotonic() < deadline:
        pids = ray_worker_pids("ChunkEmbed")
        if pids:
            time.sleep(2.0)  # let it load the embedder and take a batch
            for pid in ray_worker_pids("ChunkEmbed") if worker.is_alive() else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended between the listing and the kill (seen in CI): the next
                    continue
                killed = pid
                break
        time.sleep(0.1)
    worker.join(timeout=300)
    assert not worker.is_alive()
    assert killed is not None, "the build ended before a worker could be killed"
    print(f"killed ray worker {killed}: " + ("build completed" if "summary" in result else f"{result['error']}"))
    if "summary" in result:  # Ray restarted the actor and retried its batches
        local = build_index(docs, tmp_path / "local", SETTINGS, embedder=embedder, show_progress=False)
        assert store_rows(target)[1] == store_rows(tmp_path / "local")[1]
        assert result["summary"].chunks == local.chunks
    else:  # a clean failure: the previous version is still the index, and no half build is left
        assert store_rows(target) == before
        assert not [p for p in target.parent.iterdir() if "tmp" in p.name]
    Index(target).close()


def load_module():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_two_serve_replicas_answer_8_clients_as_each_question_alone(local_ray, tmp_path, embedder):
    """Ray Serve replicas of `ragspec serve` behind its proxy: the same OpenAI API, and 8 concurrent clients get
    the answers each question gets asked alone (whichever replica answers either)."""
    from serve_util import SPEC, build_test_index, quiet_port

    from ragspec.cluster import serving
    from ragspec.spec import load_spec

    load = load_module()
    index = build_test_index(tmp_path, embedder)
    spec = load_spec(SPEC | {"serve": {"queue_size": 8}})
    model = SPEC["generator"]["model"]
    try:
        url = serving.start(index, spec, replicas=2, port=quiet_port())
        from ray import serve

        assert serve.status().applications[serving.APP_NAME].deployments["ragspec"].replica_states == {"RUNNING": 2}
        two = load.run_load(url, model, load.DEFAULT_QUESTIONS, clients=8, requests=8, max_tokens=24)
    finally:
        serving.stop()
    assert two["errors"] == 0, two["error_samples"]
    assert two["completed"] == two["identical"] == 8


def test_source_cache_filled_on_ray_actors(local_ray, tmp_path, monkeypatch):
    """`--kv-cache --executor ray`: entries computed on an actor are written to this machine's store, and an ask
    here reuses them as it would its own."""
    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path))
    from ragspec.cluster.kv_fill import fill_on_ray
    from ragspec.pipeline import Pipeline

    spec = {"generator": {"model": "smollm2-135m-instruct", "dtype": "float32", "max_new_tokens": 8,
                          "source_cache": "on"},
            "prompt": {"relevance_floor": "off"}}
    texts = ["Tea is grown on hillsides in Assam and Darjeeling.", "Coffee cherries are picked by hand."]
    pipe = Pipeline(spec)
    made = fill_on_ray(pipe.spec.model_dump(), None, texts, pipe.source_store, actors=1)
    assert made == 3  # the head and two pieces
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 3
    assert pipe.fill_source_cache(texts) == 0  # all held here: nothing left to compute
    a = pipe.ask("Where is tea grown?", documents=texts)
    assert a.stats.cache_stored_tokens == 0 and a.stats.cache_reused_tokens > 0
