"""Every index file truncated or bit-flipped in turn: search, ask and the retrievers refuse with one clear line
(never a trace, never results), and `ragspec index` rebuilds the damaged index."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import write_corpus
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError
from ragspec.index import integrity
from ragspec.index.builder import build_index
from ragspec.index.manifest import MANIFEST
from ragspec.index.reader import Index
from ragspec.integrations.langchain import RagspecRetriever
from ragspec.retrieve.retriever import Retriever
from ragspec.settings import IndexSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8)
runner = CliRunner()


@pytest.fixture(scope="module")
def built(tmp_path_factory, embedder):
    root = tmp_path_factory.mktemp("corruption")
    corpus = write_corpus(root / "corpus")
    target = root / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    return corpus, Index(target).folder


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    at = {"flip-start": 0, "flip-middle": len(data) // 2, "flip-end": len(data) - 1}[how]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _refusals(index: Path, name: str) -> list[str]:
    """What each entry point did with a damaged index; an empty list means all refused properly."""
    wrong = []
    for cmd in (["search", str(index), "open a file for appending", "--json"],
                ["ask", "How do I open a file for appending?", "--index", str(index), "--no-stream"]):
        r = runner.invoke(app, cmd)
        lines = r.output.strip().splitlines()
        if (r.exit_code != 2 or len(lines) != 1 or not lines[0].startswith(f"error: index {index} is damaged")
                or name not in lines[0] or "rebuild" not in lines[0]):
            wrong.append(f"{cmd[0]}: exit {r.exit_code}, output {r.output[-300:]!r}, exception {r.exception!r}")
    for label, call in (("Retriever", lambda: Retriever(str(index)).search("appending")),
                        ("RagspecRetriever", lambda: RagspecRetriever(index=str(index)).invoke("appending"))):
        try:
            got = call()
            wrong.append(f"{label} answered {len(got)} results")
        except RagspecError as exc:
            if "damaged" not in str(exc) or name not in str(exc):
                wrong.append(f"{label}: unclear error {exc}")
        except Exception as exc:  # noqa: BLE001 — anything else is the bug this test looks for
            wrong.append(f"{label}: {type(exc).__name__}: {exc}")
    return wrong


@pytest.mark.parametrize("how", ["truncate", "flip-start", "flip-middle", "flip-end"])
def test_every_damaged_file_is_refused(built, tmp_path, how, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded for a damaged index")

    monkeypatch.setattr("ragspec.models.generator.shared_generator", no_model)
    monkeypatch.setattr("ragspec.models.embedder.load_embedder", no_model)
    _, folder = built
    names = _files(folder)
    assert MANIFEST in names and "faiss.index" in names and any(n.startswith("bm25/") for n in names)
    wrong = {}
    for i, name in enumerate(names):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(folder, copy)
        _damage(copy / name, how)
        problems = _refusals(copy, name)
        if problems:
            wrong[name] = problems
    assert not wrong


def test_sha256_once_per_file_version(built, tmp_path, monkeypatch):
    _, folder = built
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    from ragspec.models import registry

    calls = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    Index(copy)
    hashed = len(calls)
    assert hashed == len(_files(copy)) - 1  # every file but the manifest, which carries its own checksum
    Index(copy)
    Index(copy)
    assert len(calls) == hashed  # a long-lived process pays once
    Index(copy, verify=True)
    assert len(calls) == 2 * hashed  # --verify always re-hashes
    _damage(copy / "embeddings.npy", "flip-middle")  # same size, new mtime/ctime: hashed again, and caught
    with pytest.raises(integrity.IndexDamaged, match=r"embeddings.npy does not match its sha256"):
        Index(copy)


def test_index_rebuilds_a_damaged_index(tmp_path, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    target = tmp_path / "idx"
    build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    Index(target)  # cached as verified in this process
    _damage(Index(target).folder / "faiss.index", "flip-middle")
    r = runner.invoke(app, ["search", str(target), "appending"])
    assert r.exit_code == 2 and "faiss.index does not match its sha256" in r.output
    s = build_index(corpus, target, SMALL, embedder=embedder, show_progress=False)
    assert not s.up_to_date and s.embedded == s.chunks
    assert Retriever(Index(target, verify=True), embedder=embedder).search("appending")
