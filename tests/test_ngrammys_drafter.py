"""The `ngrammys` drafter (n-grammys §4): output identical to plain greedy (`model.generate`, SmolLM2) with a
fixed and an adaptive budget, inside a draft at max_new_tokens, with garbage tables; the model bigram equals
the model's own top-k; the disk cache is reused and a corrupt one ignored; sampling keeps the distribution."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt

from ragspec.decoding.backends.transformers import TransformersBackend
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import check_params, make_drafter
from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.ngrammys import NgrammysDrafter
from ragspec.decoding.generate import SpeculativeGenerator

FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])


@pytest.fixture(scope="module")
def rows_fn(smol):
    model, _ = smol
    calls = []

    def rows(tokens, k, w):
        calls.append(list(tokens))
        return TransformersBackend.bigram_rows(model, tokens, k, w)

    rows.calls = calls
    return rows


def drafter(rows_fn, path=None, **kw):
    return NgrammysDrafter(model_rows=rows_fn, cache_path=path, **kw)


def run(smol, d, prompt, max_new=48, budget=64):
    model, tok = smol
    gen = SpeculativeGenerator(model, tok, drafter=d, max_new_tokens=max_new, budget=budget)
    return gen, gen.generate(prompt)


@pytest.mark.parametrize("extend,budget", [("chain", "fixed"), ("greedy", "fixed"), ("chain", "adaptive")])
def test_ngrammys_matches_generate(smol, cases, rows_fn, tmp_path, extend, budget):
    _model, tok = smol
    drafted = bigram = 0
    for prompt, ref in cases if extend == "chain" else cases[:2]:  # greedy rows cost more to compute
        d = drafter(rows_fn, tmp_path / f"{extend}.sqlite", extend=extend)
        gen, text = run(smol, d, prompt, budget=64 if budget == "fixed" else AdaptiveBudget(FLAT))
        assert gen.tokens == ref
        assert text == tok.decode(ref, skip_special_tokens=True)
        drafted += gen.stats.accepted_draft_tokens
        bigram += len(d.model_rows(prompt[-1]))
    assert drafted > 0 and bigram > 0


def test_ngrammys_stops_inside_a_draft_and_at_eos(smol, cases, rows_fn, tmp_path):
    prompt, ref = cases[0]
    for limit in (1, 3, 7):
        gen, _ = run(smol, drafter(rows_fn, tmp_path / "t.sqlite"), prompt, max_new=limit)
        assert gen.tokens == ref[:limit] and gen.stats.finish_reason == "length"
    short = min(cases, key=lambda c: len(c[1]))
    gen, _ = run(smol, drafter(rows_fn, tmp_path / "t.sqlite"), short[0], max_new=200)
    model, tok = smol
    eos = SpeculativeGenerator(model, tok).eos
    if short[1][-1] in eos:  # the reference ended on eos within 48 tokens
        assert gen.tokens == short[1] and gen.stats.finish_reason == "eos"


def test_garbage_tables_change_nothing(smol, cases):
    rng = random.Random(0)

    def garbage(tokens, k, w):
        return {t: [[rng.randrange(49152) for _ in range(w)] for _ in range(k)] for t in tokens}

    for prompt, ref in cases[:2]:
        for kw in ({"extend": "greedy", "k": 10, "w": 6}, {"extend": "chain", "k": 25, "w": 4, "q": 2}):
            gen, _ = run(smol, NgrammysDrafter(model_rows=garbage, **kw), prompt, budget=200)
            assert gen.tokens == ref


def test_rows_are_the_models_own_top_k(smol):
    model, tok = smol
    toks = tok(" The river flows", add_special_tokens=False)["input_ids"]
    rows = TransformersBackend.bigram_rows(model, toks, 4, 3)
    bos = model.config.bos_token_id
    with torch.inference_mode():
        for t in toks:
            logits = model(torch.tensor([[bos, t]])).logits[0, -1]
            assert [r[0] for r in rows[t]] == logits.topk(4).indices.tolist()
            a = rows[t][1][0]  # the second row goes on greedily from [t, a]
            nxt = int(model(torch.tensor([[bos, t, a]])).logits[0, -1].argmax())
            assert rows[t][1][1] == nxt
            nxt2 = int(model(torch.tensor([[bos, t, a, nxt]])).logits[0, -1].argmax())
            assert rows[t][1][2] == nxt2


def test_cache_is_reused_and_a_corrupt_one_ignored(smol, rows_fn, tmp_path):
    _model, tok = smol
    prompt = chat_prompt(tok, PASSAGES[0], QUESTIONS[0][0])
    path = tmp_path / "b.sqlite"
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    first = drafter(rows_fn, path)
    first.prepare(state)
    assert first.table.computed >= len(set(prompt))
    again = drafter(rows_fn, path)
    again.prepare(state)
    assert again.table.computed == 0 and again.table.loaded == first.table.computed
    assert again.table.rows == first.table.rows
    # half-written: the file cut short; garbage: not a database. Either is dropped and recomputed.
    data = path.read_bytes()
    for bad in (data[: len(data) // 2], b"not a database" * 100):
        path.write_bytes(bad)
        d = drafter(rows_fn, path)
        d.prepare(state)
        assert d.table.rows == first.table.rows  # right rows, whatever the file held
        assert d.table.computed + d.table.loaded == first.table.computed
    # a row whose bytes were changed on disk fails its checksum: recomputed, not trusted
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("UPDATE rows SET data = zeroblob(length(data)) WHERE token = ?", (prompt[-1],))
    d = drafter(rows_fn, path)
    d.prepare(state)
    assert d.table.computed == 1 and d.table.rows == first.table.rows


def test_mixed_tree_context_first_then_bigram():
    calls = []

    def fake(tokens, k, w):
        calls.append(sorted(tokens))
        return {t: [[1000 + t * 10 + i] for i in range(k)] for t in tokens}

    tokens = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5]  # after 5: "6 7" twice, "6 8" once
    d = NgrammysDrafter(k=4, w=2, model_rows=fake)
    state = DraftState(tokens=list(tokens), prompt_len=len(tokens))
    d.prepare(state)
    tree = d.propose(state, 64)
    # one context draft per distinct continuation (6 7 twice: first; then 6 8), sharing the node for 6
    first = tree.children(-1)
    assert tree.tokens[first[0]] == 6 and tree.sources[first[0]] >= 0
    assert [tree.tokens[i] for i in tree.children(first[0])] == [7, 8]
    # two branches left for the bigram rows of the root (5): chained through the rows of their tokens
    assert [tree.tokens[i] for i in first[1:]] == [1050, 1051]
    assert all(tree.sources[i] == -1 for i in first[1:])
    assert tree.tokens[tree.children(first[1])[0]] == 1000 + 1050 * 10
    for s, t in zip(tree.sources, tree.tokens):
        assert s < 0 or tokens[s] == t
    assert d.propose(state, 2).tokens == tree.tokens[:2]  # the budget cuts the worst last
    state.tokens.append(77)
    d.update(state, [77])
    assert 77 in calls[-2] or 77 in calls[-1]  # the new token's row is computed once, in update


def test_make_drafter_and_params(smol):
    model, tok = smol
    check_params("ngrammys", {"k": 10, "w": 4, "extend": "greedy"})
    with pytest.raises(ValueError):
        check_params("ngrammys", {"model_rows": None})
    d = make_drafter("ngrammys", model, tok, k=3)
    assert d.k == 3 and d.table.path.parent.name == "bigram" and "-chain-k3-w1" in d.table.path.name


def test_ngrammys_drafts_keep_the_distribution(smol, rows_fn, tmp_path):
    """An ngrammys tree (context branches and bigram branches under one root) under sampling, as the
    suffix test does: one verifier forward, the acceptance run SAMPLES times on its logits."""
    from test_engine_sampling import assert_follows, colour_prompt, exact_joint, tree_pairs

    model, tok = smol
    prompt = colour_prompt(tok)
    _p1, joint = exact_joint(model, prompt)
    d = drafter(rows_fn, tmp_path / "s.sqlite", k=6, w=3)
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    d.prepare(state)
    tree = d.propose(state, 24)
    assert len(tree.children(-1)) >= 3 and tree.max_depth() >= 2
    assert any(s >= 0 for s in tree.sources) and any(s < 0 for s in tree.sources)  # both strategies
    assert_follows(joint, tree_pairs(model, prompt, joint, tree))
