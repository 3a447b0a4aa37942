"""What reusing earlier prompts' KV saves (the tree of earlier prompts, `generator.prompt_cache_mb`): two
pipelines over one model, one reusing the longest prefix each prompt shares with the prompts before it, one
reading every prompt whole, asked the same questions interleaved, so each ratio comes from one run.

First the 12 quickstart questions (each reuses what it shares with the ones before: the head at least), then a
rephrasing of each, asked after all of them: another question over the same corpus, never the same question
twice. Prints per phase the median prefill and time to first token of each pipeline, the prompt tokens reused,
the tree's memory, and how many answers are the same (all must be: the reuse is exact where the pipeline turns
it on). The first question warms both (nothing to reuse yet) and is not counted.
Usage: python examples/prompt_reuse_stats.py INDEX [--pipeline FILE] [--max-new-tokens 48] [--json OUT]
"""

import argparse
import json
import statistics

from source_stats import QUESTIONS  # the quickstart questions (examples/ is on the path when run as a script)

from ragspec.cpu_flags import read_cpuinfo
from ragspec.pipeline import Pipeline

REPHRASED = [
    "What is the effect of the global statement?",
    "What is the nonlocal statement for?",
    "When does a with statement call __enter__ and __exit__?",
    "What happens if a finally clause raises an exception?",
    "When are default argument values evaluated?",
    "How do lists and tuples differ?",
    "How does import locate a module?",
    "What value does a yield expression return?",
    "How does name resolution work in a class body?",
    "What does assert do under optimization?",
    "How does an augmented assignment such as x += 1 work?",
    "What is private name mangling?",
]


def measure(index, pipeline=None, max_new=48):
    reuse = Pipeline(pipeline, index)
    reuse.load()
    whole = Pipeline(pipeline, index, model=reuse.model, tokenizer=reuse.tokenizer)
    whole._prompts = False  # every prompt read whole
    rows = []
    for phase, questions in (("asked", QUESTIONS), ("rephrased", REPHRASED)):
        for i, q in enumerate(questions):
            a, b = reuse.ask(q, max_new_tokens=max_new), whole.ask(q, max_new_tokens=max_new)
            tree = reuse._prompts or None
            rows.append({"phase": phase, "question": q, "prompt_tokens": a.stats.prompt_tokens,
                         "reused": a.stats.prefix_reused_tokens,
                         "prefill_s": [round(a.stats.prefill_ms / 1000, 3), round(b.stats.prefill_ms / 1000, 3)],
                         "ttft_s": [round(a.stats.ttft_ms / 1000, 3), round(b.stats.ttft_ms / 1000, 3)],
                         "tree_mb": round(tree.nbytes / 2 ** 20, 1) if tree else 0, "same": a.text == b.text})
            r = rows[-1]
            print(f"{phase} {i + 1:2d}/{len(questions)} reused {r['reused']} of {r['prompt_tokens']} tokens, TTFT "
                  f"{r['ttft_s'][0]} s vs {r['ttft_s'][1]} s, tree {r['tree_mb']} MB, same answer: {r['same']}",
                  flush=True)
    if reuse._prompts is False:
        print("this model reads prompt rows batch-dependently here (or prompt_cache_mb is 0): nothing is reused")
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
    summary = {}
    for phase in ("asked", "rephrased"):
        counted = [r for r in rows if r["phase"] == phase][1 if phase == "asked" else 0:]
        s = summary[phase] = {key: [statistics.median(r[key][k] for r in counted) for k in (0, 1)]
                              for key in ("prefill_s", "ttft_s")}
        s["reused"] = statistics.median(r["reused"] for r in counted)
        s["prompt_tokens"] = statistics.median(r["prompt_tokens"] for r in counted)
        s["same"] = sum(r["same"] for r in counted)
        print(f"{pipe.spec.generator.model} ({pipe.choice.backend}/{pipe.choice.dtype}), {phase}, {len(counted)} "
              f"questions: reused median {s['reused']} of {s['prompt_tokens']} prompt tokens; median prefill "
              f"{s['prefill_s'][0]} s reused vs {s['prefill_s'][1]} s whole, TTFT {s['ttft_s'][0]} s vs "
              f"{s['ttft_s'][1]} s; same answers {s['same']} of {len(counted)}")
    print(f"tree at the end: {rows[-1]['tree_mb']} MB; answers the same {sum(r['same'] for r in rows)} of {len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": {"model": model, "flags": simd}, "model": pipe.spec.generator.model,
                       "backend": pipe.choice.backend, "dtype": pipe.choice.dtype, "summary": summary,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
