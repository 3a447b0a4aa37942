"""Time to first token and total time of the same asks under several generator settings, in one warm process.

    python examples/ask_timings.py indexes/pydoc-topics --set backend=transformers,dtype=float32 \
        --set backend=llama.cpp --set backend=auto [--json OUT] [question ...]

Each setting gets its own warm pipeline (one warm-up ask first: load, t(n) calibration), then runs every
question once; settings take turns per question so a noisy neighbour hits them alike. Prints a row per ask
and the medians, with the CPU flags the figures came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ragspec.pipeline import Pipeline
from ragspec.spec import load_spec

QUESTIONS = [
    "What does the global statement do?",
    "How does a with statement call __enter__ and __exit__?",
    "What happens when a generator's close() method is called?",
    "How are default parameter values evaluated in a function definition?",
    "What does the nonlocal statement do?",
]


def cpu_flags() -> str:
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "fma", "f16c")
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{name} [{' '.join(f for f in keep if f in flags)}]"


def pipeline_for(spec, setting: str, retriever) -> Pipeline:
    gen = dict(spec.generator.model_dump())
    for kv in filter(None, setting.split(",")):
        k, v = kv.split("=", 1)
        gen[k] = v
    data = spec.model_dump() | {"generator": gen}
    return Pipeline(load_spec(data), retriever)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("questions", nargs="*")
    ap.add_argument("--pipeline", default="pipelines/default.yaml")
    ap.add_argument("--set", dest="settings", action="append", default=[],
                    help="generator settings, e.g. backend=llama.cpp or backend=transformers,dtype=float32")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    questions = args.questions or QUESTIONS
    settings = args.settings or ["backend=transformers,dtype=float32"]
    spec = load_spec(args.pipeline)
    base = Pipeline(spec, args.index)
    pipes = {}
    for s in settings:
        t = time.perf_counter()
        p = pipeline_for(spec, s, base.retriever)
        p.ask(questions[0], max_new_tokens=4)
        chosen = getattr(p, "choice", None)
        pipes[s] = p
        print(f"{s}: warm in {time.perf_counter() - t:.1f} s" + (f" (auto chose {chosen})" if chosen else ""),
              flush=True)
    rows = []
    for q in questions:
        for s, p in pipes.items():
            t = time.perf_counter()
            a = p.ask(q, max_new_tokens=args.max_new_tokens)
            total = (time.perf_counter() - t) * 1000
            st = a.stats
            rows.append({"setting": s, "question": q, "ttft_ms": round(st.ttft_ms, 1), "total_ms": round(total, 1),
                         "prompt_tokens": st.prompt_tokens, "prefill_ms": round(st.prefill_ms, 1),
                         "prefill_tok_s": round(st.prompt_tokens / (st.prefill_ms / 1000), 1) if st.prefill_ms else 0,
                         "new_tokens": st.new_tokens, "decode_ms": round(st.decode_ms, 1),
                         "retrieval_ms": round(st.retrieval_ms, 1), "text": a.text})
            r = rows[-1]
            print(f"{s:40} ttft {r['ttft_ms'] / 1000:6.2f} s  total {r['total_ms'] / 1000:6.2f} s  prompt "
                  f"{r['prompt_tokens']:5} ({r['prefill_tok_s']:6.1f} tok/s)  {r['new_tokens']:4} new  {q[:40]}",
                  flush=True)
    print(f"\nCPU: {cpu_flags()}")
    print(f"{'setting':40} {'median TTFT':>12} {'median total':>13} {'prefill tok/s':>14}")
    summary = {}
    for s in pipes:
        mine = [r for r in rows if r["setting"] == s]
        summary[s] = {k: statistics.median(r[k] for r in mine) for k in ("ttft_ms", "total_ms", "prefill_tok_s")}
        m = summary[s]
        print(f"{s:40} {m['ttft_ms'] / 1000:10.2f} s {m['total_ms'] / 1000:11.2f} s {m['prefill_tok_s']:14.1f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cpu": cpu_flags(), "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
