"""Replay a drafter against a recorded greedy output, without the model.

Greedy verification is deterministic: given the output plain greedy decoding produced, the tokens a draft
tree gets accepted are known without a forward pass (the longest tree path that spells the output, then the
bonus token). So a drafter and its budget can be run over hundreds of recorded answers in seconds, with the
step cost read off the measured cost model t(n): the expected decode time is Σ t(1 + tree size). `ragspec
bench` measures the real thing; this is for trying drafter settings on folds of recorded outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ragspec.decoding.budget import AdaptiveBudget, CostModel, settle
from ragspec.decoding.drafters.base import DraftState


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    nodes: int = 0
    model_ms: float = 0.0  # Σ t(1 + tree size) over the steps
    draft_ms: float = 0.0  # real time spent drafting and selecting
    accepted: list[int] = field(default_factory=list)

    def add(self, other: Replay) -> None:
        self.tokens += other.tokens
        self.steps += other.steps
        self.nodes += other.nodes
        self.model_ms += other.model_ms
        self.draft_ms += other.draft_ms
        self.accepted += other.accepted


def replay(drafter, budget, cost: CostModel, prompt: list[int], output: list[int], max_new_tokens: int) -> Replay:
    """Decode `output` (plain greedy's) again with `drafter` under `budget` (an AdaptiveBudget or a node count)."""
    out = Replay()
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    t = time.perf_counter()
    drafter.prepare(state)
    out.draft_ms += (time.perf_counter() - t) * 1000
    adaptive = isinstance(budget, AdaptiveBudget)
    pending: list = []
    done = 0
    while done < len(output) and done < max_new_tokens:
        remaining = max_new_tokens - done
        t = time.perf_counter()
        cap = budget.max_nodes if adaptive else int(budget)
        full = drafter.propose(state, max(0, min(cap, remaining - 1)))
        tree = budget.select(full) if adaptive else full.truncated(max(0, cap))
        out.draft_ms += (time.perf_counter() - t) * 1000
        j = done + len(tree.follow(output[done:]))
        new = output[done : min(j + 1, len(output), done + remaining)]
        out.steps += 1
        out.nodes += len(tree)
        out.model_ms += cost.time(1 + len(tree))
        out.accepted.append(len(new))
        if adaptive:
            pending.append((full, done))
        done += len(new)
        state.tokens.extend(new)
        t = time.perf_counter()
        drafter.update(state, new)
        if adaptive:
            pending = settle(budget, pending, output[:done], final=False)
        out.draft_ms += (time.perf_counter() - t) * 1000
    if adaptive:
        settle(budget, pending, output[:done], final=True)
    out.tokens = done
    return out


REPLAYABLE = ("none", "pld", "trie", "suffix", "auto", "oracle")  # drafters that need no model to propose


def replay_result(result: dict, prompts: dict, tokenizer, methods: list[str], params: dict | None = None,
                  progress=None, cost: CostModel | None = None) -> dict:
    """Replay `methods` over the recorded vanilla outputs of a `ragspec bench` result (one category or several),
    with that run's own t(n): per category and method the tokens per step, nodes per step and the modelled
    decode speed-up over plain steps (Σ t(1) over Σ t(1 + tree)), beside the run's measured decode speed-up
    when it ran that method. `prompts` maps question_id (str) → prompt row; `params` → drafter settings per
    method. One drafter and one budget per category and method, as in the bench (the budget learns across the
    category's prompts). `cost`: another t(n) to model every step with (a GPU curve, a bigger model's): a
    projection of these outputs onto that verifier, so nothing measured is set beside it."""
    from ragspec.bench.decoding import chat_ids
    from ragspec.decoding.drafters import make_drafter

    bad = [m for m in methods if m not in REPLAYABLE]
    if bad:
        from ragspec.errors import RagspecError

        raise RagspecError(f"cannot replay {', '.join(bad)} without the model (replayable: {', '.join(REPLAYABLE)})")
    cats = result["categories"] if "categories" in result else {result["category"]: result}
    out = {"model": result.get("model"), "max_new_tokens": result.get("max_new_tokens"), "categories": {}}
    for cat, r in cats.items():
        recorded = r.get("vanilla_outputs") or {}
        if not recorded or not (r.get("cost_model") or cost):
            continue  # an older result (no outputs kept) or a fixed budget (no t(n) measured)
        step_cost = cost or CostModel(**r["cost_model"])
        max_new = r.get("max_new_tokens") or result.get("max_new_tokens") or 128
        ids = {qid: chat_ids(tokenizer, prompts[qid]["turns"][0]) for qid in recorded if qid in prompts}
        rows = {}
        for m in methods:
            drafter = make_drafter(m, **(params or {}).get(m, {}))
            budget = 256 if m == "oracle" else AdaptiveBudget(step_cost)
            if m == "oracle":
                drafter.cost = step_cost
            total, replayed = Replay(), 0
            for qid, output in recorded.items():
                if qid not in ids:
                    continue
                replayed += 1
                if m == "oracle":
                    drafter.reference = list(output)
                total.add(replay(drafter, budget, step_cost, ids[qid], output, max_new))
                if progress:
                    progress()
            plain_ms = total.tokens * step_cost.time(1)
            measured = None if cost else r.get("methods", {}).get(m)  # a projection: not that run's machine
            van = None if cost else r.get("methods", {}).get("vanilla")
            if not replayed:
                break  # none of this category's prompts is in the prompts file
            rows[m] = {"prompts": replayed, "tokens_per_step": round(total.tokens / max(total.steps, 1), 3),
                       "nodes_per_step": round(total.nodes / max(total.steps, 1), 2),
                       "decode_speedup_model": round(plain_ms / total.model_ms, 3) if total.model_ms else None,
                       "draft_ms_per_step": round(total.draft_ms / max(total.steps, 1), 3),
                       "measured_tokens_per_step": measured.get("mean_accepted") if measured else None,
                       "measured_decode_speedup": round(measured["decode_tokens_per_s"] / van["decode_tokens_per_s"], 3)
                       if measured and van else None}
        if rows:
            out["categories"][cat] = rows
    return out
