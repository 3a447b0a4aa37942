"""Metadata filters: which documents a search may return.

Two spellings of one thing. `--where` strings (`path=tutorial/*`, `year>=2020`, `type in md,rst`, `lang!=de`) and
LangChain's dict shape (`{"path": "tutorial/*", "year": {"$gte": 2020}, "type": {"$in": ["md", "rst"]}}`, with
`$eq $ne $gt $gte $lt $lte $in $nin $glob` and `$and`/`$or` lists). A string with `*`, `?` or `[` after `=` is a
glob. Ranges compare numbers as numbers and ISO dates (`modified>=2024-01-01`) as dates. The result is a set of
document ids, which the retriever turns into allowed chunk ids for FAISS and BM25 (never a post-filter).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ragspec.errors import RagspecError

OPS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$glob")
WHERE = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|!=|==|=|>|<|\s+in\s+)\s*(.*?)\s*$", re.DOTALL)
SYMBOL = {"=": "$eq", "==": "$eq", "!=": "$ne", ">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte"}
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")

Predicate = Callable[[dict], bool]


def parse_where(expressions: list[str] | str) -> dict:
    """`--where` strings → the dict shape (all of them must hold)."""
    if isinstance(expressions, str):
        expressions = [expressions]
    parts = []
    for e in expressions:
        m = WHERE.match(e)
        if not m or not m.group(3):
            raise RagspecError(f"cannot read filter {e!r}: write FIELD=VALUE, FIELD>=VALUE (> < <= != too) or "
                               "FIELD in A,B,C")
        field, op, raw = m.group(1), m.group(2).strip(), m.group(3)
        if op == "in":
            parts.append({field: {"$in": [_scalar(v.strip()) for v in raw.split(",") if v.strip()]}})
        elif op in ("=", "==") and _is_glob(raw):
            parts.append({field: {"$glob": raw}})
        else:
            parts.append({field: {SYMBOL[op]: _scalar(raw)}})
    return parts[0] if len(parts) == 1 else {"$and": parts}


def as_filter(value: Any) -> dict | None:
    """A filter in any accepted form (None, a dict, a `--where` string or a list of them) → the dict shape."""
    if value is None or value == {} or value == []:
        return None
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return parse_where(value)
    if isinstance(value, dict):
        return value
    raise RagspecError(f"a filter is a dict or --where strings, not {type(value).__name__}")


def fields_of(flt: dict) -> set[str]:
    """Every field a filter names."""
    out: set[str] = set()
    for k, v in flt.items():
        if k in ("$and", "$or"):
            for sub in v:
                out |= fields_of(sub)
        else:
            out.add(k)
    return out


def compile_filter(flt: dict, known: set[str]) -> Predicate:
    """A predicate over a document's fields; an unknown field is one error line naming the known ones."""
    unknown = sorted(fields_of(flt) - known)
    if unknown:
        raise RagspecError(f"unknown filter field '{unknown[0]}'; this index knows: {', '.join(sorted(known))}")
    return _compile(flt)


def _compile(flt: dict) -> Predicate:
    if not isinstance(flt, dict):
        raise RagspecError(f"a filter must be a dict, not {type(flt).__name__}")
    preds: list[Predicate] = []
    for k, v in flt.items():
        if k in ("$and", "$or"):
            if not isinstance(v, list):
                raise RagspecError(f"{k} takes a list of filters")
            subs = [_compile(x) for x in v]
            preds.append((lambda d, s=subs: all(p(d) for p in s)) if k == "$and"
                         else (lambda d, s=subs: any(p(d) for p in s)))
        elif k.startswith("$"):
            raise RagspecError(f"unknown filter operator '{k}' (use $and, $or)")
        elif isinstance(v, dict):
            for op, bound in v.items():
                if op not in OPS:
                    raise RagspecError(f"unknown filter operator '{op}' on '{k}' (one of {' '.join(OPS)})")
                preds.append(_test(k, op, bound))
        elif isinstance(v, list):
            preds.append(_test(k, "$in", v))
        else:
            preds.append(_test(k, "$glob" if isinstance(v, str) and _is_glob(v) else "$eq", v))
    return lambda d: all(p(d) for p in preds)


def _test(field: str, op: str, bound: Any) -> Predicate:
    if op in ("$in", "$nin"):
        if not isinstance(bound, (list, tuple)):
            raise RagspecError(f"{op} on '{field}' takes a list")
        def hit(d: dict) -> bool:
            return field in d and any(_equal(d[field], b) for b in bound)

        return hit if op == "$in" else (lambda d: not hit(d))
    if op == "$glob":
        return lambda d: isinstance(d.get(field), str) and fnmatch.fnmatchcase(d[field], str(bound))
    if op == "$eq":
        return lambda d: field in d and _equal(d[field], bound)
    if op == "$ne":
        return lambda d: not (field in d and _equal(d[field], bound))
    sign = {"$gt": lambda c: c > 0, "$gte": lambda c: c >= 0, "$lt": lambda c: c < 0, "$lte": lambda c: c <= 0}[op]

    def ranged(d: dict) -> bool:
        c = _compare(d.get(field), bound)
        return c is not None and sign(c)

    return ranged


def _equal(value: Any, bound: Any) -> bool:
    if _number(value) is not None and _number(bound) is not None:
        return _number(value) == _number(bound)
    return str(value) == str(bound)


def _compare(value: Any, bound: Any) -> int | None:
    """-1/0/1 of value against bound, as numbers, else as dates, else as strings; None when incomparable."""
    if value is None:
        return None
    for conv in (_number, _date):
        a, b = conv(value), conv(bound)
        if a is not None and b is not None:
            return (a > b) - (a < b)
    if isinstance(value, str) and isinstance(bound, str):
        return (value > bound) - (value < bound)
    return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _date(v: Any) -> float | None:
    """Seconds since the epoch of an ISO date (UTC when no zone is given); numbers are already that."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and DATE.match(v.strip()):
        d = datetime.fromisoformat(v.strip().replace("Z", "+00:00"))
        return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()
    return None


def _scalar(raw: str) -> Any:
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    if re.fullmatch(r"[+-]?\d+", raw):
        return int(raw)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?", raw):
        return float(raw)
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _is_glob(s: str) -> bool:
    return any(ch in s for ch in "*?[")
