"""What reusing the prompt head's KV saves: every quickstart question asked by two pipelines over one model, one
reusing the head (system instruction and chat template up to the sources) kept from the asks before, one reading
every prompt whole; interleaved, so the ratio comes from one run. Prints the median prefill and time to first
token of each, the head's tokens, and how many answers are the same (they must all be: the reuse is exact where
the pipeline turns it on). The first question warms both (its head is computed, not reused) and is not counted.
Usage: python examples/head_reuse_stats.py INDEX [--pipeline FILE] [--max-new-tokens 48] [--json OUT]
"""

import argparse
import json
import statistics

from source_stats import QUESTIONS  # the quickstart questions (examples/ is on the path when run as a script)

from ragspec.cpu_flags import read_cpuinfo
from ragspec.pipeline import Pipeline


def measure(index, pipeline=None, max_new=48):
    reuse = Pipeline(pipeline, index)
    reuse.load()
    whole = Pipeline(pipeline, index, model=reuse.model, tokenizer=reuse.tokenizer)
    whole._heads = False  # every prompt read whole
    rows = []
    for i, q in enumerate(QUESTIONS):
        a, b = reuse.ask(q, max_new_tokens=max_new), whole.ask(q, max_new_tokens=max_new)
        rows.append({"question": q, "prompt_tokens": a.stats.prompt_tokens, "head": a.stats.prefix_reused_tokens,
                     "prefill_s": [round(a.stats.prefill_ms / 1000, 3), round(b.stats.prefill_ms / 1000, 3)],
                     "ttft_s": [round(a.stats.ttft_ms / 1000, 3), round(b.stats.ttft_ms / 1000, 3)],
                     "same": a.text == b.text})
        print(f"{i + 1:2d}/{len(QUESTIONS)} head {rows[-1]['head']} of {a.stats.prompt_tokens} tokens, prefill "
              f"{rows[-1]['prefill_s'][0]} s vs {rows[-1]['prefill_s'][1]} s, same answer: {rows[-1]['same']}",
              flush=True)
    if reuse._heads is False:
        print("this model reads prompt rows batch-dependently here: the pipeline reuses no head")
    return reuse, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, flags = read_cpuinfo()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c", "sse4_2"))
    print(f"CPU: {model}; flags: {' '.join(simd)}", flush=True)
    pipe, rows = measure(args.index, args.pipeline, args.max_new_tokens)
    counted = rows[1:]
    summary = {key: [statistics.median(r[key][k] for r in counted) for k in (0, 1)] for key in ("prefill_s", "ttft_s")}
    print(f"{pipe.spec.generator.model} ({pipe.choice.backend}/{pipe.choice.dtype}), {len(counted)} questions: "
          f"head {statistics.median(r['head'] for r in counted)} of median "
          f"{statistics.median(r['prompt_tokens'] for r in counted)} prompt tokens; median prefill "
          f"{summary['prefill_s'][0]} s reused vs {summary['prefill_s'][1]} s whole, TTFT {summary['ttft_s'][0]} s vs "
          f"{summary['ttft_s'][1]} s; same answers {sum(r['same'] for r in rows)} of {len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": {"model": model, "flags": simd}, "model": pipe.spec.generator.model,
                       "backend": pipe.choice.backend, "dtype": pipe.choice.dtype, "summary": summary,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
