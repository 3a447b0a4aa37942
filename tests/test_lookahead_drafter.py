"""The `lookahead` drafter (Lookahead decoding): the paper's Fig. 2b mask and n-gram pool worked by hand, output
identical to plain greedy (`model.generate`, SmolLM2) whatever the budget or the pool holds, window nodes that
are right are accepted, max_new_tokens / eos never passed, and llama.cpp refuses it with one clear line."""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import check_limits_and_eos, run

from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import check_params, make_drafter
from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.lookahead import LookaheadDrafter
from ragspec.decoding.generate import SpeculativeGenerator

FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
STEEP = CostModel([1, 2, 4, 8, 16, 32, 64], [100, 200, 400, 800, 1600, 3200, 6400])

# -- the paper's Fig. 2b: W = 5, N = 4, G = 2 ------------------------------------------------------------------
# Rows in the figure's order: the input (blue 0); orange 1-4 (level 0, W-1 tokens); green 1-5 (level 1); red 2-6
# (level 2); two guesses a1-a3, b1-b3 (verification branch). Digits are relative positions. A row sees a column
# where '1'. Worked from §3.1/§3.3: orange k sees orange 1..k; the level-l token of column c sees orange 1..c and
# its own column's lower levels ("only the green token at position 5 and all orange tokens are visible to the red
# token 6"); guesses see only their own earlier tokens; everything sees the input and itself.
FIG2B = [
    "1....................",  # 0 (root)
    "11...................",  # o1
    "111..................",  # o2
    "1111.................",  # o3
    "11111................",  # o4
    "1....1...............",  # g1
    "11....1..............",  # g2
    "111....1.............",  # g3
    "1111....1............",  # g4
    "11111....1...........",  # g5
    "1....1....1..........",  # r2
    "11....1....1.........",  # r3
    "111....1....1........",  # r4
    "1111....1....1.......",  # r5
    "11111....1....1......",  # r6
    "1..............1.....",  # a1
    "1..............11....",  # a2
    "1..............111...",  # a3
    "1.................1..",  # b1
    "1.................11.",  # b2
    "1.................111",  # b3
]
FIG2B_POSITIONS = [0, 1, 2, 3, 4, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 1, 2, 3, 1, 2, 3]
ROOT = 7
ORANGE = [101, 102, 103, 104]
GREEN = [201, 202, 203, 204, 205]
RED = [302, 303, 304, 305, 306]
GUESS_A, GUESS_B = (401, 402, 403), (501, 502, 503)


def fig2b_drafter():
    d = LookaheadDrafter(W=5, N=4, G=2, prompt_pool=False)
    d.prepare(DraftState(tokens=[ROOT], prompt_len=1))
    d.levels = [list(ORANGE), list(GREEN), list(RED)]
    d.add_ngram((ROOT,) + GUESS_B)
    d.add_ngram((ROOT,) + GUESS_A)  # the most recent: guessed first
    return d


def test_fig2b_window_is_the_papers_mask():
    d = fig2b_drafter()
    state = DraftState(tokens=[ROOT], prompt_len=1)
    tree = d.propose(state, 64)
    assert tree.fixed and len(tree) == 20
    # the figure's rows → tree rows (0: root, node i: i + 1), through the drafter's (level, column) map
    rows = [0] + [d._cells[(0, c)] + 1 for c in range(4)] + [d._cells[(1, c)] + 1 for c in range(5)]
    rows += [d._cells[(2, c)] + 1 for c in range(5)]
    a, b = tree.child(-1, 401), tree.child(-1, 501)
    rows += [r + 1 for r in tree.path(tree.child(tree.child(a, 402), 403))]
    rows += [r + 1 for r in tree.path(tree.child(tree.child(b, 502), 503))]
    assert sorted(rows) == list(range(21))
    tokens = [ROOT] + tree.tokens
    assert [tokens[r] for r in rows] == [ROOT, *ORANGE, *GREEN, *RED, *GUESS_A, *GUESS_B]
    seen = tree.ancestry()
    got = ["".join("1" if seen[r, c] else "." for c in rows) for r in rows]
    assert got == FIG2B
    pos = tree.position_ids(0)
    assert [pos[r] for r in rows] == FIG2B_POSITIONS
    # the 4-D mask the backend feeds the model says the same, after any cached prefix
    mask = tree.attention_mask(3, torch.float32)[0, 0]
    assert (mask[:, :3] == 0).all()
    assert ((mask[:, 3:] == 0) == seen).all()
    # the top level's rows are the columns' n-gram ends: red 2..6
    assert d._tops == [d._cells[(2, c)] + 1 for c in range(5)]


def test_fig2b_pool_and_window_move():
    """One step: each column's top-level argmax ends a 4-gram — (orange 1, green 2, red 3, new) and so on, column
    0's starting at the input — pooled under its first token; then orange and green 1 go, the window keeps green
    2..5, all red and the new tokens (§3.1)."""
    d = fig2b_drafter()
    d.steps = 2  # the levels are Jacobi outputs already (the first N-2 steps only fill the window)
    state = DraftState(tokens=[ROOT], prompt_len=1)
    tree = d.propose(state, 64)
    new = [601, 602, 603, 604, 605]
    preds = [0] * (1 + len(tree))
    for c, r in enumerate(d._tops):
        preds[r] = new[c]
    preds[0] = 999  # the root's argmax: the accepted (bonus) token
    state.tokens.append(999)
    state.tree, state.predictions = tree, preds
    d.update(state, [999])
    assert d.pool[ROOT][-1] == (201, 302, 601)  # column 0: (input 0, green 1, red 2, new 3)
    assert d.pool[101] == [(202, 303, 602)]  # (orange 1, green 2, red 3, new 4)
    assert d.pool[102] == [(203, 304, 603)]
    assert d.pool[103] == [(204, 305, 604)]
    assert d.pool[104] == [(205, 306, 605)]
    assert d.levels == [[202, 203, 204, 205], RED, new]
    assert d.guesses(ROOT) == [(201, 302, 601), GUESS_A]  # G = 2, most recent first
    # a tree the loop did not verify as proposed (cut by a budget) leaves the window where it was
    d2 = fig2b_drafter()
    tree2 = d2.propose(DraftState(tokens=[ROOT], prompt_len=1), 64)
    s2 = DraftState(tokens=[ROOT, 999], prompt_len=1, tree=tree2.truncated(3), predictions=[0] * 4)
    d2.update(s2, [999])
    assert d2.levels == [ORANGE, GREEN, RED]


def test_small_budget_proposes_guesses_only():
    d = fig2b_drafter()
    tree = d.propose(DraftState(tokens=[ROOT], prompt_len=1), 8)
    assert not tree.fixed and len(tree) == 6 and tree.max_depth() == 3


def test_prompt_is_the_pools_reference():
    d = LookaheadDrafter(W=3, N=3, G=2)
    prompt = [1, 2, 3, 1, 2, 4, 1, 5, 6]
    d.prepare(DraftState(tokens=list(prompt), prompt_len=len(prompt)))
    assert d.guesses(1) == [(5, 6), (2, 4)] and d.guesses(2) == [(4, 1), (3, 1)]
    assert len(d.levels) == 2 and len(d.levels[0]) == 2 and len(d.levels[1]) == 3
    assert all(t in prompt for lev in d.levels for t in lev)


def test_params_and_registry():
    check_params("lookahead", {"W": 3, "N": 4, "G": 2, "pool_size": 4})
    with pytest.raises(ValueError, match="unknown parameter 'window'"):
        check_params("lookahead", {"window": 3})
    d = make_drafter("lookahead", W=3, N=4, G=1)
    assert (d.W, d.N, d.G, d.name) == (3, 4, 1, "lookahead") and d.wants_predictions
    with pytest.raises(ValueError):
        LookaheadDrafter(N=1)


def test_llama_cpp_refuses_lookahead():
    from ragspec.decoding.backends.llama_cpp import LlamaCppBackend
    from ragspec.errors import RagspecError

    with pytest.raises(RagspecError, match=r"lookahead decoding is not supported on llama.cpp"):
        LlamaCppBackend(None, predictions=True)


# -- on the model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", ["fixed", "flat", "steep"])
def test_lookahead_matches_generate(smol, cases, budget):
    _model, tok = smol
    drafted = 0
    for i, (prompt, ref) in enumerate(cases):
        b = {"fixed": 64, "flat": AdaptiveBudget(FLAT), "steep": AdaptiveBudget(STEEP)}[budget]
        params = [dict(), dict(W=5, N=4, G=2), dict(W=3, N=2, G=1), dict(W=1, N=5, G=3)][i]
        gen, text = run(smol, LookaheadDrafter(**params), prompt, budget=b)
        assert gen.tokens == ref, params
        assert text == tok.decode(ref, skip_special_tokens=True)
        drafted += gen.stats.accepted_draft_tokens
        assert gen.stats.tree_nodes > 0  # the window is verified whole, whatever the budget thinks of it
    assert drafted > 0


class GarbagePool(LookaheadDrafter):
    """A pool pre-filled with random n-grams under every token it may be asked about, and a random window."""

    def __init__(self, seed=0, **kw):
        super().__init__(**kw)
        self.gen = torch.Generator().manual_seed(seed)

    def junk(self, key):
        for _ in range(self.pool_size):
            self.add_ngram([key] + torch.randint(0, 49152, (self.N - 1,), generator=self.gen).tolist())

    def prepare(self, state):
        super().prepare(state)
        for key in set(state.tokens):
            self.junk(key)
        self.levels = [torch.randint(0, 49152, (len(lev),), generator=self.gen).tolist() for lev in self.levels]

    def update(self, state, new):
        super().update(state, new)
        self.junk(state.tokens[-1])


class RightWindow(LookaheadDrafter):
    """Level 0 holds the reference's next W-1 tokens: the orange chain is the greedy path, and is accepted."""

    def __init__(self, ref, **kw):
        super().__init__(**kw)
        self.ref = ref

    def propose(self, state, budget):
        done = len(state.generated)
        nxt = self.ref[done : done + self.W - 1]
        self.levels[0] = nxt + [7] * (self.W - 1 - len(nxt))
        return super().propose(state, budget)


def test_adversarial_pools_and_windows(smol, cases):
    for i, (prompt, ref) in enumerate(cases[:2]):
        gen, _ = run(smol, GarbagePool(seed=i, W=4, N=3, G=4), prompt)
        assert gen.tokens == ref
        gen, _ = run(smol, RightWindow(ref, W=8, N=3, G=0, prompt_pool=False), prompt)
        assert gen.tokens == ref
        assert gen.stats.mean_accepted > 4  # window nodes on the greedy path are accepted like any draft


def test_max_new_tokens_and_eos_are_never_passed(smol, cases):
    check_limits_and_eos(smol, cases, lambda ref, size: [LookaheadDrafter(), RightWindow(ref, W=4, N=3, G=2)])


def test_sampling_runs_through_the_loop(smol, cases):
    """Sampled generation with the window (its argmax rows) and guesses: runs, and repeats with the seed."""
    from ragspec.decoding.sampling import SamplingSettings

    model, tok = smol
    prompt, _ = cases[1]
    outs = []
    for _ in range(2):
        gen = SpeculativeGenerator(model, tok, drafter=LookaheadDrafter(), max_new_tokens=16,
                                   sampling=SamplingSettings(temperature=0.8, top_k=20, seed=3))
        gen.generate(prompt)
        outs.append(gen.tokens)
    assert outs[0] == outs[1] and 0 < len(outs[0]) <= 16
