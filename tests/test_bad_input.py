"""Bad input found by hand (issue 17): repeated JSONL keys, odd file names, a parser failing on one file."""

from __future__ import annotations

import json
import os

from ragspec.console import console, one_line
from ragspec.corpus.loader import ScanReport, iter_documents, walk
from ragspec.corpus.readers import json_records
from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.settings import IndexSettings

SMALL = IndexSettings(chunk_tokens=48, overlap=8)


def test_repeated_keys_are_kept_under_new_keys_with_a_problem_line():
    lines = [{"_id": "1", "text": "alpha"}, {"_id": "1", "text": "beta"}, {"_id": "1@line2", "text": "gamma"},
             {"_id": "1", "text": "delta"}]
    records, problems = json_records("\n".join(json.dumps(x) for x in lines), ".jsonl")
    assert [r.key for r in records] == ["1", "1@line2", "1@line2@line3", "1@line4"]
    assert [r.text for r in records] == ["alpha", "beta", "gamma", "delta"]
    assert problems[0] == "line 2: duplicate key '1' (first on line 1); kept as '1@line2'"
    assert len(problems) == 3
    records, problems = json_records(json.dumps(lines[:2]), ".json")
    assert [r.key for r in records] == ["1", "1@record2"] and problems[0].startswith("record 2: duplicate key '1'")


def test_index_with_repeated_keys_completes(tmp_path, embedder):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id":"1","text":"The Danube flows east."}\n{"_id":"1","text":"Bread needs yeast."}\n')
    with console.capture() as cap:
        s = build_index(corpus, tmp_path / "idx", SMALL, embedder=embedder, show_progress=False)
    assert s.documents == 2
    assert "c.jsonl: line 2: duplicate key '1' (first on line 1); kept as '1@line2'" in cap.get()
    assert sorted(d.key for d in Index(tmp_path / "idx").store.documents()) == ["1", "1@line2"]


def test_odd_file_names_give_one_plain_warning_line(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "ok.txt").write_text("fine")
    (root / "[red]x[\ny.txt").write_text("")
    os.close(os.open(os.path.join(os.fsencode(root), b"bad\xff.txt"), os.O_CREAT | os.O_WRONLY))
    report = ScanReport()
    docs = list(iter_documents(root, report))
    assert [d.rel for d in docs] == ["ok.txt"]
    reasons = dict(report.skipped)
    assert reasons["bad\udcff.txt"].startswith("file name is not valid UTF-8")
    assert reasons["[red]x[\ny.txt"] == "empty file"
    with console.capture() as cap:
        from ragspec.console import warn

        warn("skipped [red]x[\ny.txt: empty file")
    assert cap.get() == "warning: skipped [red]x[\\ny.txt: empty file\n"
    assert one_line("a\tb\udcff") == "a\\tb\\udcff"


def test_a_parser_crash_skips_the_file_not_the_run(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.html").write_text("<p>page</p>")
    (root / "b.txt").write_text("text")

    def boom(markup):
        raise AssertionError("parser bug")

    monkeypatch.setattr("ragspec.corpus.readers.html_to_text", boom)
    report = ScanReport()
    assert [d.rel for d in iter_documents(root, report)] == ["b.txt"]
    assert report.skipped == [("a.html", "unreadable (AssertionError: parser bug)")]
    assert [f.rel for f in walk(root, ScanReport())] == ["a.html", "b.txt"]
