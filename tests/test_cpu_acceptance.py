"""The CPU acceptance run (examples/cpu_acceptance.sh) a session on a new CPU starts from: every command it would
run exists with the options it passes (its dry run, checked against each command's own --help), so that session
spends its time measuring, not mending the script."""

from __future__ import annotations

import json
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


def test_the_avx2_emulation_hides_the_wider_units_from_ragspec(tmp_path):
    """examples/avx2_emulation: a process started with it sees an AVX2-only CPU, builds its kernels for a Zen 3 and
    keeps them in a home of its own (checked without building: the build takes ~20 s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAGSPEC_HOME", "ATEN_CPU_CAPABILITY")}
    env.update(PYTHONPATH=str(REPO / "examples/avx2_emulation"), HOME=str(tmp_path))
    code = ("import json, os; from ragspec.cpu_flags import cpu_flags, native_int8, read_cpuinfo; "
            "from ragspec.runtime.gguf_kernel import FLAGS; from ragspec.paths import ragspec_home; "
            "print(json.dumps([sorted(cpu_flags()), native_int8(), read_cpuinfo()[0], FLAGS, str(ragspec_home()), "
            "os.environ['ATEN_CPU_CAPABILITY']]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    flags, int8, model, build, home, aten = json.loads(r.stdout)
    assert not [f for f in flags if f.startswith(("avx512", "amx", "avx_vnni"))] and not int8
    assert model.endswith("[AVX2 emulation]") and "-march=znver3" in build and "-march=native" not in build
    assert home == str(tmp_path / ".cache" / "ragspec-avx2") and aten == "avx2"
