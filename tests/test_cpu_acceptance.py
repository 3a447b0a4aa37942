"""The CPU acceptance run (examples/cpu_acceptance.sh) a session on a new CPU starts from: every command it would
run exists with the options it passes (its dry run, checked against each command's own --help), so that session
spends its time measuring, not mending the script."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from conftest import REPO

STAGES = ["flags", "verifier", "bench", "ttft", "first", "quality"]


def _help(argv: list[str]) -> str:
    env = dict(os.environ, COLUMNS="300")
    r = subprocess.run(argv + ["--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def test_every_command_of_the_acceptance_run_takes_its_options(tmp_path):
    env = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"))
    r = subprocess.run(["bash", str(REPO / "examples/cpu_acceptance.sh"), *STAGES], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line[2:].rsplit(" > ", 1)[0] for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) >= 20 and not (tmp_path / "out").exists()  # a dry run writes nothing
    helps: dict[tuple, str] = {}
    checked = set()
    for line in lines:
        if line.startswith(("bash -c", "first asks of")):
            continue
        argv = shlex.split(line)
        if argv[0].endswith("bin/ragspec"):
            key = (sys.executable, "-m", "ragspec.cli", argv[1])
        elif argv[1] == "-m":
            key = (sys.executable, "-m", argv[2])
        else:
            assert (REPO / argv[1]).exists(), argv[1]
            key = (sys.executable, argv[1])
        if key not in helps:
            helps[key] = _help(list(key))
        for opt in (a for a in argv if re.fullmatch(r"--[a-z][a-z0-9-]*", a)):
            assert opt in helps[key], (line, opt)
            checked.add((key[-1], opt))
    assert ("bench", "--methods") in checked and ("eval-answers", "--retrieve") in checked
    assert ("ragspec.bench.verifier", "--interleave") in checked and ("examples/source_stats.py", "--ttft") in checked
    assert ("examples/prompt_reuse_stats.py", "--pipeline") in checked
