"""The command line: `index`, `search --json` (stable schema), `info`, `eval-retrieval`, errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ragspec.cli import app

runner = CliRunner()


def test_index_search_info_json(corpus, tmp_path):
    out = tmp_path / "idx"
    r = runner.invoke(app, ["index", str(corpus), "--out", str(out), "--chunk-tokens", "48", "--overlap", "8"])
    assert r.exit_code == 0, r.output
    assert "indexed" in r.output and "3 documents" in r.output
    r = runner.invoke(app, ["search", str(out), "how do I open a file for appending", "--json", "-k", "2"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["index"] == str(out) and doc["query"].startswith("how do I")
    assert len(doc["results"]) == 2
    for res in doc["results"]:
        assert {"rank", "score", "path", "start", "end", "text", "chunk_id"} <= set(res)
        with open(res["path"], encoding="utf-8", newline="") as f:
            assert f.read()[res["start"] : res["end"]] == res["text"]
    assert doc["results"][0]["path"] == str(corpus / "files.md")
    r = runner.invoke(app, ["info", str(out), "--json"])
    info = json.loads(r.stdout)
    assert info["manifest"]["counts"]["documents"] == 3
    assert any(s.startswith("dense") for s in info["stages"]) and "bm25" in info["stages"]
    assert any("no reranker" in s for s in info["stages"])
    r = runner.invoke(app, ["index", str(corpus), "--out", str(out), "--chunk-tokens", "48", "--overlap", "8"])
    assert "up to date" in r.output


def test_errors_are_one_line(tmp_path):
    r = runner.invoke(app, ["search", str(tmp_path / "missing"), "q"])
    assert r.exit_code == 2 and "no index at" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["index", str(tmp_path), "--overlap", "500"])
    assert r.exit_code == 2 and "overlap" in r.output
    r = runner.invoke(app, ["index", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_eval_retrieval_json(tmp_path):
    docs = [
        {"_id": "a", "title": "Rivers", "text": "The Danube flows into the Black Sea."},
        {"_id": "b", "title": "Bread", "text": "Knead the dough and bake it in a hot oven."},
        {"_id": "c", "title": "Files", "text": "Open a file in append mode to add to its end."},
    ]
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "queries.jsonl").write_text(
        "\n".join(json.dumps(q) for q in [{"_id": "1", "text": "where does the Danube end"},
                                         {"_id": "2", "text": "baking bread"}])
    )
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n1\ta\t1\n2\tb\t1\n")
    r = runner.invoke(app, ["eval-retrieval", "--corpus", str(tmp_path / "corpus.jsonl"), "--queries",
                            str(tmp_path / "queries.jsonl"), "--qrels", str(tmp_path / "qrels.tsv"), "--out",
                            str(tmp_path / "ev"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    for stage in ("dense", "bm25", "hybrid", "sources"):
        assert set(res["stages"][stage]) == {"ndcg@10", "recall@100", "mrr@10"}
    assert res["stages"]["hybrid"]["ndcg@10"] == 1.0
    assert res["stages"]["sources"]["ndcg@10"] == 1.0  # what an ask gets, after source building
    assert "ann_recall@10" in res


def test_ray_options_need_the_ray_executor(tmp_path):
    r = runner.invoke(app, ["index", str(tmp_path), "--embed-actors", "2"])
    assert r.exit_code != 0 and "go with --executor ray" in r.output
    r = runner.invoke(app, ["index", str(tmp_path), "--executor", "spark"])
    assert r.exit_code != 0 and "--executor must be local or ray" in r.output
    r = runner.invoke(app, ["serve", "--index", str(tmp_path), "--replicas", "2"])
    assert r.exit_code != 0 and "go with --executor ray" in r.output


def test_the_script_exits_as_python_would_without_its_teardown(tmp_path):
    """`ragspec` skips the module teardown (cli.exit_without_teardown) but keeps a normal exit's steps: a thread
    still running is joined, atexit handlers run, buffered output reaches a pipe, and the exit code is the command's."""
    import subprocess
    import sys

    script = """
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined"))).start()
sys.argv = ["ragspec"] + sys.argv[2:]
from ragspec.cli import main
main()
"""
    for args, code in ((["search", str(tmp_path / "none"), "q"], 2), (["--help"], 0)):
        for f in ("atexit", "thread"):
            (tmp_path / f).unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path), *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == code, done.stderr
        assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
        if code == 0:
            assert "index" in done.stdout and "serve" in done.stdout  # every command listed, through a pipe
        else:
            assert done.stderr.count("\n") == 1 and "no index" in done.stderr
