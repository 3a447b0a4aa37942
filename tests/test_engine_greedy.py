"""Greedy draft-and-verify output is token-for-token identical to `model.generate` greedy (SmolLM2, CPU),
for every drafter and for adversarial ones."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_cases import chat_prompt, reference

from ragspec.decoding.drafters.base import NoDraft
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.pldplus import PLDPlusAttentionDrafter, PLDPlusHiddenDrafter
from ragspec.decoding.drafters.trie import NgramTrieDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.tree import DraftTree


def run(smol, drafter, prompt, max_new=48, budget=64):
    model, tok = smol
    gen = SpeculativeGenerator(model, tok, drafter=drafter, max_new_tokens=max_new, budget=budget)
    text = gen.generate(prompt)
    return gen, text


def pldplus_h():
    return PLDPlusHiddenDrafter(layer=9, branches=2)


def pldplus_a():
    # heads fixed here (calibration has its own test): layer 4-6 heads of SmolLM2's 30 layers × 9 heads
    return PLDPlusAttentionDrafter(heads=[(4, 0), (5, 3), (6, 1), (12, 2)], branches=2)


@pytest.mark.parametrize("make", [NoDraft, PromptLookupDrafter, NgramTrieDrafter, lambda: NgramTrieDrafter(n=24, lp=2),
                                  pldplus_h, pldplus_a], ids=["none", "pld", "trie", "trie-n24", "pldplus-h", "pldplus-a"])
def test_drafters_match_generate(smol, cases, make):
    _model, tok = smol
    accepted = 0
    for prompt, ref in cases:
        gen, text = run(smol, make(), prompt)
        assert gen.tokens == ref
        assert text == tok.decode(ref, skip_special_tokens=True)
        accepted += gen.stats.accepted_draft_tokens
    if not isinstance(make(), NoDraft):
        assert accepted > 0  # the context was copied from


class RandomDrafter:
    name, hidden_layer = "random", None

    def __init__(self, size=20, vocab=49152, seed=0):
        self.rng, self.size, self.vocab = random.Random(seed), size, vocab

    def prepare(self, state):
        pass

    def update(self, state, new):
        pass

    def propose(self, state, budget):
        t = DraftTree()
        for _ in range(min(self.size, budget)):
            parent = self.rng.randrange(-1, len(t)) if len(t) else -1
            t.add(parent, self.rng.randrange(self.vocab))
        return t


class OracleDrafter:
    """Knows the reference continuation: drafts it correctly, then keeps going past eos / max_new_tokens,
    with random side branches — up to `size` nodes."""

    name, hidden_layer = "oracle", None

    def __init__(self, reference, size=200, seed=0, wrong_every=0):
        self.ref, self.size, self.rng, self.wrong_every = reference, size, random.Random(seed), wrong_every
        self.calls = 0

    def prepare(self, state):
        pass

    def update(self, state, new):
        pass

    def propose(self, state, budget):
        self.calls += 1
        done = len(state.generated)
        chain = self.ref[done:] + [self.rng.randrange(49152) for _ in range(40)]  # runs past the end
        if self.wrong_every and self.calls % self.wrong_every == 0 and chain:
            chain[min(2, len(chain) - 1)] = (chain[min(2, len(chain) - 1)] + 1) % 49152
        t = DraftTree()
        t.add_chain(chain[: self.size // 2])
        while len(t) < self.size:
            t.add(self.rng.randrange(-1, len(t)), self.rng.randrange(49152))
        return t


def test_adversarial_drafters(smol, cases):
    for i, (prompt, ref) in enumerate(cases[:2]):
        for drafter in (RandomDrafter(seed=i), RandomDrafter(size=0), OracleDrafter(ref, 200, seed=i),
                        OracleDrafter(ref, 30, seed=i, wrong_every=2)):
            gen, _ = run(smol, drafter, prompt, budget=200)
            assert gen.tokens == ref, drafter.name
    # the oracle at 200 nodes really was verified in big steps
    gen, _ = run(smol, OracleDrafter(cases[0][1], 200), cases[0][0], budget=200)
    assert gen.stats.steps <= 3


def check_limits_and_eos(smol, cases, drafters, budget=64):
    """Output equals greedy when max_new_tokens or eos falls inside a draft: `drafters(ref, size)` gives the
    drafters to try for a reference continuation (each is run fresh)."""
    model, tok = smol
    prompt, ref = cases[0]
    for limit in (1, 2, 5, 13):
        for drafter in drafters(ref, budget):
            gen, _ = run(smol, drafter, prompt, max_new=limit, budget=budget)
            assert gen.tokens == ref[:limit], drafter.name
            assert gen.stats.new_tokens == min(limit, len(ref))
    # a prompt whose answer ends with eos inside max_new_tokens
    short = chat_prompt(tok, "The sky is blue.", "Answer with one word: what colour is the sky?")
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    ref = reference(model, short, 40, eos)
    assert ref[-1] in eos and len(ref) < 40
    for drafter in drafters(ref, 2 * budget):
        gen, text = run(smol, drafter, short, max_new=40, budget=2 * budget)
        assert gen.tokens == ref and gen.stats.finish_reason == "eos", drafter.name
        assert text == tok.decode(ref, skip_special_tokens=True)


def test_max_new_tokens_and_eos_are_never_passed(smol, cases):
    check_limits_and_eos(smol, cases, lambda ref, size: [OracleDrafter(ref, size)], budget=60)


def test_stop_strings_cut_the_text(smol, cases):
    model, tok = smol
    prompt, ref = cases[0]
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full[10:14]
    gen = SpeculativeGenerator(model, tok, drafter=OracleDrafter(ref, 40), max_new_tokens=48, stop_strings=(stop,))
    deltas = list(gen.stream(prompt))
    text = "".join(d.text for d in deltas)
    assert text == full[: full.find(stop)]
    assert gen.stats.finish_reason == "stop"


def test_provenance_points_into_the_context(smol, cases):
    model, tok = smol
    prompt, ref = cases[0]
    gen = SpeculativeGenerator(model, tok, drafter=NgramTrieDrafter(), max_new_tokens=48)
    deltas = list(gen.stream(prompt))
    toks = [t for d in deltas for t in d.tokens]
    srcs = [s for d in deltas for s in d.sources]
    assert toks == ref and len(srcs) == len(toks)
    copied = [(t, s) for t, s in zip(toks, srcs) if s >= 0]
    assert copied
    for t, s in copied:
        assert prompt[s] == t  # a copied token equals the context token it points at


def test_induction_head_calibration_is_cached_and_used(smol, tmp_path):
    from ragspec.decoding.drafters import make_drafter
    from ragspec.decoding.heads import calibrate_heads

    model, tok = smol
    heads = calibrate_heads(model, tok, top=8, new_tokens=24, cache_dir=tmp_path)
    assert len(heads) == 8 and len(set(heads)) == 8
    layers, per_layer = model.config.num_hidden_layers, model.config.num_attention_heads
    assert all(0 <= layer < layers and 0 <= h < per_layer for layer, h in heads)
    assert calibrate_heads(model, tok, top=8, cache_dir=tmp_path) == heads  # read back, not re-measured
    d = make_drafter("pldplus-a", model, tok, heads=heads)
    assert d.attention_heads == tuple(heads) and model.config._attn_implementation != "eager"


def test_attention_row_covers_the_cache(smol, cases):
    from ragspec.decoding.verifier import Verifier

    model, _ = smol
    prompt, _ref = cases[0]
    v = Verifier(model, attention_heads=((4, 0), (5, 3)))
    v.prefill(prompt)
    row = v.attention_row()
    assert row is not None and row.shape[0] == v.cached == len(prompt) - 1
    assert abs(float(row.max())) <= 1.0 + 1e-5 and float(row.min()) >= 0.0
    v.step(DraftTree())
    assert v.attention_row().shape[0] == v.cached == len(prompt)
    assert model.config._attn_implementation != "eager"  # eager only inside the step
    v.close()


def test_tree_steps_read_grouped_heads_in_place(smol, cases):
    """On CPU a loaded model runs `ragspec_sdpa` (runtime/tree_attention.py): a masked tree step reads the
    grouped key/value heads without copying them, and scores every row as transformers' own `sdpa` does."""
    from ragspec.decoding.backends.transformers import TransformersBackend

    model, _ = smol
    assert model.config._attn_implementation == "ragspec_sdpa"
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads: the case at hand
    prompt, ref = cases[1]
    tree = DraftTree()
    tree.add_chain(ref[:6])
    tree.add_chain([ref[0], ref[1] + 1, ref[2]])
    tree.add_chain([ref[0] + 3])
    scores = {}
    for impl in ("ragspec_sdpa", "sdpa"):
        model.set_attn_implementation(impl)
        try:
            backend = TransformersBackend(model)
            backend.prefill(prompt[:-1] + [prompt[-1]])
            backend.step(DraftTree())  # past the prefill's cached root: the next step runs [root + tree]
            scores[impl] = backend.score(tree)
        finally:
            model.set_attn_implementation("ragspec_sdpa")
    ours, theirs = scores["ragspec_sdpa"], scores["sdpa"]
    assert ours.shape == (1 + len(tree), model.config.vocab_size)
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_first_token_streams_before_the_first_step(smol, cases):
    """Greedy with the root's logits kept by the prefill: the first answer token is out before any step runs,
    and the answer is still greedy's token for token."""
    model, tok = smol
    prompt, ref = cases[0]
    for drafter in (OracleDrafter(ref, 40), RandomDrafter(seed=3), NoDraft()):
        gen = SpeculativeGenerator(model, tok, drafter=drafter, max_new_tokens=48)
        stream = gen.stream(prompt)
        first = next(stream)
        assert first.tokens == ref[:1] and gen.stats.steps == 0 and gen.stats.prefill_ms > 0
        deltas = [first] + list(stream)
        assert [t for d in deltas for t in d.tokens] == ref == gen.tokens
        assert gen.stats.new_tokens == len(ref) == sum(gen.stats.accepted_lengths)
    # a stop string inside the first token's text ends the answer before any step
    stop = tok.decode(ref[:1], skip_special_tokens=True).strip()[:1]
    gen = SpeculativeGenerator(model, tok, drafter=OracleDrafter(ref, 40), max_new_tokens=48, stop_strings=(stop,))
    text = gen.generate(prompt)
    full = tok.decode(ref, skip_special_tokens=True)
    assert text == full[: full.find(stop)] and gen.stats.finish_reason == "stop" and gen.stats.steps == 0
