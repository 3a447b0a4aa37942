"""The background measurement of this machine never competes with the user: markers of user work shared by
every ragspec process (ragspec/activity.py), a measuring child stopped within a second while one is held and
continued once the machine is quiet (machine/measure.py), and candidates a rule leaves unmeasured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ragspec import activity
from ragspec.machine import table as machine
from ragspec.machine.measure import run_child

SMOL = "smollm2-135m-instruct"
HOLD = "import sys, time; from ragspec import activity\nwith activity.busy(sys.argv[1]):\n    print('held', flush=True); time.sleep(float(sys.argv[2]))"


def hold(what: str, seconds: float) -> subprocess.Popen:
    """Another process doing `what` for the user for `seconds` (its marker held once it prints)."""
    root = str(Path(__file__).resolve().parents[1])
    p = subprocess.Popen([sys.executable, "-c", HOLD, what, str(seconds)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=root))
    assert p.stdout.readline().strip() == "held"
    return p


def test_markers_are_seen_by_other_processes_and_dead_ones_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path))
    with activity.busy("an ask here"):
        assert activity.active() == [f"an ask here (process {os.getpid()})"]
        assert activity.active((os.getpid(),)) == []  # a process ignores its own work
    assert activity.active() == []
    other = hold("an ask elsewhere", 30)
    assert activity.active() == [f"an ask elsewhere (process {other.pid})"]
    other.kill()  # dies holding its marker: the marker is ignored and removed
    other.wait()
    assert activity.active() == [] and not any((tmp_path / "activity").iterdir())


def _cpu_s(pid: int) -> tuple[float, str]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]


def test_a_running_measurement_stops_within_a_second_for_an_ask_and_resumes(tmp_path, monkeypatch):
    """A real measuring child (SmolLM2 on dtype gguf): once another process starts an ask, the child is stopped
    within a second and uses no CPU while the ask runs (so the ask's steps are not slowed); once the machine is
    quiet it resumes and finishes, its figures measured in slices the pause never landed in."""
    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path / "home"))  # markers only; models from the usual cache
    pids, lines, out = [], [], {}
    cpu = machine.cpu_info()
    gguf = next(c for c in machine.CANDIDATES if c.name == "transformers/gguf")
    dtype = "gguf" if gguf.needs(cpu, SMOL) is None else "float32"

    def measure():
        out["row"] = run_child(SMOL, "transformers", dtype, cpu["threads"], lines.append, pids.append)

    t = threading.Thread(target=measure)
    t.start()
    while not pids:
        time.sleep(0.05)
    time.sleep(3.0)  # loading and measuring
    ask = hold("an ask", 6.0)
    held_at = time.monotonic()
    state = None
    while time.monotonic() - held_at < 1.0:
        _, state = _cpu_s(pids[0])
        if state == "T":
            break
        time.sleep(0.05)
    assert state == "T", "the measuring child was not stopped within a second of the ask"
    time.sleep(0.3)
    before, _ = _cpu_s(pids[0])
    time.sleep(3.0)
    during, state = _cpu_s(pids[0])
    assert state == "T" and during == before  # no CPU taken while the ask runs
    ask.wait()
    t.join(timeout=600)
    row = out["row"]
    assert row["prefill_tps"] > 0 and len(row["ms"]) == len(machine.SIZES) and row["paused_s"] >= 3.0
    assert any(line.startswith("paused: an ask (process") for line in lines)
    assert any(line.startswith("resumed after") for line in lines)


def test_llama_cpp_is_ruled_out_by_an_earlier_table_of_this_machine(tmp_path):
    """An earlier table of this CPU (another model) in which llama.cpp lost to transformers/gguf at every
    shape leaves llama.cpp unmeasured, saying so; a table of another CPU, or one where llama.cpp won a shape,
    does not; the float dtypes are ruled out wherever gguf runs."""
    cpu = machine.cpu_info()
    path = machine.table_path(SMOL, tmp_path, cpu)
    runnable = ["transformers/float32", "transformers/gguf", "llama.cpp/gguf"]
    assert set(machine.ruled_out(runnable, cpu, path)) == {"transformers/float32"}
    assert machine.ruled_out(["transformers/float32", "llama.cpp/gguf"], cpu, path) == {}

    def earlier(name: str, llama_ms: list[float], model: str = "qwen2.5-coder-0.5b-instruct") -> None:
        rows = [{"backend": "transformers", "dtype": "gguf", "prefill_tps": 600.0, "ms": [28, 35, 45, 60, 80]},
                {"backend": "llama.cpp", "dtype": "gguf", "prefill_tps": 200.0, "ms": llama_ms}]
        (tmp_path / name).write_text(json.dumps({"model": model, "contended": [], "candidates": rows}))

    same_cpu = machine.table_path("qwen2.5-coder-0.5b-instruct", tmp_path, cpu).name
    earlier(same_cpu.replace("machine-", "machine-zz", 1), [25, 50, 90, 170, 330])  # llama.cpp won t(1)
    assert "llama.cpp/gguf" not in machine.ruled_out(runnable, cpu, path)
    earlier("machine-other-cpuffff-t9c9-0.json", [44, 60, 90, 170, 330])  # another CPU
    assert "llama.cpp/gguf" not in machine.ruled_out(runnable, cpu, path)
    earlier(same_cpu, [44, 60, 90, 170, 330])
    rules = machine.ruled_out(runnable, cpu, path)
    assert "slower than transformers/gguf at every shape" in rules["llama.cpp/gguf"]
    assert "qwen2.5-coder-0.5b-instruct" in rules["llama.cpp/gguf"]


@pytest.mark.parametrize("model", [SMOL])
def test_models_lists_each_generators_table_state(tmp_path, monkeypatch, model):
    from typer.testing import CliRunner

    from ragspec.cli import app

    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path))
    assert machine.table_status(model).startswith("not measured yet")
    path = machine.table_path(model)
    path.parent.mkdir(parents=True)
    path.with_suffix(".log").write_text("12:00:00 calibrating\n12:00:05 transformers/gguf: paused: an ask\n")
    assert machine.table_status(model) == ("being measured in the background: 12:00:05 transformers/gguf: "
                                           "paused: an ask")
    path.write_text(json.dumps({"measured_at": "2026-12-04T18:00:00", "contended": [], "candidates": [
        {"backend": "transformers", "dtype": "gguf", "prefill_tps": 600.0, "ms": [1.0], "cpu_s": 21.4}]}))
    assert machine.table_status(model) == "measured 2026-12-04T18:00:00 (transformers/gguf; 21 s of CPU)"
    r = CliRunner().invoke(app, ["models"])
    assert r.exit_code == 0 and "this machine: measured 2026-12-04T18:00:00" in " ".join(r.output.split())
