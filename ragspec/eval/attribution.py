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
from ragspec.pipeline.attribution import CopyMatcher
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
        node, path = -1, []
        while i + len(path) < len(answer_ids):
            nxt = tree.child(node, answer_ids[i + len(path)])
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
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

    def as_dict(self) -> dict:
        p = self.tp / self.pred if self.pred else 0.0
        r = self.tp / self.gold if self.gold else 0.0
        f = 2 * p * r / (p + r) if p + r else 0.0
        return {"precision": round(p, 4), "recall": round(r, 4), "f1": round(f, 4), "tokens": self.gold}


def evaluate(path: Path, tokenizer, model=None, method: str = "trie", min_words: int = 3, min_chars: int = 10,
             limit: int | None = None, progress=None) -> dict:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise RagspecError(f"{path} holds no records")
    if limit:
        rows = rows[:limit]
    builder = PromptBuilder(tokenizer, "quote")
    copied, attributed = PRF(), PRF()
    for rec in rows:
        summary, gold = strip_markup(rec["summary"])
        sources = record_sources(rec)
        built = builder.build(rec["question"], sources)
        enc = tokenizer(summary, add_special_tokens=False, return_offsets_mapping=True)
        ans_ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
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
        matcher = CopyMatcher(built.sources, min_words, min_chars)
        for pos in provenance:
            loc = built.locate(pos) if pos >= 0 else None
            if loc:
                matcher.hint(*loc)
        matcher.feed(summary)
        matcher.finish()
        for a, b in offsets:
            while a < b and summary[a].isspace():
                a += 1
            if a >= b:
                continue  # a whitespace-only token carries no label
            g = next((k for s, e, k in gold if s <= a < e), 0)
            p = next((c.source for c in matcher.citations if c.answer_start <= a < c.answer_end), 0)
            copied.gold += g > 0
            copied.pred += p > 0
            copied.tp += g > 0 and p > 0
            attributed.gold += g > 0
            attributed.pred += p > 0
            attributed.tp += g > 0 and p == g
        if progress:
            progress()
    return {"records": len(rows), "method": method, "min_words": min_words, "min_chars": min_chars,
            "copied": copied.as_dict(), "attribution": attributed.as_dict()}
