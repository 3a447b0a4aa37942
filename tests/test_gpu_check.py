"""The GPU device check (examples/gpu_check.sh) runs end to end on the CPU too: every stage that needs no
carried payload, in its quick sizes, with the CUDA tests skipping. What it writes is what the device's run
writes, so a session with a GPU lent starts from a script that works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, write_corpus

pytestmark = pytest.mark.slow


def test_device_check_runs_on_the_cpu(tmp_path):
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("summarization", "Summarize: The Danube flows through ten countries, more "
                                           "than any other river. It rises in the Black Forest."),
                                          ("rag", "Passage: Mode 'a' opens a file for appending.\nWhat does mode "
                                           "'a' do?")])))
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE="cpu", QUICK="1", OUT=str(out), PROMPTS=str(prompts), PYTHON=sys.executable,
               CORPUS=str(write_corpus(tmp_path / "corpus")), WORK=str(tmp_path / "work"))
    r = subprocess.run(["bash", str(REPO / "examples/gpu_check.sh"), "env", "curve", "profile", "tests", "bench", "index",
                        "load", "summary"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(exit 1)" not in r.stdout and "(exit 2)" not in r.stdout, r.stdout[-3000:]
    curve = json.loads((out / "curve-tiny-float32-cpu.json").read_text())
    assert curve["cost_model"]["sizes"][0] == 1 and curve["plain_step_ms"]["static"]["steps"] > 0
    assert curve["plain_step_ms"]["dynamic"]["steps"] > 0 and len(curve["static"]["ms_measured"]) == len(
        curve["ms_measured"])
    assert "Self CPU" in (out / "profile-tiny-float32-cpu.txt").read_text()  # the profiler's table
    bench = json.loads((out / "bench-smollm2-cpu.json").read_text())
    for cat in ("summarization", "rag"):
        assert bench["categories"][cat]["methods"]["suffix"]["identical"] == 1
    index = json.loads((out / "index-cpu.json").read_text())
    assert index["runs"]["cpu"]["chunks"] > 0 and index["search_on_cpu"] == "faiss (cpu)"
    load = json.loads((out / "load-cpu.json").read_text())
    assert [(row["clients"], row["identical"]) for row in load["rows"]] == [(1, 1), (3, 3)]
    assert load["rows"][1]["batches"] > 0 and load["verifier"] == "transformers static cache"
    assert "tests: tests" in r.stdout and "bench rag" in r.stdout and "load (" in r.stdout  # the summary's lines
