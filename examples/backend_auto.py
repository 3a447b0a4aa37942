"""`generator.backend: auto` against a set backend on real 5-source asks: time to first token and total.

Usage: python examples/backend_auto.py INDEX [--backends transformers,auto] [--asks 5] [--json OUT]

Every pipeline is the default spec but for `generator.backend` (and `dtype`, given as backend:dtype); they
run interleaved, question by question, after one warm-up ask each, so a busy spell of the machine hits all
of them alike. Prints one line per ask and the medians, and the CPU flags every figure needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from source_stats import QUESTIONS as STATS_QUESTIONS  # examples/source_stats.py, run as a sibling script

QUESTIONS = STATS_QUESTIONS[:6]  # the asks timed
WARM_UP = STATS_QUESTIONS[6]  # "How does the import statement find a module?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--backends", default="transformers,auto")
    ap.add_argument("--asks", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from ragspec.bench.decoding import cpu_info
    from ragspec.pipeline import Pipeline

    pipes = {}
    for name in a.backends.split(","):
        backend, _, dtype = name.partition(":")
        t = time.perf_counter()
        pipe = Pipeline({"generator": {"backend": backend, "dtype": dtype or "auto"}}, a.index).load(progress=print)
        print(f"{name}: {pipe.choice.backend}/{pipe.choice.dtype} — {pipe.choice.reason} "
              f"(loaded in {time.perf_counter() - t:.0f} s)", flush=True)
        pipe.ask(WARM_UP)
        pipes[name] = pipe
    rows = {name: [] for name in pipes}
    for q in QUESTIONS[: a.asks]:
        for name, pipe in pipes.items():
            t = time.perf_counter()
            s = pipe.ask(q).stats
            total = time.perf_counter() - t
            rows[name].append({"question": q, "ttft_s": s.ttft_ms / 1000, "total_s": total,
                               "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
                               "prefill_s": s.prefill_ms / 1000, "decode_s": s.decode_ms / 1000,
                               "tokens_per_step": s.mean_accepted})
            r = rows[name][-1]
            print(f"{name:14} ttft {r['ttft_s']:5.1f} s  total {total:5.1f} s  prompt {s.prompt_tokens} "
                  f"new {s.new_tokens} ({s.mean_accepted:.2f}/step)  {q}", flush=True)
    summary = {name: {"backend": pipes[name].choice.backend, "dtype": pipes[name].choice.dtype,
                      "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
                      "total_s_median": statistics.median(r["total_s"] for r in rs),
                      "total_s_sum": sum(r["total_s"] for r in rs), "asks": rs} for name, rs in rows.items()}
    cpu = cpu_info()
    for name, s in summary.items():
        print(f"{name:14} {s['backend']}/{s['dtype']}: median ttft {s['ttft_s_median']:.1f} s, median total "
              f"{s['total_s_median']:.1f} s, sum {s['total_s_sum']:.1f} s")
    print(f"CPU: {cpu['model']} · {cpu['threads']} threads · {' '.join(cpu['flags'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "pipelines": summary}, f, indent=2)


if __name__ == "__main__":
    main()
