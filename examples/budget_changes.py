"""Which records of an answer set a source budget changes at all: the prompt built under `--source-tokens N`
differs from the one built with whole sources. Greedy decoding over the same prompt gives the same answer, so
only those records need asking again (`ragspec eval-answers … --records` with the numbers printed here); on the
others the budget's difference to `off` is zero by construction.

Each record is prepared as `eval-answers` asks it (its own passages, or retrieved with `--retrieve`; the relevance
gate; the budget; the prompt built with the generator's tokenizer). Nothing is generated.
Usage: python examples/budget_changes.py --data FILE --format nq|clapnq|specbench [--retrieve INDEX]
       [--pipeline FILE] [--limit N] [--skip N] --source-tokens N [--json OUT]
"""

import argparse
import json
from pathlib import Path

from ragspec.eval.answers import read_records, record_sources
from ragspec.pipeline import Pipeline
from ragspec.spec import load_spec


def changed(data, fmt, budget, retrieve=None, pipeline=None, limit=None, skip=0):
    """[(record number, id, prompt tokens off, prompt tokens at the budget)] for the records whose prompt differs."""
    records = read_records(Path(data), fmt, limit, skip)
    pipe = Pipeline(load_spec(pipeline), str(retrieve) if retrieve else None)
    out = []
    for n, rec in enumerate(records, 1):
        kw = {} if retrieve else {"documents": record_sources(rec)}
        whole = pipe.prepare(rec.question, source_tokens="off", **kw).built.ids
        cut = pipe.prepare(rec.question, source_tokens=budget, **kw).built.ids
        if whole != cut:
            out.append((n, rec.id, len(whole), len(cut)))
    return records, out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--format", required=True)
    ap.add_argument("--retrieve", default=None)
    ap.add_argument("--pipeline", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--source-tokens", type=int, required=True)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    records, rows = changed(a.data, a.format, a.source_tokens, a.retrieve, a.pipeline, a.limit, a.skip)
    for n, rid, whole, cut in rows:
        print(f"record {n} (id {rid}): {whole} -> {cut} prompt tokens")
    print(f"{len(rows)} of {len(records)} prompts change at source budget {a.source_tokens}; "
          f"--records {','.join(str(r[0]) for r in rows) or '(none)'}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"data": a.data, "format": a.format, "source_tokens": a.source_tokens, "records": len(records),
                       "changed": [{"record": n, "id": rid, "prompt_off": w, "prompt_cut": c}
                                   for n, rid, w, c in rows]}, fh, indent=1)
