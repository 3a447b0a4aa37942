"""Two `eval-answers` runs over the same records, compared pair by pair: a setting that trades quality for
speed (a source budget, a reused cache) is judged by the paired difference and its standard error, not by two
means that each carry the records' own spread.

A record is matched by its `id` and `answerable` flag (CLAP NQ's two files reuse ids). Each metric is taken
over the records where it applies in both runs: answer contains, token F1 and false refusal over answerable
records, refusal over unanswerable ones; tokens per step and prompt / source tokens over records answered in
both (a declined record has no prompt).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ragspec.errors import RagspecError

# metric name -> (row field, which records: "answerable" | "unanswerable" | "answered")
METRICS: dict[str, tuple[str, str]] = {
    "answer contains": ("answer_contains", "answerable"),
    "token F1": ("token_f1", "answerable"),
    "false refusal": ("declined", "answerable"),
    "refusal": ("declined", "unanswerable"),
    "tokens per step": ("mean_accepted", "answered"),
    "prompt tokens": ("prompt_tokens", "answered"),
    "source tokens": ("source_tokens", "answered"),
}


@dataclass
class Paired:
    """One metric over n paired records: each run's mean ± standard error, and b − a ± its standard error."""

    metric: str
    n: int
    mean_a: float
    se_a: float
    mean_b: float
    se_b: float
    diff: float
    se_diff: float

    def within_one_se(self) -> bool:
        return abs(self.diff) <= self.se_diff


def mean_se(xs: list[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation over √n; 0 for fewer than two values)."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def _key(row: dict) -> tuple:
    return (str(row["id"]), bool(row["answerable"]))


def _applies(row: dict, which: str) -> bool:
    if which == "answerable":
        return bool(row["answerable"])
    if which == "unanswerable":
        return not row["answerable"]
    return bool(row.get("prompt_tokens")) and bool(row.get("new_tokens"))


def paired(rows_a: list[dict], rows_b: list[dict]) -> list[Paired]:
    """Every metric of METRICS that applies to at least one record pair, in METRICS order."""
    b_by_key = {_key(r): r for r in rows_b}
    pairs = [(a, b_by_key[_key(a)]) for a in rows_a if _key(a) in b_by_key]
    if not pairs:
        raise RagspecError("the two runs share no record (compare runs over the same records)")
    out = []
    for name, (field, which) in METRICS.items():
        xs = [(float(a[field]), float(b[field])) for a, b in pairs
              if _applies(a, which) and _applies(b, which) and a.get(field) is not None and b.get(field) is not None]
        if not xs:
            continue
        ma, sa = mean_se([x for x, _ in xs])
        mb, sb = mean_se([y for _, y in xs])
        d, sd = mean_se([y - x for x, y in xs])
        out.append(Paired(name, len(xs), ma, sa, mb, sb, d, sd))
    return out


def read_rows(path: str | Path) -> tuple[dict, list[dict]]:
    """An `eval-answers --json` file: its summary (without rows) and its rows."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RagspecError(f"{path}: not an eval-answers --json file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise RagspecError(f"{path}: not an eval-answers --json file (no rows)")
    return {k: v for k, v in data.items() if k != "rows"}, data["rows"]


def read_runs(paths: str) -> tuple[dict, list[dict]]:
    """One run from one file or several joined with commas (record ranges run apart): the first file's summary,
    every file's rows. A record in two of them is one line of error (the ranges overlap)."""
    meta, rows, seen = None, [], set()
    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        m, r = read_rows(path)
        meta = meta or m
        for row in r:
            key = _key(row)
            if key in seen:
                raise RagspecError(f"{path}: record {row['id']} is in two of the files joined ({paths})")
            seen.add(key)
            rows.append(row)
    if meta is None:
        raise RagspecError("name an eval-answers --json file")
    return meta, rows
