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

from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters.base import DraftState


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    nodes: int = 0
    model_ms: float = 0.0  # Σ t(1 + tree size) over the steps
    draft_ms: float = 0.0  # real time spent drafting and selecting
    accepted: list[int] = field(default_factory=list)

    def add(self, other: "Replay") -> None:
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
        node, j = -1, done
        while j < len(output):
            nxt = tree.child(node, output[j])
            if nxt is None:
                break
            node, j = nxt, j + 1
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
            pending = _settle(budget, pending, output[:done], final=False)
        out.draft_ms += (time.perf_counter() - t) * 1000
    if adaptive:
        _settle(budget, pending, output[:done], final=True)
    out.tokens = done
    return out


def _settle(budget, pending, generated, final):
    keep = []
    for full, start in pending:
        if not final and len(generated) - start <= full.max_depth():
            keep.append((full, start))
            continue
        node, path = -1, []
        for tok in generated[start:]:
            nxt = full.child(node, tok)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        budget.observe_proposal(full, path)
    return keep
