"""PLD+ (pld-plus.txt §4.2): prompt lookup whose candidate occurrences are ranked by the model's own
artifacts instead of taking the first match.

Candidates are the positions j where the last token x_t occurs earlier (Eq. 1). `pldplus-h` ranks them by
the cosine between the layer-l hidden states H_{j-1} and H_{t-1} (Eq. 3); `pldplus-a` by the induction
heads' attention of x_{t-1} (Eq. 2). Both artifacts come from the verifier's own forwards (prefill and
accepted positions), never an extra pass. The K tokens after the best
j are the draft (§4.3); `branches > 1` verifies the next-best occurrences too, as siblings in one tree.
"""

from __future__ import annotations

import torch

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.ngram_index import NgramIndex
from ragspec.decoding.tree import DraftTree


def default_layer(model_config) -> int:
    """The paper tunes l=9 of 32 layers on Vicuna-7B; we keep the same relative depth (hidden_states[l])."""
    n = int(getattr(model_config, "num_hidden_layers", 12))
    return max(1, round(n * 9 / 32))


class PLDPlusHiddenDrafter:
    name = "pldplus-h"

    def __init__(self, layer: int, num_tokens: int = 70, branches: int = 1, max_candidates: int = 512):
        self.hidden_layer = layer
        self.num_tokens = num_tokens
        self.branches = branches
        self.max_candidates = max_candidates
        self._index = NgramIndex(1)

    def prepare(self, state: DraftState) -> None:
        self._index = NgramIndex(1)
        self._index.extend(state.tokens)

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        self._index.extend(state.tokens)

    def candidates(self, state: DraftState) -> list[int]:
        """Positions j < t with x_j = x_t that have a continuation and a hidden state H_{j-1}."""
        seq = state.tokens
        t = len(seq) - 1
        return [j for j in self._index.positions(seq[t:]) if 1 <= j < t][-self.max_candidates :]

    def rank(self, state: DraftState, cands: list[int]) -> list[int]:
        h = state.hidden
        t = len(state.tokens) - 1
        if h is None or len(h) < t or not cands:
            return cands  # no artifacts yet: first-occurrence order, as plain PLD
        query = h[t - 1]
        keys = h[torch.tensor([j - 1 for j in cands])]
        sims = torch.nn.functional.cosine_similarity(keys, query[None], dim=-1)
        order = torch.argsort(sims, descending=True, stable=True).tolist()
        return [cands[i] for i in order]

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        k = min(self.num_tokens, budget)
        if k <= 0:
            return tree
        seq = state.tokens
        for j in self.rank(state, self.candidates(state))[: self.branches]:
            draft = seq[j + 1 : j + 1 + k]
            sources = [p if p < state.prompt_len else -1 for p in range(j + 1, j + 1 + len(draft))]
            tree.add_chain(draft, sources, budget=budget)
            if len(tree) >= budget:
                break
        return tree


class PLDPlusAttentionDrafter(PLDPlusHiddenDrafter):
    """PLD+ (a), Eq. 2: candidates ranked by the attention the last cached token (x_{t-1}) pays to them,
    max-aggregated over the induction heads found by calibration (`ragspec.decoding.heads`). An induction
    head at x_{t-1} attends to the token after an earlier x_{t-1}, i.e. to a j with x_j = x_t."""

    name = "pldplus-a"

    def __init__(self, heads: list, num_tokens: int = 70, branches: int = 1, max_candidates: int = 512):
        super().__init__(layer=0, num_tokens=num_tokens, branches=branches, max_candidates=max_candidates)
        self.hidden_layer = None
        self.attention_heads = tuple((int(a), int(b)) for a, b in heads)

    def rank(self, state: DraftState, cands: list[int]) -> list[int]:
        row = state.attention
        if row is None or not cands:
            return cands  # no attention row yet: first-occurrence order, as plain PLD
        inside = [j for j in cands if j < len(row)]
        if not inside:
            return cands
        scores = row[torch.tensor(inside, device=row.device)]
        order = torch.argsort(scores, descending=True, stable=True).tolist()
        return [inside[i] for i in order] + [j for j in cands if j >= len(row)]
