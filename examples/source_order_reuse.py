"""Would another order of the sources in the prompt let questions share longer prompt prefixes with the ones asked
before them (and so reuse more of the tree of earlier prompts)? Builds each prompt as the pipeline does (retrieval,
gate, source budget) for the 12 quickstart questions and then a rephrasing of each, in three orders of the same
sources: by rank (what the pipeline sends), by document (path, then offset), and the best first with the rest by
document. For each it counts the tokens a prompt shares with the longest matching earlier prompt of the same
order. Nothing is generated, so it needs no model time and its counts do not depend on the CPU.
Usage: python examples/source_order_reuse.py INDEX [--pipeline FILE] [--json OUT]
"""

import argparse
import dataclasses
import json
import statistics

from prompt_reuse_stats import REPHRASED
from source_stats import QUESTIONS  # the quickstart questions (examples/ is on the path when run as a script)

from ragspec.pipeline import Pipeline
from ragspec.pipeline.prompt import NO_DECLINE

ORDERS = {
    "rank": None,
    "document": lambda sources: sorted(sources, key=lambda s: (s.path, s.start)),
    "best first, then document": lambda sources: sources[:1] + sorted(sources[1:], key=lambda s: (s.path, s.start)),
}


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_ids(pipe: Pipeline, question: str, prepared, order) -> list[int]:
    """The prompt's ids with its sources in `order`, renumbered, and the same system instruction as sent."""
    if order is None:
        return prepared.built.ids
    sources = [dataclasses.replace(s, number=i + 1) for i, s in enumerate(order(prepared.sources))]
    head = prepared.built.ids[: prepared.built.head]
    for decline in (None, NO_DECLINE):  # which decline phrasing the gate chose is in the sent prompt's head
        built = pipe.prompt_builder(pipe.spec.generator.max_new_tokens, decline).build(question, sources)
        if built.ids[: built.head] == head:
            return built.ids
    raise RuntimeError("no decline phrasing rebuilds the sent prompt's head")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("index")
    ap.add_argument("--pipeline")
    ap.add_argument("--json")
    args = ap.parse_args()
    pipe = Pipeline(args.pipeline, args.index)
    pipe.load()
    earlier: dict[str, list[list[int]]] = {name: [] for name in ORDERS}
    rows = []
    for phase, questions in (("asked", QUESTIONS), ("rephrased", REPHRASED)):
        for q in questions:
            prepared = pipe.prepare(q)
            row = {"phase": phase, "question": q, "sources": [f"{s.path}:{s.start}" for s in prepared.sources]}
            for name, order in ORDERS.items():
                ids = prompt_ids(pipe, q, prepared, order)
                row[name] = [max((shared(ids, e) for e in earlier[name]), default=0), len(ids)]
                earlier[name].append(ids)
            rows.append(row)
            print(f"{phase:9s} {q[:48]:48s} " + "  ".join(f"{n}: {row[n][0]}/{row[n][1]}" for n in ORDERS), flush=True)
    summary = {}
    for phase in ("asked", "rephrased"):
        counted = [r for r in rows if r["phase"] == phase][1 if phase == "asked" else 0:]  # the first has no past
        summary[phase] = {name: statistics.median(r[name][0] for r in counted) for name in ORDERS}
        print(f"median tokens shared with an earlier prompt, {phase}: {summary[phase]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"index": args.index, "pipeline": args.pipeline or "default", "summary": summary, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
