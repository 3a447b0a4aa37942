"""What skipping Python's module teardown saves a command-line user (`ragspec.cli.exit_without_teardown`).

Each question asked by a fresh `ragspec ask` process that exits the normal way (the typer app called directly, as
the `ragspec` script did before) and by one through `ragspec.cli.main` (teardown skipped), interleaved, so each
ratio comes from one run; then `ragspec search` both ways. Prints the median wall time of the process (start to
exit, as a user waits for it) per command and way, and whether the answers and results are the same both ways.
Usage: python examples/cli_exit_time.py INDEX [--questions 6] [--max-new-tokens 48] [--json OUT]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

from source_stats import QUESTIONS  # examples/ is on the path when run as a script

from ragspec.cpu_flags import read_cpuinfo

WAYS = {"normal exit": [sys.executable, "-c", "import sys; sys.argv[0] = 'ragspec'; from ragspec.cli import app; app()"],
        "teardown skipped": [sys.executable, "-m", "ragspec.cli"]}


def timed(cmd) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[-6:])} failed: {out.stderr[-2000:]}")
    return wall, out.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("index")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for q in QUESTIONS[: a.questions]:
        for command, args in (("ask", ["ask", q, "--index", a.index, "--json", "--max-new-tokens",
                                       str(a.max_new_tokens)]),
                              ("search", ["search", a.index, q, "--json"])):
            walls, outs = {}, {}
            for way, prefix in WAYS.items():
                walls[way], out = timed(prefix + args)
                outs[way] = json.loads(out)
            same = (outs["normal exit"]["text"] == outs["teardown skipped"]["text"] if command == "ask"
                    else outs["normal exit"]["results"] == outs["teardown skipped"]["results"])
            rows.append({"command": command, "question": q, **{f"wall_s {w}": s for w, s in walls.items()},
                         "same": same})
            print(f"{command:6s} {walls['normal exit']:5.2f} s normal, {walls['teardown skipped']:5.2f} s skipped, "
                  f"same={same}: {q}", flush=True)
    cpu, flags = read_cpuinfo()
    flags = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c", "sse4_2"))
    print(f"CPU: {cpu}; flags: {' '.join(flags)}")
    summary = {}
    for command in ("ask", "search"):
        mine = [r for r in rows if r["command"] == command]
        normal = statistics.median(r["wall_s normal exit"] for r in mine)
        skipped = statistics.median(r["wall_s teardown skipped"] for r in mine)
        saved = statistics.median(r["wall_s normal exit"] - r["wall_s teardown skipped"] for r in mine)
        summary[command] = {"runs": len(mine), "wall_s_normal_exit": normal, "wall_s_teardown_skipped": skipped,
                            "median_saved_s": saved, "same": sum(r["same"] for r in mine)}
        print(f"{command}: median wall {normal:.2f} s normal exit vs {skipped:.2f} s teardown skipped "
              f"({skipped / normal:.2f}x; median saving {saved:.2f} s); same {summary[command]['same']} of {len(mine)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": {"model": cpu, "flags": flags}, "max_new_tokens": a.max_new_tokens,
                       "summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
