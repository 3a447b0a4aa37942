"""What a verifier backend does, whatever runs the model: the loop (generate.py), drafters, budget, streaming
and attribution see only this, so they never depend on torch or llama.cpp through the backend.

A backend holds one model's KV state and the sequence decoded so far. `prefill` caches the prompt, its last
token (the first step's root) included where it can, keeping that row's logits, so the first step runs only
its tree (as HF `generate` and llama.cpp read a prompt: no extra one-token forward); `step` runs [root + tree]
in one forward, accepts a path (accept.py) and keeps only that path in the cache; `calibrate` measures t(n),
the forward time of n tokens, for the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ragspec.decoding.tree import DraftTree

# A prompt longer than one chunk is prefilled PREFILL_CHUNK tokens per forward: progress can be shown and a
# cancel honoured between chunks, and a long prompt never holds the model in one uninterruptible call.
# The bench's vanilla (HF `generate`, `prefill_chunk_size`) chunks the same way, so both see the same kernels.
PREFILL_CHUNK = 512

Progress = Callable[[int, int], None]  # (prompt tokens prefilled so far, prompt tokens to prefill)


MIN_TAIL = 128  # where rows are independent, a prompt's first or last piece shorter than this joins its neighbour


def chunks(start: int, end: int, size: int = PREFILL_CHUNK, min_tail: int = 0) -> list[tuple[int, int]]:
    """[start, end) cut at multiples of `size` counted from position 0 (as HF's chunked prefill cuts); with
    `min_tail`, a first or last piece shorter than that joins its neighbour. A forward of a few rows costs almost
    what one of a hundred does (the quickstart's 538-token prompts, 1.5B, Zen 5: 1157 ms read as 512 + 26,
    1071 ms as 538, median of 12), so only a model whose rows are computed alike however they are cut may take it."""
    out, a = [], start
    while a < end:
        b = min(end, (a // size + 1) * size)
        out.append((a, b))
        a = b
    if len(out) > 1 and out[-1][1] - out[-1][0] < min_tail:
        out[-2:] = [(out[-2][0], out[-1][1])]
    if len(out) > 1 and out[0][1] - out[0][0] < min_tail:  # a prefix reused up to just before a boundary
        out[:2] = [(out[0][0], out[1][1])]
    return out


@dataclass
class StepResult:
    tokens: list[int]  # accepted draft tokens, then the bonus token
    sources: list[int]  # per token: context position it was copied from, -1 for model-made tokens
    accepted: int  # how many draft tokens were accepted (len(tokens) - 1)
    tree_size: int
    forward_ms: float
    path: list[int] = field(default_factory=list)  # accepted node indices (= their ranks in the tree)
    hidden: Any = None  # [1 + accepted, d] hidden states of the kept rows, if asked for (transformers only)
    timings: dict = field(default_factory=dict)  # ms by part: inputs, forward, accept, trim
    predictions: list[int] | None = None  # argmax of every row (0: root, i + 1: node i), if asked for (lookahead)

    @property
    def verify_ms(self) -> float:
        """The whole step but drafting: inputs, forward, acceptance and cache trim."""
        return sum(self.timings.values()) if self.timings else self.forward_ms


@runtime_checkable
class Backend(Protocol):
    """One generation's verifier. `cached`: positions in the KV cache; `root`: the last accepted token."""

    name: str
    cached: int
    root: int

    def prefill(self, prompt_ids: list[int], prefix=None, on_progress: Progress | None = None,
                cancel=None) -> float:
        """Cache the prompt in `PREFILL_CHUNK` chunks (`on_progress` after each, `cancel` checked before each:
        `Cancelled`); returns ms."""

    def known_next(self) -> int | None:
        """The next token when the prefill's logits already fix it (greedy, root cached), else None: the loop
        streams it before the first step runs (the step still verifies the same tree)."""

    def step(self, tree: DraftTree) -> StepResult:
        """Verify [root + tree] in one forward; keep the accepted path in the cache."""

    def hidden_states(self):
        """[cached, d] hidden states of the layer a drafter asked for (None where the backend has none)."""

    def attention_row(self):
        """The chosen heads' attention row of the last cached position (None where the backend has none)."""

    def close(self) -> None:
        """Free what the step holds (hooks, batches); the model stays loaded."""


def tree_rows(tree: DraftTree) -> int:
    """Rows one step runs: the root and every node."""
    return 1 + len(tree)
