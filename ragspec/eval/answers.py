"""`ragspec eval-answers`: answer quality of the pipeline — metrics and the readers of three question sets.

Metrics (per record, then aggregated by `summarize`):
- `normalize`: the NQ/SQuAD answer normalisation — lower case, punctuation dropped, the articles a/an/the
  dropped, whitespace collapsed (punctuation is every Unicode P* character, not only ASCII, and the text is
  NFKC-normalised first).
- `answer_contains`: some reference, normalised, occurs in the normalised answer as a whole-word run.
- `token_f1`: SQuAD token F1 of the normalised answer against each reference, the best one.
- `is_refusal`: the pipeline's decline (`ragspec.pipeline.declined.is_declined`: the fixed DECLINED string).
- `citation_coverage`: the share of the answer's word tokens (`\\w+` runs and punctuation marks, as the copy
  matcher cuts them) that lie inside a citation's `answer_start:answer_end`.

Readers yield `QARecord`s (question, references, passages, answerable):
- `nq`: nq_open_oracle JSONL(.gz): `question`, `answers`, `ctxs` (the gold passage: `title`, `text`).
- `clapnq`: CLAP NQ JSONL: `input`, `passages` (`title`, `text`), `output[].answer`; a record whose answers are
  all empty is unanswerable (it must be declined). A folder reads its `*_answerable*` and `*_unanswerable*`
  files, `limit` records from each.
- `specbench`: Spec-Bench question.jsonl, `rag` rows: `turns[0]` is 5 passages one per line then the question;
  `reference` (a list of answers, or a list holding that list) the answers.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.pipeline.attribution import WORD
from ragspec.pipeline.declined import is_declined

FORMATS = ("nq", "clapnq", "specbench")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# -- metrics -------------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """SQuAD/NQ normalisation: lower case, no punctuation, no articles, single spaces."""
    text = unicodedata.normalize("NFKC", text or "").lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") or ch in string.punctuation else ch
                   for ch in text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_contains(answer: str, references: Iterable[str]) -> bool:
    """Some non-empty normalised reference occurs in the normalised answer, on word boundaries."""
    a = f" {normalize(answer)} "
    for ref in references:
        r = normalize(ref)
        if r and f" {r} " in a:
            return True
    return False


def _f1(pred: list[str], gold: list[str]) -> float:
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if not pred or not gold:
        return float(pred == gold)
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def token_f1(answer: str, references: Iterable[str]) -> float:
    """SQuAD token F1 against the best reference (0 when there is none)."""
    pred = normalize(answer).split()
    return max((_f1(pred, normalize(ref).split()) for ref in references if ref and ref.strip()), default=0.0)


def is_refusal(text: str) -> bool:
    """The answer declines (the pipeline's fixed DECLINED string; see `ragspec.pipeline.declined`)."""
    return is_declined(text)


def citation_coverage(text: str, citations) -> float | None:
    """Share of the answer's word tokens inside a citation span (None for an empty answer). `citations`:
    Citation objects or their JSON dicts (`answer_start`, `answer_end`)."""
    words = [(m.start(), m.end()) for m in WORD.finditer(text or "")]
    if not words:
        return None
    spans = []
    for c in citations:
        a = c["answer_start"] if isinstance(c, dict) else c.answer_start
        b = c["answer_end"] if isinstance(c, dict) else c.answer_end
        spans.append((a, b))
    inside = sum(1 for s, e in words if any(a <= s and e <= b for a, b in spans))
    return inside / len(words)


# -- records -------------------------------------------------------------------------------------------------
@dataclass
class QARecord:
    id: str
    question: str
    references: list[str]  # acceptable answers; empty for an unanswerable question
    passages: list[tuple[str, str]] = field(default_factory=list)  # (title, text): the record's own sources
    answerable: bool = True


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RagspecError(f"{path}:{n}: not JSON ({exc.msg})") from None
                if not isinstance(rec, dict):
                    raise RagspecError(f"{path}:{n}: a record must be a JSON object")
                yield n, rec
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise RagspecError(f"{path} does not exist") from None
        raise RagspecError(f"{path}: cannot read it ({exc})") from None


def _need(rec: dict, key: str, path: Path, n: int, kind=None):
    if key not in rec:
        raise RagspecError(f"{path}:{n}: missing '{key}' (is this the right --format?)")
    v = rec[key]
    if kind is not None and not isinstance(v, kind):
        raise RagspecError(f"{path}:{n}: '{key}' should be a {kind.__name__ if isinstance(kind, type) else 'list'}")
    return v


def _strings(v) -> list[str]:
    """Answers given as a string, a list of strings, or a list holding lists of strings."""
    if isinstance(v, str):
        return [v]
    out = []
    for x in v or []:
        out.extend(_strings(x))
    return out


def read_nq(path: Path, limit: int | None = None) -> list[QARecord]:
    out = []
    for n, rec in _json_lines(path):
        q = _need(rec, "question", path, n, str)
        answers = _strings(_need(rec, "answers", path, n, list))
        ctxs = rec.get("ctxs") or []
        gold = [c for c in ctxs if isinstance(c, dict) and c.get("isgold")] or [c for c in ctxs if isinstance(c, dict)]
        passages = [(str(c.get("title") or ""), str(c.get("text") or "")) for c in gold[:1] if c.get("text")]
        out.append(QARecord(str(rec.get("id", n)), q, answers, passages, True))
        if limit and len(out) >= limit:
            break
    return out


def _read_clapnq_file(path: Path, limit: int | None) -> list[QARecord]:
    out = []
    for n, rec in _json_lines(path):
        q = _need(rec, "input", path, n, str)
        passages = [(str(p.get("title") or ""), str(p.get("text") or ""))
                    for p in _need(rec, "passages", path, n, list) if isinstance(p, dict) and p.get("text")]
        answers = [o.get("answer") for o in rec.get("output") or [] if isinstance(o, dict)]
        answers = [a.strip() for a in answers if isinstance(a, str) and a.strip()]
        out.append(QARecord(str(rec.get("id", n)), q, answers, passages, bool(answers)))
        if limit and len(out) >= limit:
            break
    return out


def read_clapnq(path: Path, limit: int | None = None) -> list[QARecord]:
    """One CLAP NQ file, or a folder: its answerable then its unanswerable file, `limit` from each."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".gz") and "answerable" in p.name)
        ans = [p for p in files if "unanswerable" not in p.name]
        una = [p for p in files if "unanswerable" in p.name]
        if not ans and not una:
            raise RagspecError(f"{path} holds no *answerable*.jsonl / *unanswerable*.jsonl file")
        return [r for p in ans + una for r in _read_clapnq_file(p, limit)]
    return _read_clapnq_file(path, limit)


def read_specbench(path: Path, limit: int | None = None) -> list[QARecord]:
    out = []
    for n, rec in _json_lines(path):
        if rec.get("category") != "rag":
            continue
        turns = _need(rec, "turns", path, n, list)
        if not turns or not isinstance(turns[0], str):
            raise RagspecError(f"{path}:{n}: 'turns' should hold the prompt text")
        lines = [line for line in turns[0].split("\n") if line.strip()]
        if len(lines) < 2:
            raise RagspecError(f"{path}:{n}: a rag prompt should be passages, one per line, then the question")
        refs = _strings(rec.get("reference") or [])
        out.append(QARecord(str(rec.get("question_id", n)), lines[-1].strip(), refs,
                            [("", line) for line in lines[:-1]], True))
        if limit and len(out) >= limit:
            break
    if not out:
        raise RagspecError(f"{path} has no rows of category 'rag' (is this Spec-Bench's question.jsonl?)")
    return out


def read_records(path: Path, fmt: str, limit: int | None = None, skip: int = 0) -> list[QARecord]:
    """The records after the first `skip`, at most `limit` of them (a CLAP NQ folder: of each file), so tuning
    and report records can be kept apart."""
    if fmt not in FORMATS:
        raise RagspecError(f"--format '{fmt}' is not one of {', '.join(FORMATS)}")
    if not path.exists():
        raise RagspecError(f"{path} does not exist")
    if path.is_dir() and fmt != "clapnq":
        raise RagspecError(f"{path} is a folder; --format {fmt} reads one file")
    reader = {"nq": read_nq, "clapnq": read_clapnq, "specbench": read_specbench}[fmt]
    recs = reader(path, None if limit is None else skip + limit)
    if skip:
        end = None if limit is None else skip + limit
        if fmt == "clapnq" and path.is_dir():
            recs = [r for r in recs if r.answerable][skip:end] + [r for r in recs if not r.answerable][skip:end]
        else:
            recs = recs[skip:end]
    if not recs:
        raise RagspecError(f"{path} holds no records")
    return recs


def pick_records(records: list[QARecord], numbers: str) -> list[QARecord]:
    """The records numbered in `numbers` ("1,21,35": 1-based, in the order read; a CLAP NQ folder's answerable
    file first), so the few records whose prompt a setting changes can be rerun alone."""
    picked = []
    for part in numbers.split(","):
        try:
            n = int(part)
        except ValueError:
            raise RagspecError(f"--records takes record numbers such as 1,21,35, not '{numbers}'") from None
        if not 1 <= n <= len(records):
            raise RagspecError(f"--records: there is no record {n} (1 to {len(records)} were read)")
        if n in picked:
            raise RagspecError(f"--records names record {n} twice")
        picked.append(n)
    return [records[n - 1] for n in picked]


def record_sources(rec: QARecord) -> list:
    """The record's own passages as numbered sources (the title, if any, labels each)."""
    from ragspec.pipeline.prompt import SourceText

    return [SourceText(i, text, path=title or f"passage {i}", title=title)
            for i, (title, text) in enumerate(rec.passages, 1)]


# -- scoring -------------------------------------------------------------------------------------------------
def score(rec: QARecord, answer) -> dict:
    """One record's row: the answer, its metrics (None where they do not apply) and its timing."""
    s = answer.stats
    declined = bool(answer.declined)
    row = {
        "id": rec.id, "question": rec.question, "answerable": rec.answerable, "answer": answer.text,
        "declined": declined,
        "answer_contains": answer_contains(answer.text, rec.references) if rec.answerable else None,
        "token_f1": round(token_f1(answer.text, rec.references), 4) if rec.answerable else None,
        "citation_coverage": None if declined else citation_coverage(answer.text, answer.citations),
        "citations": len(answer.citations),
        "new_tokens": s.new_tokens, "decode_ms": round(s.decode_ms, 1), "ttft_ms": round(s.ttft_ms, 1),
        "prompt_tokens": s.prompt_tokens, "source_tokens": s.source_tokens, "mean_accepted": round(s.mean_accepted, 3),
        "cache_reused_tokens": s.cache_reused_tokens, "cache_computed_tokens": s.cache_computed_tokens,
        "speedup_estimate": None if s.speedup_estimate is None else round(s.speedup_estimate, 3),
        "finish_reason": s.finish_reason, "relevance": None if s.relevance is None else round(s.relevance, 4),
        "backend": s.backend, "dtype": s.dtype,
    }
    if row["citation_coverage"] is not None:
        row["citation_coverage"] = round(row["citation_coverage"], 4)
    return row


def _mean(xs: list) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def summarize(rows: list[dict], **meta) -> dict:
    """Aggregate rows. Quality over answerable records; refusal rate over unanswerable ones (None when the set
    has none); citation coverage over answers that are not declined. Speed: decode tok/s = all new tokens over
    all decode time; speed-up = the pipeline's per-answer `speedup_estimate` (new tokens × the measured
    one-token forward time, over the decode time) combined the same way, i.e. weighted by decode time."""
    ans = [r for r in rows if r["answerable"]]
    una = [r for r in rows if not r["answerable"]]
    tokens = sum(r["new_tokens"] for r in rows)
    decode_s = sum(r["decode_ms"] for r in rows) / 1000
    timed = [r for r in rows if r["speedup_estimate"] is not None and r["decode_ms"] > 0]
    t_ms = sum(r["decode_ms"] for r in timed)
    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"]]
    return {
        **meta,
        "records": len(rows),
        "answerable": len(ans),
        "unanswerable": len(una),
        "answer_contains": _mean([r["answer_contains"] for r in ans]),
        "token_f1": _mean([r["token_f1"] for r in ans]),
        "refusal_rate": _mean([r["declined"] for r in una]),
        "false_refusal_rate": _mean([r["declined"] for r in ans]),
        "citation_coverage": _mean([r["citation_coverage"] for r in rows]),
        "ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else None,
        "decode_tokens_per_s": round(tokens / decode_s, 3) if decode_s > 0 else None,
        "speedup": round(sum(r["speedup_estimate"] * r["decode_ms"] for r in timed) / t_ms, 3) if t_ms > 0 else None,
        "mean_new_tokens": round(tokens / len(rows), 2) if rows else None,
        "mean_prompt_tokens": _mean([r.get("prompt_tokens") or None for r in rows]),  # declined: no prompt
        "mean_source_tokens": _mean([r.get("source_tokens") for r in rows if r.get("prompt_tokens")]),
        "mean_cache_reused_tokens": _mean([r.get("cache_reused_tokens") for r in rows if r.get("prompt_tokens")]),
        "mean_accepted": _mean([r.get("mean_accepted") for r in rows if r["new_tokens"]]),
        "rows": rows,
    }
