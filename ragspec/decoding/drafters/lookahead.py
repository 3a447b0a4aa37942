"""Lookahead decoding (Fu et al., 2024): a Jacobi 2-D window and an n-gram pool, both in ONE forward.

The window (the paper's w, Algorithm 1) has N-1 levels (the time axis, oldest first) over W columns (the
sequence axis). As in the paper's Fig. 2b (W=5, N=4) and the authors' code, the current input (the root, "blue
0") is the first token of column 0, so level 0 holds W-1 tokens and levels 1..N-2 hold W each:

    level 0 ("orange"): L0[0..W-2]      at relative positions 1..W-1
    level l ("green", "red", ...): Ll[c] at relative position c + l   (c = 0..W-1)

The mask of Fig. 2b is a tree (the mapping this module rests on): level-0 tokens see the prefix, the root and
the level-0 tokens before them — a chain under the root; the level-l token of column c sees the prefix, the root,
L0[0..c-1] and its own column's lower levels — a chain hanging under L0[c-1] (under the root for c = 0). So

    root ─ L0[0] ─ L0[1] ─ … ─ L0[W-2]           (the orange chain)
    root ─ L1[0] ─ L2[0] ─ … ─ L_{N-2}[0]        (column 0)
    L0[c-1] ─ L1[c] ─ … ─ L_{N-2}[c]             (column c ≥ 1)

and a node's depth is exactly the paper's relative position (DraftTree.position_ids: root position + depth),
its tree ancestry exactly the paper's visibility. The verification branch — up to G n-grams from the pool
whose first token is the root, each contributing its N-1 following tokens — are chains under the root that
see nothing of the window (and the window nothing of them), as in the paper. One DraftTree, one forward.

After the forward the drafter needs the target's argmax at every row (`DraftState.predictions`, row 0 = root,
row i + 1 = node i; the backend fills it because `wants_predictions`). The top level's argmax in column c is
the new token at position c + N - 1: the n-gram (base_c, L1[c], …, L_{N-2}[c], new[c]) (base_c = root for
c = 0, else L0[c-1]) goes into the pool under base_c, and the window moves one step in both dimensions (L29):
L0 ← L1[1:], Ll ← L(l+1), L_{N-2} ← new — by one position whatever was accepted (the authors' default).

Window nodes that happen to equal the accepted path are accepted like any draft; greedy and sampled acceptance
(one seeded draw a token, `backends/accept.py`) are lossless for any tree, so the window and guesses change only the
speed. The pool is pre-filled from the prompt ("prompt as reference", Table 3) and grows with every accepted
token's n-gram too. The tree is sized by W, N, G and marked `fixed`: the adaptive budget keeps it whole (a
cut window could not be mapped back); when the step's budget (the tokens left) is smaller than the window,
only the guesses are proposed, cut to the budget, and the window waits.

This module imports neither torch nor llama.cpp.
"""

from __future__ import annotations

import random

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.tree import DraftTree


class LookaheadDrafter:
    """Lookahead decoding: window W × (N-1), n-gram size N, at most G guesses a step."""

    name = "lookahead"
    hidden_layer = None
    wants_predictions = True  # the backend returns every row's argmax (StepResult.predictions)

    def __init__(self, W: int = 2, N: int = 3, G: int = 1, pool_size: int = 8, prompt_pool: bool = True,
                 seed: int = 0):
        if W < 1 or N < 2 or G < 0 or pool_size < 1:
            raise ValueError("lookahead needs W >= 1, N >= 2, G >= 0, pool_size >= 1")
        self.W, self.N, self.G = int(W), int(N), int(G)
        self.pool_size = int(pool_size)  # n-grams kept per first token (LRU), as the authors' GUESS_SET_SIZE
        self.prompt_pool = bool(prompt_pool)
        self.seed = seed
        self.reset()

    # -- state ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []
        self.steps = 0  # window updates so far (the first N-2 carry initial tokens, not Jacobi outputs)
        self._tree: DraftTree | None = None  # the last proposal that carried the window
        self._cells: dict[tuple[int, int], int] = {}  # (level, column) → node index in `_tree`
        self._tops: list[int] = []  # per column: the row whose argmax is that column's new token

    def prepare(self, state: DraftState) -> None:
        self.reset()
        prompt = state.tokens[: state.prompt_len]
        if self.prompt_pool:
            for i in range(len(prompt) - self.N + 1):
                self.add_ngram(prompt[i : i + self.N])
        # the window starts as tokens of the prompt, picked at random (seeded: runs repeat exactly); Jacobi
        # iteration converges from any start, this one just starts in the text's vocabulary
        rng = random.Random(self.seed)
        pick = (lambda: rng.choice(prompt)) if prompt else (lambda: 0)
        self.levels = [[pick() for _ in range(self.W - 1)]] + [[pick() for _ in range(self.W)]
                                                               for _ in range(self.N - 2)]

    def add_ngram(self, gram) -> None:
        """Pool the n-gram under its first token (most recent last; the oldest goes past `pool_size`)."""
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        entries = self.pool.setdefault(key, [])
        if rest in entries:
            entries.remove(rest)
        entries.append(rest)
        if len(entries) > self.pool_size:
            del entries[0]

    def guesses(self, token: int) -> list[tuple[int, ...]]:
        """Up to G n-grams (their N-1 tokens after `token`) starting with `token`, most recent first."""
        return self.pool.get(int(token), [])[::-1][: self.G]

    def window_size(self) -> int:
        return (self.W - 1) + self.W * (self.N - 2)

    # -- one step ------------------------------------------------------------------------------------------
    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        root = state.tokens[-1]
        for gram in self.guesses(root):  # the verification branch first: tried first when sampling
            tree.add_chain(gram, budget=budget)
        self._tree, self._cells, self._tops = None, {}, []
        if budget < len(tree) + self.window_size():
            return tree.truncated(max(0, budget))  # no room for the window this step: guesses only
        cells = {}
        node = -1
        for c, tok in enumerate(self.levels[0]):  # the orange chain
            node = tree.add(node, tok)
            cells[(0, c)] = node
        tops = []
        for c in range(self.W):  # column c hangs under L0[c-1] (column 0 under the root)
            node = -1 if c == 0 else cells[(0, c - 1)]
            for lev in range(1, self.N - 1):
                node = tree.add(node, self.levels[lev][c])
                cells[(lev, c)] = node
            tops.append(node + 1)  # its row (row 0 = the root, for N = 2 and c = 0)
        tree.fixed = True
        self._tree, self._cells, self._tops = tree, cells, tops
        return tree

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        # every accepted token ends an n-gram of the text: pool it (the prompt's were pooled in prepare)
        toks = state.tokens
        for end in range(max(len(toks) - len(new_tokens) + 1, self.N), len(toks) + 1):
            if self.prompt_pool:
                self.add_ngram(toks[end - self.N : end])
        preds = getattr(state, "predictions", None)
        if self._tree is None or preds is None or getattr(state, "tree", None) is not self._tree:
            return  # the window was not verified as proposed: it waits
        root = toks[len(toks) - len(new_tokens) - 1]  # this step's root (the prompt is never empty)
        new = [int(preds[r]) for r in self._tops]
        if self.steps >= self.N - 2:  # the levels are Jacobi outputs: harvest n-grams
            for c in range(self.W):
                base = root if c == 0 else self.levels[0][c - 1]
                self.add_ngram([base] + [self.levels[lev][c] for lev in range(1, self.N - 1)] + [new[c]])
        stack = self.levels[1:] + [new]
        self.levels = [stack[0][1:]] + stack[1:]
        self.steps += 1
        self._tree = None
