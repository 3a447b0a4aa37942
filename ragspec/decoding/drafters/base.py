"""The drafter protocol (after HF's `CandidateGenerator`): prepare on the context, propose a draft tree
after each step, learn from what was accepted. Drafted tokens carry the context position they copy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ragspec.decoding.tree import DraftTree

EARLIER_ANSWER = -2  # source of a token drafted from an earlier answer (memory), not from the context


@dataclass
class Segment:
    """A stretch of context tokens that came from one place (a retrieved chunk, say)."""

    start: int  # first context token position
    end: int  # one past the last
    label: object = None  # whatever the caller uses to find the source again (chunk id, source number…)


@dataclass
class DraftState:
    """What drafters see: the whole token sequence so far (prompt + generated) and where the prompt ends.

    Positions < `prompt_len` are context positions; a draft copied from position p gets source p.
    Artifacts of the verifier's own forwards (hidden states of cached positions) ride along for PLD+.
    """

    tokens: list[int]
    prompt_len: int
    segments: list[Segment] = field(default_factory=list)
    hidden: object = None  # torch tensor [cached positions, d] when the drafter asked for a layer
    attention: object = None  # torch tensor [cached positions]: chosen heads' attention of the last cached one
    # after a step, for drafters with `wants_predictions` (lookahead): the tree just verified and the target's
    # argmax at each of its rows (row 0 = the root, row i + 1 = node i); set before `update`
    tree: DraftTree | None = None
    predictions: list[int] | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@runtime_checkable
class Drafter(Protocol):
    name: str
    hidden_layer: int | None  # which layer's hidden states it needs from the verifier (None: none)

    def prepare(self, state: DraftState) -> None:
        """Index the context once, before the first step."""

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        """A draft tree of at most `budget` nodes continuing `state.tokens`."""

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        """Learn from the tokens just appended to `state.tokens` (already appended)."""


class NoDraft:
    """Plain autoregressive decoding through the same verifier (the drafter that never guesses)."""

    name = "none"
    hidden_layer = None

    def prepare(self, state: DraftState) -> None:
        pass

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        return DraftTree()

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        pass
