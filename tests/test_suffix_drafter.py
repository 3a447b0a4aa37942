"""The `suffix` drafter, the `oracle` ceiling and the answer memory: output identical to plain greedy
(`model.generate`, SmolLM2) whatever the budget decides, provenance into the context, scored trees, the
confidence budget (plain steps when nothing pays), and a repeated question drafted from the earlier answer."""

from __future__ import annotations

import pytest
from greedy_cases import chat_prompt, reference
from test_engine_greedy import run

from ragspec.decoding.budget import AdaptiveBudget, CostModel, ScoreCalibration
from ragspec.decoding.drafters.base import EARLIER_ANSWER, DraftState
from ragspec.decoding.drafters.oracle import OracleDrafter
from ragspec.decoding.drafters.suffix import SuffixDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.memory import AnswerMemory
from ragspec.decoding.tree import DraftTree

FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
MID = CostModel([1, 2, 4, 8, 16, 32, 64], [100 + 20 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)])
STEEP = CostModel([1, 2, 4, 8, 16, 32, 64], [100, 200, 400, 800, 1600, 3200, 6400])


@pytest.mark.parametrize("budget", ["fixed", "flat", "steep"])
def test_suffix_matches_generate(smol, cases, budget):
    _model, tok = smol
    drafted = 0
    for prompt, ref in cases:
        b = {"fixed": 64, "flat": AdaptiveBudget(FLAT), "steep": AdaptiveBudget(STEEP)}[budget]
        gen, text = run(smol, SuffixDrafter(), prompt, budget=b)
        assert gen.tokens == ref
        assert text == tok.decode(ref, skip_special_tokens=True)
        drafted += gen.stats.accepted_draft_tokens
        if budget == "steep":  # nothing pays at 100 ms a token: every step is a plain step
            assert gen.stats.tree_nodes == 0
    assert (drafted == 0) == (budget == "steep")


def test_suffix_provenance_points_into_the_context(smol, cases):
    model, tok = smol
    prompt, ref = cases[0]
    gen = SpeculativeGenerator(model, tok, drafter=SuffixDrafter(), max_new_tokens=48)
    deltas = list(gen.stream(prompt))
    toks = [t for d in deltas for t in d.tokens]
    srcs = [s for d in deltas for s in d.sources]
    assert toks == ref and any(s >= 0 for s in srcs)
    for t, s in zip(toks, srcs):
        if s >= 0:
            assert prompt[s] == t


def test_suffix_tree_is_scored_deep_and_best_first():
    # a 30-token run seen once before: one chain as deep as the budget allows, not cut at a constant
    run_ = list(range(100, 130))
    tokens = [1, 2] + run_ + [3, 4] + run_[:5]
    d = SuffixDrafter()
    state = DraftState(tokens=list(tokens), prompt_len=len(tokens))
    d.prepare(state)
    tree = d.propose(state, 200)
    copy = run_[5:] + [3, 4] + run_[:5]
    assert tree.scored and tree.tokens[: len(copy)] == copy
    # past the end of the sequence the copy goes on with the draft itself (the next period of a repeat)
    assert tree.tokens[len(copy) : 2 * len(copy)] == copy
    assert tree.max_depth() == len(tree) > 2 * len(copy)  # one chain, deeper than any fixed cap (until min_prob)
    assert tree.sources[0] == 2 + 5 and all(tokens[s] == t for s, t in zip(tree.sources, tree.tokens) if s >= 0)
    assert tree.confs[0] < 1 and all(0 < c <= 1 for c in tree.confs)
    # a spot followed by 'a' three times and 'b' once: 'a' first, both offered, 'a' more confident
    tokens = [7, 50, 9, 7, 50, 9, 7, 50, 9, 7, 60, 9, 7]
    d = SuffixDrafter()
    state = DraftState(tokens=list(tokens), prompt_len=len(tokens))
    d.prepare(state)
    tree = d.propose(state, 8)
    first = tree.children(-1)
    assert [tree.tokens[i] for i in first] == [50, 60]
    assert tree.confs[first[0]] > tree.confs[first[1]]
    # incremental update sees generated tokens
    state.tokens += [60, 9]
    d.update(state, [60, 9])
    tree = d.propose(state, 4)
    assert tree.tokens[0] == 7 and tree.sources[0] >= 0


def test_budget_selects_by_calibrated_confidence():
    t = DraftTree()
    a = t.add(-1, 5, conf=0.9, group=3)
    t.add(a, 6, conf=0.9, group=3)
    t.add(-1, 8, conf=0.05, group=3)
    b = AdaptiveBudget(FLAT)
    picked = b.select(t)
    assert picked.tokens[:2] == [5, 6] and picked.parents[:2] == [-1, 0]
    assert AdaptiveBudget(STEEP).select(t).tokens == []  # a plain step: nothing pays
    # calibration: a cell that is never accepted loses its trust, one always accepted gains it
    cal = ScoreCalibration()
    for _ in range(50):
        cal.observe(3, 0.9, False)
        cal.observe(5, 0.5, True)
    assert cal.rate(3, 0.9) < 0.2 and cal.rate(5, 0.5) > 0.9
    assert AdaptiveBudget(MID).select(t).tokens == [5, 6]  # 8 (5 % likely) does not pay 20 ms
    assert AdaptiveBudget(MID, calibration=cal).select(t).tokens == []
    # learning from a proposal: only nodes whose parent was accepted are scored
    fresh = AdaptiveBudget(FLAT)
    fresh.observe_proposal(t, [0])
    assert fresh.calibration.cells[(3, ScoreCalibration.bucket(0.9))] == [1.0, 2.0]  # node 0 hit, node 1 miss
    assert fresh.calibration.cells[(3, ScoreCalibration.bucket(0.05))] == [0.0, 1.0]


def test_oracle_is_identical_and_takes_fewest_steps(smol, cases):
    for prompt, ref in cases:
        oracle, _ = run(smol, OracleDrafter(ref), prompt, budget=256)
        suffix, _ = run(smol, SuffixDrafter(), prompt, budget=64)
        assert oracle.tokens == ref and suffix.tokens == ref
        assert oracle.stats.steps <= suffix.stats.steps
        # every drafted token is accepted: each step ends on a token the context cannot continue
        assert oracle.stats.tree_nodes == oracle.stats.accepted_draft_tokens
    # with a cost model it drafts the chain length that maximises tokens per ms
    assert OracleDrafter(cost=STEEP).best_length(20) == 1
    assert OracleDrafter(cost=FLAT).best_length(20) == 20


def test_oracle_and_suffix_stop_inside_a_draft(smol, cases):
    model, tok = smol
    prompt, ref = cases[0]
    for limit in (1, 3, 7):
        for drafter in (OracleDrafter(ref), SuffixDrafter()):
            gen, _ = run(smol, drafter, prompt, max_new=limit, budget=256)
            assert gen.tokens == ref[:limit]
    short = chat_prompt(tok, "The sky is blue. The sky is blue.", "Answer with one word: what colour is the sky?")
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    ref = reference(model, short, 40, eos)
    assert ref[-1] in eos
    # the oracle's reference runs on past eos (a longer draft than the answer): it still ends at eos
    gen, _ = run(smol, OracleDrafter(ref + ref), short, max_new=40, budget=256)
    assert gen.tokens == ref and gen.stats.finish_reason == "eos"
    gen, _ = run(smol, SuffixDrafter(), short, max_new=40, budget=256)
    assert gen.tokens == ref and gen.stats.finish_reason == "eos"


def test_memory_drafts_a_repeated_answer(smol, cases):
    model, tok = smol
    memory = AnswerMemory(max_answers=2)
    prompt, ref = cases[1]
    first, _ = run(smol, SuffixDrafter(memory=memory), prompt, budget=AdaptiveBudget(FLAT))
    memory.add(prompt, first.tokens)
    second = SpeculativeGenerator(model, tok, drafter=SuffixDrafter(memory=memory), max_new_tokens=48,
                                  budget=AdaptiveBudget(FLAT))
    deltas = list(second.stream(prompt))
    assert first.tokens == second.tokens == ref
    assert second.stats.steps * 2 <= first.stats.steps, (first.stats.steps, second.stats.steps)
    assert EARLIER_ANSWER in [s for d in deltas for s in d.sources]
    # bounded: the least recently used answer goes first
    memory.add([1, 2, 3], [4, 5])
    memory.add([6, 7], [8])
    assert len(memory) == 2 and (1, 2, 3, 4, 5) in memory._entries
