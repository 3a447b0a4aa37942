"""The ceiling of context drafting, for benchmarks: a drafter that knows the answer.

Given the reference output (vanilla greedy's, run first), each step drafts the longest continuation of it
that occurs anywhere in the context so far (prompt + accepted output), as one chain, through the same
verifier, cost model and loop as every other drafter. No drafter that copies from the context can accept
more per step, so its speed-up is what an ideal context drafter reaches on this machine and model. With a
cost model it drafts the chain length that maximises tokens per ms, (1 + k) / t(1 + k), as an ideal budget
would (it knows every drafted token is accepted).
"""

from __future__ import annotations

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.suffix_automaton import SuffixAutomaton
from ragspec.decoding.tree import DraftTree


class OracleDrafter:
    name = "oracle"
    hidden_layer = None

    def __init__(self, reference=(), cost=None):
        self.reference = list(reference)
        self.cost = cost
        self._sam = SuffixAutomaton()

    def prepare(self, state: DraftState) -> None:
        self._sam = SuffixAutomaton(state.tokens)

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        self._sam.extend(state.tokens[len(self._sam) :])

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        done = len(state.tokens) - state.prompt_len
        target = self.reference[done : done + max(0, budget)]
        length, v = self._sam.longest_prefix(target)
        if length == 0:
            return tree
        k = self.best_length(length)
        start = self._sam.firstpos[v] - length + 1  # where the copied run begins
        tree.add_chain(target[:k], [p if p < state.prompt_len else -1 for p in range(start, start + k)])
        return tree

    def best_length(self, available: int) -> int:
        if self.cost is None:
            return available
        return max(range(1, available + 1), key=lambda k: ((1 + k) / self.cost.time(1 + k), -k))
