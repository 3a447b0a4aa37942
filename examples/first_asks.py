"""Whether a new machine's background measurement slows the user: asks on a fresh RAGSPEC_HOME while the job runs,
against the same ask once the machine is measured.

A fresh home (its `models/` linked to an existing home's converted models, so no conversion is timed); the first
ask (it starts the background calibration job), then three more `GAP_S` apart, each its own `ragspec ask`
process, as a user asking again; then, once the job has written its table, the same ask three times (warm). Prints
each ask's whole-process time and first token, the ratio of each of the three to the warm median, the job's log
and the table's CPU seconds. Run it alone on the machine.
Usage: python examples/first_asks.py INDEX [--pipeline FILE] [--gap 20] [--json OUT]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragspec.cpu_flags import read_cpuinfo

QUESTION = "What does the global statement do?"


def ask(index, pipeline, home) -> dict:
    cmd = [sys.executable, "-m", "ragspec.cli", "ask", QUESTION, "--index", index, "--json"]
    cmd += ["--pipeline", pipeline] if pipeline else []
    env = dict(os.environ, RAGSPEC_HOME=str(home), RAGSPEC_CALIBRATE="background")
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t
    stats = json.loads(r.stdout)["stats"]
    return {"wall_s": round(wall, 2), "ttft_s": round(stats["ttft_ms"] / 1000, 2),
            "choice": f"{stats.get('backend')}/{stats.get('dtype')}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline")
    ap.add_argument("--gap", type=float, default=20.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    base = Path(os.environ.get("RAGSPEC_HOME", Path.home() / ".cache" / "ragspec"))
    home = Path(tempfile.mkdtemp(prefix="ragspec-first-"))
    (home / "models").symlink_to(base / "models")
    model, flags = read_cpuinfo()
    print(f"CPU: {model}; flags: {' '.join(sorted(f for f in flags if f.startswith(('avx512', 'amx', 'avx2'))))}")
    rows = []
    for n in range(4):
        if n:
            time.sleep(a.gap)
        rows.append(ask(a.index, a.pipeline, home) | {"kind": "first" if n == 0 else f"again {n}"})
        print(rows[-1], flush=True)
    tables = lambda: [p for p in (home / "calibration").glob("machine-*.json")]  # noqa: E731
    t0 = time.time()
    while not tables() and time.time() - t0 < 1800:
        time.sleep(5)
    log = "".join(p.read_text() for p in (home / "calibration").glob("machine-*.log"))
    table = json.loads(tables()[0].read_text()) if tables() else {}
    cpu_s = sum(r.get("cpu_s", 0.0) for r in table.get("candidates", []))
    warm = [ask(a.index, a.pipeline, home) | {"kind": "measured"} for _ in range(3)]
    for w in warm:
        print(w)
    ref = statistics.median(w["wall_s"] for w in warm)
    ratios = [round(r["wall_s"] / ref, 2) for r in rows[1:]]
    print(f"the three asks while the machine was measured: {ratios} x the measured machine's median {ref:.2f} s")
    print(f"the table: {cpu_s:.0f} s of CPU; the job's log:\n{log}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": model, "flags": sorted(flags), "date": time.strftime("%F %T %Z"),
                                            "gap_s": a.gap, "asks": rows, "measured": warm, "ratios": ratios,
                                            "table_cpu_s": cpu_s, "log": log}, indent=1))
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
