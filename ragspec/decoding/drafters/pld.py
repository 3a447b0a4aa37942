"""Prompt lookup decoding as in HF `PromptLookupCandidateGenerator`: the longest suffix n-gram (up to
`max_ngram`) of the sequence is searched in the sequence, first occurrence wins, the next `k` tokens are
the draft. The comparison baseline."""

from __future__ import annotations

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.ngram_index import NgramIndex
from ragspec.decoding.tree import DraftTree


class PromptLookupDrafter:
    name = "pld"
    hidden_layer = None

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2):
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self._index = NgramIndex(max_ngram)

    def prepare(self, state: DraftState) -> None:
        self._index = NgramIndex(self.max_ngram)
        self._index.extend(state.tokens)

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        self._index.extend(state.tokens)

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        seq = state.tokens
        n_seq = len(seq)
        tree = DraftTree()
        k = min(self.num_tokens, budget)
        if k <= 0:
            return tree
        for n in range(min(self.max_ngram, n_seq - 1), 0, -1):
            for start in self._index.positions(seq[n_seq - n :]):  # first occurrence, not the suffix itself
                if start + n < n_seq:
                    begin = start + n
                    draft = seq[begin : begin + k]
                    sources = [p if p < state.prompt_len else -1 for p in range(begin, begin + len(draft))]
                    tree.add_chain(draft, sources)
                    return tree
        return tree
