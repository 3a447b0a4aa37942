"""llama.cpp's prompt rate and one-token cost with and without its AMX kernels and repacked weight buffers.

Usage: python examples/llama_amx.py GGUF [--build NAME=SITE_DIR ...] [--json OUT]

Each build (`installed`: the llama-cpp-python `make install` built, without ggml's AMX kernels; any other a
site dir holding another build, e.g. one with `-DGGML_NATIVE=ON` alone, AMX included) runs with its extra
buffer types off and on (on: the repacked CPU weights and, in an AMX build, the AMX weight buffer), each in a
child process (a segfault is a result, not the end), 2 threads, a 512-token context: prefill of a 448-token
prompt (best of 3) and t(1), the mean of 64 one-token decodes after it. Prints one line per run and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
from ragspec.decoding.backends import llama_cpp as ours

extra = sys.argv[2] == "on"
def params(lc):
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = extra
    return mp
ours.model_params = params
m = ours.LlamaCppModel(sys.argv[1], n_ctx=512, n_batch=512, n_threads=2)
prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, 448)]
best = 1e9
for _ in range(3):
    m.clear()
    t = time.perf_counter()
    m.feed(prompt, 0, last_logits=True)
    best = min(best, time.perf_counter() - t)
pos, tok, t = len(prompt), 42, time.perf_counter()
for _ in range(64):
    m.decode([(tok, pos, [0], True)])
    tok, pos = int(np.argmax(m.row(0))), pos + 1
t1 = (time.perf_counter() - t) / 64
print(json.dumps({"version": llama_cpp.__version__, "system_info": llama_cpp.llama_cpp.llama_print_system_info().decode().strip(),
                  "prefill_tok_s": round(len(prompt) / best, 1), "t1_ms": round(t1 * 1000, 2)}))
"""


def run(gguf: str, site: str | None, extra: str) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, gguf, extra], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        return {"ok": False, "exit": r.returncode, "error": tail[:300], "seconds": round(time.perf_counter() - t, 1)}
    return {"ok": True, **json.loads(r.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--build", action="append", default=[], help="NAME=SITE_DIR: another llama-cpp-python build")
    ap.add_argument("--json")
    args = ap.parse_args()
    from ragspec.bench.decoding import cpu_info

    builds = [("installed", None)] + [tuple(b.split("=", 1)) for b in args.build]
    out = {"gguf": os.path.basename(args.gguf), "cpu": cpu_info(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    print("cpu:", out["cpu"]["model"], " ".join(out["cpu"]["flags"]))
    for name, site in builds:
        for extra in ("off", "on"):
            row = {"build": name, "extra_buffers": extra == "on", **run(args.gguf, site, extra)}
            out["runs"].append(row)
            shown = (f"prefill {row['prefill_tok_s']} tok/s, t(1) {row['t1_ms']} ms" if row["ok"]
                     else f"failed (exit {row['exit']}): {row['error']}")
            print(f"{name:>10} extra buffers {extra:>3}: {shown}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
