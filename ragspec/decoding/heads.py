"""Induction-head calibration for PLD+ (a) (pld-plus.txt §4.2.1); the capture itself is `backends.attention`.

Calibration: greedy-generate continuations of context-heavy prompts, then one teacher-forced forward with
eager attention. For every generated token o_t that occurs in the prompt, r* is its prompt position with the
longest suffix overlap with the output so far; a head scores when its attention row at t-1 peaks at r*.
The best `top` heads (ranked by how often they point at r*) are cached per model/dtype as JSON.

Prompts: the language-reference topics every CPython ships (`pydoc_data.topics`), asked to be summarised
with quotes — real text, available offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ragspec.decoding.backends.attention import eager_attention
from ragspec.paths import ragspec_home

TOPICS = ("with", "assignment", "exceptions", "for", "function", "import", "class", "try")


def _key(model) -> str:
    from ragspec.decoding.backends import cost_key

    return cost_key(model)


def calibration_prompts(tokenizer, n: int = 6, chars: int = 1800) -> list[list[int]]:
    from pydoc_data.topics import topics

    out = []
    for name in TOPICS[:n]:
        text = topics[name][:chars]
        msg = [{"role": "user", "content": f"Summarize this text, quoting its sentences where you can:\n\n{text}"}]
        ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def score_heads(attentions, seq: list[int], prompt_len: int) -> tuple[torch.Tensor, int]:
    """Counts [layers, heads] of rows t-1 whose attention peaks at r*, and how many tokens were scored."""
    layers = len(attentions)
    heads = attentions[0].shape[1]
    counts = torch.zeros(layers, heads)
    scored = 0
    where: dict[int, list[int]] = {}
    for p, tok in enumerate(seq[:prompt_len]):
        where.setdefault(tok, []).append(p)
    for t in range(prompt_len, len(seq)):
        cands = where.get(seq[t])
        if not cands:
            continue

        def overlap(p: int, t: int = t) -> int:
            k = 0
            while p - k - 1 >= 0 and seq[p - k - 1] == seq[t - k - 1] and k < 32:
                k += 1
            return k

        r = max(cands, key=overlap)
        scored += 1
        for li, a in enumerate(attentions):
            peaks = a[0, :, t - 1, :t].argmax(dim=-1)  # [heads]
            counts[li] += (peaks == r).float()
    return counts, scored


def calibrate_heads(model, tokenizer, top: int = 16, new_tokens: int = 64, cache_dir: Path | None = None,
                    force: bool = False) -> list[tuple[int, int]]:
    """The `top` (layer, head) pairs that best point at the copied position; measured once, cached."""
    folder = cache_dir or ragspec_home() / "calibration"
    path = folder / f"heads-{_key(model)}.json"
    if path.exists() and not force:
        data = json.loads(path.read_text())
        if data.get("top") == top:
            return [tuple(x) for x in data["heads"]]
    total = None
    scored = 0
    dev = next(model.parameters()).device
    for prompt in calibration_prompts(tokenizer):
        ids = torch.tensor([prompt], device=dev)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id)
            seq = out[0].tolist()
            with eager_attention(model):
                att = model(input_ids=out, output_attentions=True).attentions
        counts, n = score_heads([a.float().cpu() for a in att], seq, len(prompt))
        total = counts if total is None else total + counts
        scored += n
    rate = total / max(scored, 1)
    flat = torch.argsort(rate.flatten(), descending=True)[:top].tolist()
    heads = [(i // rate.shape[1], i % rate.shape[1]) for i in flat]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"top": top, "heads": heads, "scored_tokens": scored,
                               "rates": [round(float(rate[layer, head]), 4) for layer, head in heads], "key": path.stem}, indent=2))
    tmp.replace(path)
    return heads
