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
SYMBOLS = (">=", "<=", "!=", "==", "=", ">", "<")  # two-character ones first
SYMBOL = {"=": "$eq", "==": "$eq", "!=": "$ne", ">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte"}
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")
# A filter arrives from HTTP bodies too, so its size is capped before any work scales with it: one expression or
# string value, the `--where` strings, the $and/$or nesting, the conditions in all, the values of one $in.
MAX_CHARS = 1000
MAX_EXPRESSIONS = 32
MAX_DEPTH = 8
MAX_TERMS = 64
MAX_VALUES = 256
SCALARS = (str, int, float, bool, type(None))

Predicate = Callable[[dict], bool]


def parse_where(expressions: list[str] | str) -> dict:
    """`--where` strings → the dict shape (all of them must hold)."""
    if isinstance(expressions, str):
        expressions = [expressions]
    if len(expressions) > MAX_EXPRESSIONS:
        raise RagspecError(f"a filter has at most {MAX_EXPRESSIONS} --where expressions, not {len(expressions)}")
    parts = [_parse_one(e) for e in expressions]
    return parts[0] if len(parts) == 1 else {"$and": parts}


def _parse_one(e: str) -> dict:
    """One `FIELD OP VALUE` read left to right (no regex over the whole string: nothing can backtrack); its
    length is checked first."""
    if len(e) > MAX_CHARS:
        raise RagspecError(f"filter on '{_field_at(e.lstrip()[:64]) or '?'}' is {len(e):,} characters long; "
                           f"at most {MAX_CHARS:,}")
    s = e.strip()
    field = _field_at(s)
    rest = s[len(field):]
    op = None
    after = rest.lstrip()
    for sym in SYMBOLS:
        if after.startswith(sym):
            op, raw = sym, after[len(sym):].strip()
            break
    else:
        if len(after) < len(rest) and after[:2] == "in" and after[2:3].isspace():  # FIELD in A,B
            op, raw = "in", after[2:].strip()
    if not field or op is None or not raw:
        raise RagspecError(f"cannot read filter {_short(e)!r}: write FIELD=VALUE, FIELD>=VALUE (> < <= != too) or "
                           "FIELD in A,B,C")
    if op == "in":
        return {field: {"$in": [_scalar(v) for v in raw.split(",") if v.strip()]}}
    if op in ("=", "==") and _is_glob(raw):
        return {field: {"$glob": raw}}
    return {field: {SYMBOL[op]: _scalar(raw)}}


def _field_at(s: str) -> str:
    """The field name that starts `s` (a letter or _, then letters, digits, _ . -), or ''."""
    if not s or not (s[0] == "_" or (s[0].isascii() and s[0].isalpha())):
        return ""
    i = 1
    while i < len(s) and (s[i].isalnum() or s[i] in "_.-"):
        i += 1
    return s[:i]


def as_filter(value: Any) -> dict | None:
    """A filter in any accepted form (None, a dict, a `--where` strings or a list of them) → the dict shape,
    checked (`check_filter`)."""
    if value is None or value == {} or value == []:
        return None
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        flt = parse_where(value)
    elif isinstance(value, dict):
        flt = value
    else:
        raise RagspecError(f"a filter is a dict or --where strings, not {type(value).__name__}")
    check_filter(flt)
    return flt


def check_filter(flt: Any) -> None:
    """Refuse, in one line naming the field, a filter of the wrong shape or over the caps; after it the filter
    compiles and evaluates without error."""
    terms = [0]

    def walk(node: Any, depth: int, where: str) -> None:
        terms[0] += 1
        if terms[0] > MAX_TERMS:
            raise RagspecError(f"filter: more than {MAX_TERMS} conditions and sub-filters")
        if not isinstance(node, dict):
            raise RagspecError(f"filter: {where} takes filters (dicts), not {_kind(node)}")
        if depth > MAX_DEPTH:
            raise RagspecError(f"filter: $and/$or nested deeper than {MAX_DEPTH} levels")
        for k, v in node.items():
            if k in ("$and", "$or"):
                if not isinstance(v, list):
                    raise RagspecError(f"filter: {k} takes a list of filters, not {_kind(v)}")
                for sub in v:
                    walk(sub, depth + 1, k)
            elif k.startswith("$"):
                raise RagspecError(f"filter: unknown operator '{_short(k)}' (use $and, $or)")
            else:
                _check_field(k, v, terms)

    walk(flt, 0, "a filter")


def _check_field(field: str, v: Any, terms: list[int]) -> None:
    if len(field) > 200:
        raise RagspecError(f"filter field '{_short(field)}' is {len(field):,} characters long; at most 200")
    ops = v if isinstance(v, dict) else {"$in": v} if isinstance(v, list) else {"$eq": v}
    for op, bound in ops.items():
        terms[0] += 1
        if terms[0] > MAX_TERMS:
            raise RagspecError(f"filter: more than {MAX_TERMS} conditions and sub-filters (at '{_short(field)}')")
        if op not in OPS:
            raise RagspecError(f"filter '{_short(field)}': unknown operator '{_short(op)}' (one of {' '.join(OPS)})")
        if op in ("$in", "$nin"):
            if not isinstance(bound, (list, tuple)):
                raise RagspecError(f"filter '{_short(field)}': {op} takes a list, not {_kind(bound)}")
            if len(bound) > MAX_VALUES:
                raise RagspecError(f"filter '{_short(field)}': {op} has {len(bound):,} values; at most {MAX_VALUES}")
            for b in bound:
                _check_value(field, op, b)
        else:
            _check_value(field, op, bound)


def _check_value(field: str, op: str, b: Any) -> None:
    name = _short(field)
    if not isinstance(b, SCALARS):
        raise RagspecError(f"filter '{name}': {op} takes a string, number, true/false or null, not {_kind(b)}")
    if isinstance(b, str) and len(b) > MAX_CHARS:
        raise RagspecError(f"filter '{name}': a value is {len(b):,} characters long; at most {MAX_CHARS:,}")
    if isinstance(b, int) and not isinstance(b, bool):
        try:
            float(b)
        except OverflowError:
            raise RagspecError(f"filter '{name}': the number {_short(str(b))} is too large") from None
    if op in ("$gt", "$gte", "$lt", "$lte") and isinstance(b, str) and DATE.match(b.strip()) and _date(b) is None:
        raise RagspecError(f"filter '{name}': {b.strip()!r} is not a date (YYYY-MM-DD, optionally a time)")


def _kind(v: Any) -> str:
    return {dict: "a dict", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _short(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[:n] + f"… ({len(s):,} characters)"


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
    """A predicate over a document's fields; a malformed filter or an unknown field is one error line (naming
    the known ones)."""
    check_filter(flt)
    unknown = sorted(fields_of(flt) - known)
    if unknown:
        raise RagspecError(f"unknown filter field '{_short(unknown[0])}'; this index knows: {', '.join(sorted(known))}")
    return _compile(flt)


def _compile(flt: dict) -> Predicate:
    """The predicate of a filter `check_filter` passed."""
    preds: list[Predicate] = []
    for k, v in flt.items():
        if k in ("$and", "$or"):
            subs = [_compile(x) for x in v]
            preds.append((lambda d, s=subs: all(p(d) for p in s)) if k == "$and"
                         else (lambda d, s=subs: any(p(d) for p in s)))
        elif isinstance(v, dict):
            preds.extend(_test(k, op, bound) for op, bound in v.items())
        elif isinstance(v, list):
            preds.append(_test(k, "$in", v))
        else:
            preds.append(_test(k, "$glob" if isinstance(v, str) and _is_glob(v) else "$eq", v))
    return lambda d: all(p(d) for p in preds)


def _test(field: str, op: str, bound: Any) -> Predicate:
    if op in ("$in", "$nin"):
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
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):  # an int past float's range is no number to compare
        return None


def _date(v: Any) -> float | None:
    """Seconds since the epoch of an ISO date (UTC when no zone is given); numbers are already that."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return _number(v)
    if isinstance(v, str) and DATE.match(v.strip()):
        try:
            d = datetime.fromisoformat(v.strip().replace("Z", "+00:00"))
            return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()
        except (ValueError, OverflowError):  # shaped like a date but none (2024-02-30): compared as text
            return None
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
