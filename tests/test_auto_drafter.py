"""The `auto` drafter: several drafters' trees merged under one budget. Output identical to plain greedy
(`model.generate`, SmolLM2) whatever its parts propose, plain steps when nothing pays, and the merge itself."""

from __future__ import annotations

import random

import pytest
from test_suffix_drafter import FLAT, STEEP, run

from ragspec.decoding.budget import AdaptiveBudget
from ragspec.decoding.drafters import check_params, make_drafter
from ragspec.decoding.drafters.auto import PART_GROUPS, UNSCORED_CONF, AutoDrafter, merge
from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.suffix import SuffixDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.tree import DraftTree


class Garbage:
    """A part that proposes random tokens, deep and wide (an adversary: never right, often long)."""

    name = "garbage"
    hidden_layer = None

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def prepare(self, state):
        pass

    def update(self, state, new_tokens):
        pass

    def propose(self, state, budget):
        tree = DraftTree()
        for _ in range(3):
            tree.add_chain([self.rng.randrange(self.vocab) for _ in range(6)], budget=budget)
        return tree


def test_merge_shares_prefixes_and_keeps_the_first_score():
    scored = DraftTree()
    a = scored.add(-1, 5, conf=0.9, group=3)
    scored.add(a, 6, conf=0.8, group=4)
    plain = DraftTree()
    plain.add_chain([5, 7, 8])
    tree = DraftTree()
    merge(tree, scored, 0)
    merge(tree, plain, 1)
    assert tree.tokens == [5, 6, 7, 8] and tree.parents == [-1, 0, 0, 2] and tree.scored
    assert tree.confs[:2] == [0.9, 0.8] and tree.groups[:2] == [3, 4]  # 5 stays the scored part's node
    assert tree.confs[2:] == [UNSCORED_CONF] * 2
    assert tree.groups[2:] == [PART_GROUPS + 4 + 1, PART_GROUPS + 4 + 2]  # part 1, depths 2 and 3


def test_auto_params_are_checked():
    check_params("auto", {"parts": ["suffix", "pld"]})
    with pytest.raises(ValueError, match="unknown parameter"):
        check_params("auto", {"depth": 3})
    with pytest.raises(ValueError, match="auto drafting parts"):
        make_drafter("auto", parts=["suffix", "pldplus-h"])
    auto = make_drafter("auto", parts="suffix, pld")
    assert [p.name for p in auto.parts] == ["suffix", "pld"]


@pytest.mark.parametrize("budget", ["fixed", "flat", "steep"])
def test_auto_matches_generate(smol, cases, budget):
    _model, tok = smol
    drafted = 0
    for prompt, ref in cases:
        b = {"fixed": 64, "flat": AdaptiveBudget(FLAT), "steep": AdaptiveBudget(STEEP)}[budget]
        auto = AutoDrafter([SuffixDrafter(), PromptLookupDrafter(), Garbage(len(tok))])
        gen, text = run(smol, auto, prompt, budget=b)
        assert gen.tokens == ref and text == tok.decode(ref, skip_special_tokens=True)
        drafted += gen.stats.accepted_draft_tokens
        if budget == "steep":  # nothing pays at 100 ms a token: plain steps only
            assert gen.stats.tree_nodes == 0
    assert (drafted == 0) == (budget == "steep")


def test_auto_stops_inside_a_draft_and_keeps_provenance(smol, cases):
    model, tok = smol
    prompt, ref = cases[0]
    for limit in (1, 3, 7):
        gen, _ = run(smol, make_drafter("auto"), prompt, max_new=limit, budget=256)
        assert gen.tokens == ref[:limit]
    gen = SpeculativeGenerator(model, tok, drafter=make_drafter("auto"), max_new_tokens=48,
                               budget=AdaptiveBudget(FLAT))
    deltas = list(gen.stream(prompt))
    toks = [t for d in deltas for t in d.tokens]
    srcs = [s for d in deltas for s in d.sources]
    assert toks == ref and any(s >= 0 for s in srcs)
    assert all(prompt[s] == t for t, s in zip(toks, srcs) if s >= 0)


def test_auto_learns_a_bad_part_does_not_pay():
    """The calibration cells of a part whose nodes are never accepted lose their trust: the budget drops
    them while it keeps the good part's chain."""
    tokens = [1, 2] + list(range(100, 130)) + [3, 4] + list(range(100, 105))
    state = DraftState(tokens=list(tokens), prompt_len=len(tokens))
    auto = AutoDrafter([SuffixDrafter(), Garbage(50000, seed=1)])
    auto.prepare(state)
    budget = AdaptiveBudget(FLAT)
    tree = auto.propose(state, 64)
    for _ in range(40):
        budget.observe_proposal(tree, tree.follow(range(105, 130)))
    chosen = budget.select(tree)
    assert chosen.tokens[:5] == list(range(105, 110))
    assert all(g < PART_GROUPS for g in chosen.groups)  # no garbage node is worth verifying any more
