"""A retrieval corpus from an answer-quality set's own passages, for `ragspec eval-answers --retrieve`.

    python examples/eval_corpus.py nq ../shared/data/nq_open_oracle/nq-open-oracle.jsonl.gz /tmp/nq.jsonl
    python examples/eval_corpus.py clapnq ../shared/data/clapnq /tmp/clapnq.jsonl
    ragspec index /tmp/nq.jsonl --out indexes/nq

Every passage of every record (nq: `ctxs`; clapnq: `passages` of the answerable and unanswerable files), one
JSONL record each (`_id`, `title`, `text`), exact copies written once: the haystack a question is answered
from, with the gold passage somewhere among the others. Nothing is copied into the repository.
"""

from __future__ import annotations

import ast
import gzip
import json
import sys
from pathlib import Path


def _field(value):
    """nq_open_oracle stores lists as Python literals in strings."""
    return ast.literal_eval(value) if isinstance(value, str) else value


def records(fmt: str, path: Path):
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    for f in files:
        with (gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else open(f, encoding="utf-8")) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    yield from _field(r["ctxs"] if fmt == "nq" else r["passages"])


def main(fmt: str, src: str, out: str) -> None:
    seen, n = set(), 0
    with open(out, "w", encoding="utf-8") as fh:
        for p in records(fmt, Path(src)):
            key = (p.get("title", ""), p["text"])
            if key in seen:
                continue
            seen.add(key)
            n += 1
            fh.write(json.dumps({"_id": f"{fmt}-{n}", "title": key[0], "text": key[1]}, ensure_ascii=False) + "\n")
    print(f"{out}: {n} passages")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("nq", "clapnq"):
        sys.exit(__doc__)
    main(*sys.argv[1:])
