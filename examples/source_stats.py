"""What the sources of an ask cost: duplicate sources, touching same-document pairs, prompt tokens, and what the
source budget (`prompt.source_tokens`) saves.

Each question is prepared as `Pipeline.ask` would (retrieval, the relevance gate, the source budget, the prompt
built with the generator's tokenizer). `--budgets off,256,512` prepares every question under each budget side
by side; `--ttft` also asks it (one new token, after a warm-up ask) for the time to first token, the budgets
interleaved per question, so each ratio is measured in one run; each of those asks is a user's first over its
sources (asked before the counts are prepared, the gate's remembered windows forgotten). `--pipeline FILE` sets
the pipeline (e.g. `retriever: {merge: false, containment: null}` for "before").
Usage: python examples/source_stats.py INDEX [--pipeline FILE] [--budgets off,256,512] [--ttft] [--json OUT]
"""

import argparse
import json
import re
import time

from ragspec.pipeline import Pipeline

QUESTIONS = [
    "What does the global statement do?",
    "What does the nonlocal statement do?",
    "How does a with statement call __enter__ and __exit__?",
    "What happens when an exception is raised in a finally clause?",
    "How are default parameter values evaluated?",
    "What is the difference between a list and a tuple?",
    "How does the import statement find a module?",
    "What does the yield expression return?",
    "How are names resolved in class bodies?",
    "What does the assert statement do when optimization is requested?",
    "How does augmented assignment like x += 1 work?",
    "What is name mangling of private names?",
]


def words(text):
    return re.findall(r"\w+|[^\w\s]", text)


def shingles(text, n=5):
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}


def measure(index, pipeline=None, ttft=False, budgets=("off",)):
    pipe = Pipeline(pipeline, index)
    pipe.retrieve(QUESTIONS[0])  # warm: index, embedder, BM25
    if ttft:
        for b in budgets:
            pipe.ask(QUESTIONS[0], max_new_tokens=1, source_tokens=b)  # warm: model, kernels
    rows = []
    for q in QUESTIONS:
        t = time.perf_counter()
        sources, _ = pipe.retrieve(q)
        ms = (time.perf_counter() - t) * 1000
        norm = [" ".join(s.text.split()) for s in sources]
        dup = sum(1 for i in range(len(norm)) if norm[i] in norm[:i])
        sh = [shingles(s.text) for s in sources]
        contained = sum(1 for i in range(len(sh)) if norm[i] not in norm[:i]
                        and any(len(sh[i] & sh[j]) >= 0.8 * len(sh[i]) for j in range(i)))
        touching = sum(1 for i in range(len(sources)) for j in range(len(sources)) if i < j
                       and sources[i].document_id == sources[j].document_id
                       and sources[i].start <= sources[j].end and sources[j].start <= sources[i].end)
        locs = sum(len(getattr(s, "locations", None) or [s]) for s in sources)
        row = {"question": q, "sources": len(sources), "locations": locs, "duplicates": dup,
               "contained": contained, "touching": touching, "retrieval_ms": round(ms, 1), "budgets": {}}
        for b in budgets:
            # each budget's ask is a first ask over these sources (it pays for any windows the index does not
            # store), so it comes before `prepare`, with nothing remembered
            pipe.window_scorer.memo.pooled.clear()
            first = pipe.ask(q, max_new_tokens=1, source_tokens=b).stats.ttft_ms if ttft else None
            p = pipe.prepare(q, source_tokens=b)
            r = {"source_budget": p.built.source_budget, "sources_sent": len(p.built.sources),
                 "prompt_tokens": len(p.built.ids), "source_tokens": sum(1 for n in p.built.token_source if n)}
            if ttft:
                r["ttft_s"] = round(first / 1000, 3)
            row["budgets"][str(b)] = r
        rows.append(row)
    return rows


if __name__ == "__main__":
    import statistics

    from ragspec.cpu_flags import read_cpuinfo

    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline", default=None)
    ap.add_argument("--budgets", default="off", help="comma-separated source budgets: off, auto or token counts")
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    model, flags = read_cpuinfo()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c", "sse4_2"))
    cpu = {"model": model, "flags": simd}
    print(f"CPU: {model}; flags: {' '.join(simd)}", flush=True)
    rows = measure(a.index, a.pipeline, a.ttft, budgets)
    for r in rows:
        per = " | ".join(f"{b}: {v['prompt_tokens']:5d} tok" + (f" {v['ttft_s']:5.2f} s" if "ttft_s" in v else "")
                         for b, v in r["budgets"].items())
        print(f"{r['question'][:50]:50s} src {r['sources']} dup {r['duplicates']} cont {r['contained']} "
              f"touch {r['touching']} | {per}", flush=True)
    n = len(rows)
    base = budgets[0]
    print(f"sums: duplicates {sum(r['duplicates'] for r in rows)}, contained {sum(r['contained'] for r in rows)}, "
          f"touching {sum(r['touching'] for r in rows)}")
    summary = {}
    for b in budgets:
        toks = [r["budgets"][b]["prompt_tokens"] for r in rows]
        src = [r["budgets"][b]["source_tokens"] for r in rows]
        line = {"mean_prompt_tokens": sum(toks) / n, "mean_source_tokens": sum(src) / n,
                "prompt_vs_first": sum(toks) / sum(r["budgets"][base]["prompt_tokens"] for r in rows)}
        if a.ttft:
            line["median_ttft_s"] = statistics.median(r["budgets"][b]["ttft_s"] for r in rows)
            line["ttft_vs_first"] = line["median_ttft_s"] / statistics.median(r["budgets"][base]["ttft_s"] for r in rows)
        summary[b] = line
        print(f"budget {b:>5}: mean prompt tokens {line['mean_prompt_tokens']:.0f} "
              f"({line['prompt_vs_first']:.2f}× of {base}), source tokens {line['mean_source_tokens']:.0f}"
              + (f"; median TTFT {line['median_ttft_s']:.2f} s ({line['ttft_vs_first']:.2f}× of {base})"
                 if a.ttft else ""), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"cpu": cpu, "budgets": budgets, "summary": summary, "rows": rows}, fh, indent=1)
