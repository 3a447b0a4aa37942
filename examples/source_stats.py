"""What the sources of an ask cost: duplicate sources, touching same-document pairs and prompt tokens.

Each question is retrieved as `Pipeline.ask` would, and the prompt is built with the pipeline's PromptBuilder and
the generator's tokenizer. `--ttft` also asks it (one new token, after a warm-up ask) for the time to first
token; `--pipeline FILE` sets the retriever (e.g. `retriever: {merge: false, containment: null}` for "before").
Usage: python examples/source_stats.py INDEX [--pipeline FILE] [--ttft] [--json OUT]
"""

import argparse
import json
import re
import time

from transformers import AutoTokenizer

from ragspec.models.generator import generator_source
from ragspec.pipeline import Pipeline
from ragspec.pipeline.prompt import PromptBuilder

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


def measure(index, pipeline=None, ttft=False):
    pipe = Pipeline(pipeline, index)
    tok = AutoTokenizer.from_pretrained(generator_source(pipe.spec.generator.model))
    builder = PromptBuilder(tok, pipe.spec.prompt.style, pipe.spec.prompt.system)
    pipe.retrieve(QUESTIONS[0])  # warm: index, embedder, BM25
    if ttft:
        pipe.ask(QUESTIONS[0], max_new_tokens=1)  # warm: model, kernels
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
        built = builder.build(q, sources)
        locs = sum(len(getattr(s, "locations", None) or [s]) for s in sources)
        rows.append({"question": q, "sources": len(sources), "locations": locs, "duplicates": dup,
                     "contained": contained, "touching": touching, "prompt_tokens": len(built.ids),
                     "retrieval_ms": round(ms, 1)})
        if ttft:
            rows[-1]["ttft_s"] = round(pipe.ask(q, max_new_tokens=1).stats.ttft_ms / 1000, 2)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline", default=None)
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = measure(a.index, a.pipeline, a.ttft)
    for r in rows:
        print(f"{r['question'][:60]:60s} src {r['sources']} loc {r['locations']:2d} dup {r['duplicates']} "
              f"cont {r['contained']} touch {r['touching']} tokens {r['prompt_tokens']:5d} {r['retrieval_ms']:6.1f} ms"
              + (f" ttft {r['ttft_s']:5.2f} s" if "ttft_s" in r else ""), flush=True)
    n = len(rows)
    print(f"sums: duplicates {sum(r['duplicates'] for r in rows)}, contained {sum(r['contained'] for r in rows)}, "
          f"touching {sum(r['touching'] for r in rows)}; mean prompt tokens {sum(r['prompt_tokens'] for r in rows) / n:.0f}"
          + (f"; mean ttft {sum(r['ttft_s'] for r in rows) / n:.2f} s" if a.ttft else ""))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
