"""Property-based corpus fuzzing: folders of random files always index, each skipped file gets one warning
line, and every stored chunk is its document's text[start:end]."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragspec.console import console, one_line
from ragspec.corpus.readers import SUPPORTED, TEXT_SUFFIXES
from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.settings import IndexSettings

SETTINGS = IndexSettings(chunk_tokens=128, overlap=16)
ENCODINGS = ["utf-8", "utf-8-sig", "latin-1", "cp1252", "utf-16", "shift_jis", "koi8_r", "gb18030"]
SUFFIXES = [".txt", ".md", ".rst", ".html", ".htm", ".json", ".jsonl", ".TXT", ".csv", ""]

names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1,
                max_size=16).filter(lambda s: not s.startswith(".") and ": " not in s and len(s.encode()) < 100)
words = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


def _jsonl(draw) -> bytes:
    lines = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["record", "record", "dup", "broken", "array", "blank"]))
        if kind == "record":
            lines.append(json.dumps({"_id": draw(st.sampled_from(["1", "2", "a"])), "title": draw(words),
                                     "text": draw(words)}))
        elif kind == "dup":
            lines.append(json.dumps({"_id": "1", "text": draw(words)}))
        elif kind == "broken":
            lines.append('{"_id": "x", "text": ' + draw(words)[:20])
        elif kind == "array":
            lines.append(json.dumps([draw(words)]))
        else:
            lines.append("")
    return "\n".join(lines).encode()


def _html(draw) -> bytes:
    parts = draw(st.lists(st.sampled_from(["<p>", "</p>", "<div", "<script>x=1", "</script>", "<!--", "-->",
                                           "<![CDATA[", "]]>", "<br/>", "<title>", "&amp", "&#99999999;", "<",
                                           ">", "<!DOCTYPE", "<a href='", "<?x", "<![if x]>"]) | words,
                          max_size=20))
    return "".join(parts).encode("utf-8", "replace")


@st.composite
def contents(draw, suffix: str) -> bytes:
    kind = draw(st.sampled_from(["text", "text", "bytes", "empty", "huge-line", "structured"]))
    if kind == "bytes":
        return draw(st.binary(max_size=2000))
    if kind == "empty":
        return draw(st.sampled_from([b"", b"   \n\n", b"\r\n"]))
    if kind == "huge-line":
        # long in characters, few in tokens (an over-long word is one [UNK] token; CJK would be one token per
        # character): the embedder stays fast
        unit = draw(st.sampled_from(["x", "é", "€", "word " * 50 + "\r\n"]))
        return (unit * draw(st.integers(1000, 100_000) if len(unit) < 9 else st.integers(1, 6))).encode()
    if kind == "structured" and suffix in (".json", ".jsonl"):
        if suffix == ".jsonl":
            return _jsonl(draw)
        records = [json.loads(x) for x in _jsonl(draw).decode().splitlines() if x.strip().endswith(("}", "]"))]
        return (json.dumps(records) if draw(st.booleans()) else json.dumps(records)[:-1]).encode()
    if kind == "structured" and suffix in (".html", ".htm"):
        return _html(draw)
    text = draw(words) + "\n\n" + draw(words)
    return text.encode(draw(st.sampled_from(ENCODINGS)), "replace")


@st.composite
def corpora(draw):
    """[(relative path, bytes)] plus links [(relative path, link target)]."""
    files = {}
    for _ in range(draw(st.integers(1, 6))):
        folder = draw(st.sampled_from(["", "sub/", "sub/deeper/", "dir with space/"]))
        suffix = draw(st.sampled_from(SUFFIXES))
        files[folder + draw(names) + suffix] = draw(contents(suffix))
    links = {}
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from(["OUTSIDE", "LOOP", "DANGLING", "DIR", "FILE", "OUTSIDE_DIR"]))
        links[draw(st.sampled_from(["", "sub/"])) + "link " + draw(names) + ".txt"] = target
    return files, links


def _write(root: Path, outside: Path, files: dict, links: dict) -> None:
    root.mkdir()
    (root / "anchor.txt").write_text("One readable document, so the index is never empty.")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (outside / "secret.txt").write_text("outside the corpus")
    for rel, kind in links.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            continue
        target = {"OUTSIDE": outside / "secret.txt", "LOOP": p, "DANGLING": root / "missing.txt",
                  "DIR": root, "FILE": root / "anchor.txt", "OUTSIDE_DIR": outside}[kind]
        os.symlink(target, p)


def _corpus_files(root: Path) -> list[str]:
    """Files (and links to files) the walk must account for: supported, not hidden, in visited folders."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (Path(dirpath) / d).is_symlink()]
        for f in filenames:
            if not f.startswith(".") and Path(f).suffix.lower() in SUPPORTED:
                found.append((Path(dirpath) / f).relative_to(root).as_posix())
    return found


@settings(max_examples=12, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(corpora())
def test_random_corpora_always_index(embedder, corpus):
    files, links = corpus
    base = Path(tempfile.mkdtemp(prefix="ragspec-fuzz-"))
    try:
        root, outside = base / "corpus", base / "outside"
        outside.mkdir()
        _write(root, outside, files, links)
        with console.capture() as cap:
            build_index(root, base / "idx", SETTINGS, embedder=embedder, show_progress=False)
        lines = cap.get().splitlines()
        idx = Index(base / "idx", verify=True)
        stored = {d.path for d in idx.store.documents()}
        for rel in _corpus_files(root):
            skips = [ln for ln in lines if ln.startswith(f"warning: skipped {one_line(rel)}: ")]
            if rel in stored:
                assert not skips, (rel, skips)
            else:
                assert len(skips) == 1, (rel, lines)
        for doc in idx.store.documents():
            text = idx.store.document_text(doc.id)
            for _, _, start, end, chunk in idx.store.chunks_of(doc.id):
                assert text[start:end] == chunk
            if Path(doc.path).suffix.lower() in TEXT_SUFFIXES:
                assert (root / doc.path).read_bytes().decode(doc.encoding) == text
        idx.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
