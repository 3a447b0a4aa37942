"""`auto`: several drafters at once under one cost-aware budget, so decoding never loses to plain steps.

Every part proposes a tree each step; the trees merge into one tree sharing the root (a token two parts
propose under the same parent is one node, scored by the first part that proposed it, so list the parts
best first). A scored part (`suffix`) keeps its confidences and groups. An unscored part's node gets a
neutral confidence and a group of its own per part and depth, so the budget's `ScoreCalibration` learns,
online, how often each part's nodes are accepted at each depth. `AdaptiveBudget.select` then keeps the nodes
expected to pay for their share of the forward — whichever part drafted them — and none at all, a plain step,
when nothing is expected to pay. Where the output copies the sources the context drafter's long chains win;
where it does not, a model-based part may, or the step stays plain.
"""

from __future__ import annotations

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.tree import DraftTree

UNSCORED_CONF = 0.5  # an unscored part's prior per node (its calibration cells learn the real rate)
PART_GROUPS = 16  # scored parts use groups below this; part k's depth-d nodes use PART_GROUPS + 4k + min(d, 4) - 1


def merge(tree: DraftTree, part: DraftTree, index: int) -> None:
    """Add `part`'s nodes to `tree` (scored), sharing equal prefixes."""
    where = {-1: -1}
    for i, tok in enumerate(part.tokens):
        parent = where[part.parents[i]]
        if part.scored:
            conf, group = part.confs[i], part.groups[i]
        else:
            conf, group = UNSCORED_CONF, PART_GROUPS + 4 * index + min(part.depths[i], 4) - 1
        where[i] = tree.add(parent, tok, part.sources[i], conf, group)


class AutoDrafter:
    name = "auto"
    hidden_layer = None

    def __init__(self, parts: list):
        if not parts:
            raise ValueError("auto drafting needs at least one part")
        if any(getattr(p, "hidden_layer", None) is not None or getattr(p, "attention_heads", ()) for p in parts):
            raise ValueError("auto drafting takes drafters that need no hidden states or attention rows")
        self.parts = list(parts)

    def prepare(self, state: DraftState) -> None:
        for part in self.parts:
            part.prepare(state)

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        if budget <= 0:
            return tree
        for k, part in enumerate(self.parts):
            merge(tree, part.propose(state, budget), k)
        return tree

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        for part in self.parts:
            part.update(state, new_tokens)
