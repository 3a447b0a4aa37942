"""Ask questions over an index twice — with the pipeline's drafter and with plain decoding through the same
verifier — and report the decode speed-up, whether the answers are identical, and the citations.

    python examples/ask_vs_vanilla.py indexes/python-3.11-docs "question 1" "question 2" ... [--json OUT]
"""

from __future__ import annotations

import argparse
import json

from ragspec.pipeline import Pipeline
from ragspec.spec import load_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("questions", nargs="+")
    ap.add_argument("--pipeline", default="pipelines/default.yaml")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    spec = load_spec(args.pipeline)
    fast = Pipeline(spec, args.index)
    plain = Pipeline(spec.model_copy(update={"drafting": spec.drafting.model_copy(update={"method": "none"})}),
                     fast.retriever)
    fast.ask(args.questions[0], max_new_tokens=8)  # warm-up (loads, calibrates)
    rows = []
    for q in args.questions:
        a = fast.ask(q)
        b = plain.ask(q)
        speed = b.stats.decode_ms / a.stats.decode_ms * a.stats.new_tokens / max(b.stats.new_tokens, 1)
        rows.append({"question": q, "identical": a.text == b.text, "speedup": round(speed, 2),
                     "tokens": a.stats.new_tokens, "mean_accepted": round(a.stats.mean_accepted, 2),
                     "tok_s": round(a.stats.decode_tokens_per_s, 2), "vanilla_tok_s": round(b.stats.decode_tokens_per_s, 2),
                     "answer": a.as_json()})
        print(f"\n## {q}\n{a.to_markdown()}")
        for c in a.citations:
            print(f"  [{c.source}] {c.path} [{c.start}:{c.end}] {' '.join(c.quote.split())[:100]!r}")
        print(f"→ {a.stats.new_tokens} tokens, {a.stats.decode_tokens_per_s:.1f} tok/s vs vanilla "
              f"{b.stats.decode_tokens_per_s:.1f} tok/s: {speed:.2f}× ({a.stats.mean_accepted:.2f} tokens/step), "
              f"identical to vanilla: {a.text == b.text}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
