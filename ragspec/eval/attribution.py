"""`ragspec eval-attribution`: copied-span attribution on QuoteSum (pld-plus.txt Appendix D protocol).

Each record's gold summary (its `[ k quoted span ]` markup stripped) is teacher-forced after the prompt the
pipeline builds from the record's sources: the drafter runs exactly as in decoding with the model's output
fixed to the gold tokens (each step it proposes a tree, the longest path agreeing with the gold continuation
is accepted, then one model-made token) — so drafts carry the same provenance they would carry if the model
had written the summary. PLD+ (h) takes its hidden states from one forward over prompt + summary. The answer
then goes through the pipeline's copy matcher, and per summary token we score (a) copied or not and (b) the
source it is attributed to, against the gold markup.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.drafters.base import DraftState
from ragspec.errors import RagspecError
from ragspec.pipeline.attribution import DISAMBIGUATIONS, CopyMatcher
from ragspec.pipeline.prompt import PromptBuilder, SourceText

MARK = re.compile(r"\[\s*(\d+)\s+(.*?)\s*\]")


def strip_markup(summary: str) -> tuple[str, list[tuple[int, int, int]]]:
    """The plain summary and its gold spans (start, end, source number)."""
    out, spans, last = [], [], 0
    pos = 0
    for m in MARK.finditer(summary):
        out.append(summary[last : m.start()])
        pos += m.start() - last
        quote = m.group(2)
        spans.append((pos, pos + len(quote), int(m.group(1))))
        out.append(quote)
        pos += len(quote)
        last = m.end()
    out.append(summary[last:])
    return "".join(out), spans


def record_sources(rec: dict) -> list[SourceText]:
    """Sources 1..8 of a record, each its title line then its text (annotators quote titles too)."""
    out = []
    for k in range(1, 9):
        text = (rec.get(f"source{k}") or "").strip()
        title = (rec.get(f"title{k}") or "").strip()
        if text:
            out.append(SourceText(k, f"{title}\n{text}" if title else text, path=f"source {k}", title=title))
    return out


def teacher_forced_sources(drafter, prompt_ids, answer_ids, segments, hidden=None) -> list[int]:
    """Per answer token: the context position its accepted draft copied, -1 for model-made tokens."""
    state = DraftState(tokens=list(prompt_ids), prompt_len=len(prompt_ids), segments=segments)
    drafter.prepare(state)
    out: list[int] = []
    i = 0
    while i < len(answer_ids):
        if hidden is not None:
            state.hidden = hidden[: len(state.tokens) - 1]
        tree = drafter.propose(state, 64)
        path = tree.follow(answer_ids[i:])
        new = [tree.tokens[n] for n in path]
        out += [tree.sources[n] for n in path]
        if i + len(path) < len(answer_ids):  # the bonus token, made by the model
            new.append(answer_ids[i + len(path)])
            out.append(-1)
        i += len(new)
        state.tokens.extend(new)
        drafter.update(state, new)
    return out


@dataclass
class PRF:
    tp: int = 0
    pred: int = 0
    gold: int = 0

    def __add__(self, other: PRF) -> PRF:
        return PRF(self.tp + other.tp, self.pred + other.pred, self.gold + other.gold)

    def as_dict(self) -> dict:
        p = self.tp / self.pred if self.pred else 0.0
        r = self.tp / self.gold if self.gold else 0.0
        f = 2 * p * r / (p + r) if p + r else 0.0
        return {"precision": round(p, 4), "recall": round(r, 4), "f1": round(f, 4), "tokens": self.gold}


@dataclass
class Prepared:
    """One record after the expensive part (prompt, tokenization, teacher-forced drafting): what the matcher
    needs to be run again under any setting."""

    summary: str
    gold: list  # (start, end, source number) in `summary`
    sources: list  # SourceText, as in the prompt
    hints: list  # (source number, char offset) of every accepted draft token
    offsets: list  # (start, end) of every summary token
    question: str = ""


def load_records(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise RagspecError(f"{path} holds no records")
    return rows[:limit] if limit else rows


def prepare(rec: dict, builder: PromptBuilder, tokenizer, model=None, method: str = "trie") -> Prepared:
    summary, gold = strip_markup(rec["summary"])
    sources = record_sources(rec)
    built = builder.build(rec["question"], sources)
    enc = tokenizer(summary, add_special_tokens=False, return_offsets_mapping=True)
    ans_ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    hidden = None
    drafter = make_drafter(method, model, tokenizer)
    if getattr(drafter, "attention_heads", None):
        raise RagspecError("eval-attribution teacher-forces without attention rows; use none, pld, trie or pldplus-h")
    if drafter.hidden_layer is not None:
        import torch

        with torch.inference_mode():
            out = model(input_ids=torch.tensor([built.ids + ans_ids]), output_hidden_states=True)
        hidden = out.hidden_states[drafter.hidden_layer][0].float()
    provenance = teacher_forced_sources(drafter, built.ids, ans_ids, built.segments, hidden)
    hints = [loc for loc in (built.locate(p) if p >= 0 else None for p in provenance) if loc]
    return Prepared(summary, gold, list(built.sources), hints, offsets, rec["question"])


def score(rec: Prepared, setting: dict) -> tuple[PRF, PRF]:
    """(copied, attributed) token counts of one prepared record under one matcher setting."""
    setting = dict(setting)
    question = rec.question if setting.pop("skip_question", False) else None
    matcher = CopyMatcher(rec.sources, **setting, question=question)
    for loc in rec.hints:
        matcher.hint(*loc)
    matcher.feed(rec.summary)
    matcher.finish()
    copied, attributed = PRF(), PRF()
    for a, b in rec.offsets:
        while a < b and rec.summary[a].isspace():
            a += 1
        if a >= b:
            continue  # a whitespace-only token carries no label
        g = next((k for s, e, k in rec.gold if s <= a < e), 0)
        p = next((c.source for c in matcher.citations if c.answer_start <= a < c.answer_end), 0)
        copied.gold += g > 0
        copied.pred += p > 0
        copied.tp += g > 0 and p > 0
        attributed.gold += g > 0
        attributed.pred += p > 0
        attributed.tp += g > 0 and p == g
    return copied, attributed


def score_all(prepared: list[Prepared], setting: dict) -> dict:
    copied, attributed = PRF(), PRF()
    for rec in prepared:
        c, a = score(rec, setting)
        copied, attributed = copied + c, attributed + a
    return {"copied": copied.as_dict(), "attribution": attributed.as_dict()}


def evaluate(path: Path, tokenizer, model=None, method: str = "trie", min_words: int = 3, min_chars: int = 10,
             limit: int | None = None, progress=None, **rule) -> dict:
    rows = load_records(path, limit)
    builder = PromptBuilder(tokenizer, "quote")
    copied, attributed = PRF(), PRF()
    setting = {"min_words": min_words, "min_chars": min_chars, **rule}
    for rec in rows:
        c, a = score(prepare(rec, builder, tokenizer, model, method), setting)
        copied, attributed = copied + c, attributed + a
        if progress:
            progress()
    return {"records": len(rows), "method": method, **setting,
            "copied": copied.as_dict(), "attribution": attributed.as_dict()}


# -- K-fold selection ------------------------------------------------------------------------------------------
def fold_of(n: int, k: int) -> list[int]:
    """The fold of each of n records: record i (file order) is in fold i % k. Deterministic, and each record is
    held out exactly once."""
    if k < 2 or k > n:
        raise RagspecError(f"--folds must be between 2 and the number of records ({n}), got {k}")
    return [i % k for i in range(n)]


def default_grid() -> list[dict]:
    """The settings chosen among: the length limits and the disambiguation rule."""
    return [{"min_words": w, "min_chars": c, "chars_one_word": o, "disambiguation": d, "skip_question": q}
            for w in (2, 3, 4, 5) for c in (8, 10, 12, 15, 20) for o in (False, True) for d in DISAMBIGUATIONS
            for q in (False, True)]


CRITERIA = ("pooled", "worst-fold")


def select(counts: list[list[tuple[PRF, PRF]]], groups: list[list[int]], min_precision: float = 0.98,
           criterion: str = "pooled") -> int:
    """The setting (index into counts) chosen on the training records, given as groups (their folds).
    `pooled`: the best attribution F1 over all of them, among the settings whose attribution precision there is
    at least `min_precision` (all settings if none is). `worst-fold`: the same on each group's own figures, the
    worst group counting (the best lowest F1 among the settings whose lowest precision reaches
    `min_precision`), as the acceptance asks of every held-out fold. Ties go to the higher precision, then to
    the earlier setting."""
    if criterion not in CRITERIA:
        raise RagspecError(f"criterion must be one of {CRITERIA}, not {criterion!r}")
    parts = [[i for g in groups for i in g]] if criterion == "pooled" else groups
    scored = []
    for s, per_rec in enumerate(counts):
        figs = [sum((per_rec[i][1] for i in g), PRF()).as_dict() for g in parts]
        p, f = min(x["precision"] for x in figs), min(x["f1"] for x in figs)
        scored.append((p >= min_precision, f, p, -s))
    return -max(scored)[3]


def cross_validate(prepared: list[Prepared], k: int, grid: list[dict] | None = None,
                   min_precision: float = 0.98, progress=None, criterion: str = "pooled") -> dict:
    """For each fold: choose the setting on the other k-1 folds (`select`), score the held-out fold with it."""
    grid = grid or default_grid()
    folds = fold_of(len(prepared), k)
    counts = []  # counts[setting][record] = (copied, attributed): every record scored once per setting
    for setting in grid:
        counts.append([score(rec, setting) for rec in prepared])
        if progress:
            progress()
    out = []
    for f in range(k):
        groups = [[i for i, g in enumerate(folds) if g == h] for h in range(k) if h != f]
        train = [i for g in groups for i in g]
        test = [i for i, g in enumerate(folds) if g == f]
        s = select(counts, groups, min_precision, criterion)
        cop = sum((counts[s][i][0] for i in test), PRF())
        att = sum((counts[s][i][1] for i in test), PRF())
        trained = sum((counts[s][i][1] for i in train), PRF()).as_dict()
        out.append({"fold": f, "records": len(test), "setting": grid[s], "train_attribution": trained,
                    "copied": cop.as_dict(), "attribution": att.as_dict()})
    mean, spread = {}, {}
    for part in ("copied", "attribution"):
        mean[part], spread[part] = {}, {}
        for m in ("precision", "recall", "f1"):
            vals = [r[part][m] for r in out]
            mu = sum(vals) / k
            mean[part][m] = round(mu, 4)
            spread[part][m] = {"min": min(vals), "max": max(vals),
                               "std": round((sum((v - mu) ** 2 for v in vals) / (k - 1)) ** 0.5, 4)}
    return {"records": len(prepared), "k": k, "split": "record i (file order) is held out in fold i % k",
            "criterion": criterion, "min_precision": min_precision,
            "selection": (f"max attribution F1 on the other folds pooled, among settings with precision >= "
                          f"{min_precision} there (all if none), ties to higher precision" if criterion == "pooled" else
                          f"max of the lowest attribution F1 over the other folds, among settings whose lowest "
                          f"precision there is >= {min_precision} (all if none), ties to higher precision"),
            "grid": grid, "folds": out, "mean": mean, "spread": spread}
