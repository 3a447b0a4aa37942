"""Sampling through draft trees keeps the model's distribution exactly: the empirical distribution of the
first two generated tokens matches the model's (chi-square), with enough samples to catch a 5% error where the
acceptance runs on one verifier forward, and an 8% error where every draw is a whole verifier step. For dtype
gguf the model's distribution is the verifier's own plain steps: it reads a prompt with prompt kernels whose
rounding differs from a full forward's (enough to move a token across the top-p edge), and a tree row must give
the bits of a one-token step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from ragspec.decoding.sampling import SamplingSettings, target_probs
from ragspec.decoding.tree import DraftTree
from ragspec.decoding.verifier import Verifier

SAMPLES = 3000
# draws through whole verifier steps (a fork and one or two forwards each, ~0.1 s): 1,200 give the chi-square
# the same power against an 8% shift as 3,000 against 5% (the non-centrality grows with draws × shift²)
STEP_SAMPLES, STEP_SHIFT = 1200, 0.08
SETTINGS = SamplingSettings(temperature=1.0, top_k=5, top_p=0.97, seed=1234)


@pytest.fixture(scope="module")
def smol():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_gguf():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct", dtype="gguf")


def joint_from(p1, next_probs):
    """p(t1, t2) = p1[t1] · p(t2 | t1) over the tokens the sampling settings keep."""
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = next_probs(t1)
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return p1, joint


def exact_joint(model, prompt):
    """p(t1, t2) under the sampling settings, from plain forwards."""
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1], SETTINGS)
        return joint_from(p1, lambda t1: target_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1], SETTINGS))


def step_joint(model, prompt):
    """p(t1, t2) under the sampling settings from the verifier's own plain steps: the prompt read as its prefill
    reads it, then each t1 as a one-token step on that cache (score leaves the cache as it was)."""
    v = Verifier(model, SETTINGS)
    v.prefill(prompt)

    def after(t1):
        one = DraftTree()
        one.add(-1, t1)
        return target_probs(v.score(one)[1], SETTINGS)

    return joint_from(target_probs(v.score(DraftTree())[0], SETTINGS), after)


def draft_tree(p1, joint, prefix=None):
    """Several candidates per level: the second-likeliest first, then the likeliest, then an impossible one,
    each with children — every branch of the rejection scheme gets exercised."""
    t = DraftTree()
    order = torch.argsort(p1, descending=True).tolist()
    level1 = [order[1], order[0], order[-1]] if prefix is None else []
    for a in level1:
        node = t.add(-1, a)
        kids = sorted((k[1] for k in joint if k[0] == a), key=lambda b: -joint[(a, b)])
        for b in (kids[1:2] + kids[:1] + [order[-1]]):
            t.add(node, b)
    if prefix is not None:
        kids = sorted((k[1] for k in joint if k[0] == prefix), key=lambda b: -joint[(prefix, b)])
        for b in kids[1:2] + kids[:1] + [order[-1]]:
            t.add(-1, b)
    return t


def chat(tok, text):
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    return list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)


def sample_pairs(model, prompt, first_tree, second_tree, samples=STEP_SAMPLES):
    """`samples` draws of the first two tokens through the verifier, trees from the given functions."""
    base = Verifier(model, SETTINGS)
    base.prefill(prompt)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(samples):
        v = base.fork()
        toks = v.step(first_tree()).tokens
        if len(toks) < 2:
            toks = toks + v.step(second_tree(toks[0])).tokens[:1]
        key = (toks[0], toks[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def assert_follows(joint, counts, shift=0.05):
    """Chi-square of the sampled pairs against the exact joint, and enough power to catch `shift` of the
    probability moved from the likeliest pair to the next."""
    assert set(counts) <= set(joint), "sampled a pair the model gives zero probability"
    cells = sorted(joint, key=lambda k: -joint[k])
    samples = sum(counts.values())
    expected = np.array([joint[k] for k in cells]) * samples
    observed = np.array([counts.get(k, 0) for k in cells], dtype=float)
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    exp = np.append(expected[big], expected[~big].sum())
    obs = np.append(observed[big], observed[~big].sum())
    if exp[-1] < 5:
        exp[-2] += exp[-1]
        obs[-2] += obs[-1]
        exp, obs = exp[:-1], obs[:-1]
    chi2, pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert pvalue > 1e-3, (chi2, pvalue)
    # power: moving `shift` of the probability mass from the likeliest pair to the next is detected
    q = exp / exp.sum()
    shifted = q.copy()
    shifted[0] -= shift
    shifted[1] += shift
    noncentral = samples * float(np.sum((shifted - q) ** 2 / q))
    critical = stats.chi2.ppf(1 - 1e-3, len(q) - 1)
    power = 1 - stats.ncx2.cdf(critical, len(q) - 1, noncentral)
    assert power > 0.95, power


def colour_prompt(tok):
    """A chat prompt ending on a spot the context continued several ways (branches for a drafter)."""
    prompt = chat(tok, "List colours.")
    return prompt + tok("Colours: red, blue. red, green. red, pink. red,", add_special_tokens=False)["input_ids"]


def tree_pairs(model, prompt, joint, tree, seed=7):
    """SAMPLES draws of the first two tokens from one verifier forward over [root + tree]: the acceptance runs
    SAMPLES times on its logits (a second token the tree does not reach is drawn from the exact next-token
    distribution, as a plain step would)."""
    from ragspec.decoding.backends.accept import accept_sampled

    v = Verifier(model, SETTINGS)
    v.prefill(prompt)
    logits = v.score(tree)
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(SAMPLES):
        path, bonus = accept_sampled(tree, logits, SETTINGS, gen)
        toks = [tree.tokens[i] for i in path] + [bonus]
        if len(toks) < 2:
            t1 = toks[0]
            nxt = sorted(k[1] for k in joint if k[0] == t1)
            w = torch.tensor([joint[(t1, b)] for b in nxt])
            toks.append(nxt[int(torch.multinomial(w / w.sum(), 1, generator=gen))])
        counts[(toks[0], toks[1])] = counts.get((toks[0], toks[1]), 0) + 1
    return counts


def joint_of(request, dtype):
    """(model, tokenizer, the joint function) for a dtype: float32 against plain full forwards, gguf against the
    verifier's own one-token steps (its prompt kernels round otherwise than a full forward)."""
    if dtype == "float32":
        return (*request.getfixturevalue("smol"), exact_joint)
    return (*request.getfixturevalue("smol_gguf"), step_joint)


def test_first_two_tokens_follow_the_model(smol_gguf):
    """Whole verifier steps over trees of several candidates per level, on dtype gguf (the default on CPUs with
    AVX2). A step's acceptance is the same code for every dtype; float32's trees are checked against plain full
    forwards by the one-forward tests below (whole float32 steps cost 3.5 min of CI on a Zen 3 for no other path)."""
    model, tok = smol_gguf
    prompt = chat(tok, "Name one colour of the rainbow.")
    p1, joint = step_joint(model, prompt)
    counts = sample_pairs(model, prompt, lambda: draft_tree(p1, joint),
                          lambda first: draft_tree(p1, joint, prefix=first))
    assert_follows(joint, counts, shift=STEP_SHIFT)


@pytest.mark.parametrize("method, dtype", [("suffix", "float32"), ("auto", "float32"), ("suffix", "gguf")])
def test_suffix_drafts_keep_the_distribution(request, method, dtype):
    """The suffix drafter's own scored tree (several continuations of a repeated spot) under sampling."""
    from ragspec.decoding.drafters import make_drafter
    from ragspec.decoding.drafters.base import DraftState
    from ragspec.decoding.drafters.suffix import SuffixDrafter

    model, tok, joint_fn = joint_of(request, dtype)
    prompt = colour_prompt(tok)
    _p1, joint = joint_fn(model, prompt)
    drafter = SuffixDrafter() if method == "suffix" else make_drafter("auto")  # auto: suffix's and pld's trees
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    drafter.prepare(state)
    tree = drafter.propose(state, 12)
    assert len(tree.children(-1)) >= 2 and tree.max_depth() >= 2  # branches and depth: both exercised
    assert_follows(joint, tree_pairs(model, prompt, joint, tree, seed=7))


def test_lookahead_drafts_keep_the_distribution(smol):
    """The lookahead drafter's whole tree under sampling: G guesses from the prompt's pool and the Jacobi window
    (level 0's first token and column 0 both under the root, set to the likeliest and second-likeliest tokens so
    the window's branches are exercised too). One verifier forward; the acceptance runs SAMPLES times on it."""
    from ragspec.decoding.drafters.base import DraftState
    from ragspec.decoding.drafters.lookahead import LookaheadDrafter

    model, tok = smol
    prompt = colour_prompt(tok)
    p1, joint = exact_joint(model, prompt)
    order = torch.argsort(p1, descending=True).tolist()
    drafter = LookaheadDrafter(W=4, N=3, G=3)
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    drafter.prepare(state)
    drafter.levels[0][0] = order[1]  # orange 1
    drafter.levels[1][0] = order[0]  # column 0's level 1
    tree = drafter.propose(state, 64)
    assert tree.fixed and len(tree.children(-1)) >= 4 and tree.max_depth() >= 3
    assert_follows(joint, tree_pairs(model, prompt, joint, tree, seed=11))


def test_top_k_nucleus_from_the_k_kept_equals_the_whole_vocabulary_sort():
    """target_probs cuts the nucleus from the k kept logits where no tie sits at the k-th: the same
    probabilities as sorting the whole vocabulary (float rounding aside), and the sort where a tie does."""
    gen = torch.Generator().manual_seed(0)
    for k, p, temp in [(1, 0.97, 1.0), (5, 0.97, 1.0), (5, 1.0, 0.7), (50, 0.5, 1.5), (50, 0.1, 1.0)]:
        s = SamplingSettings(temperature=temp, top_k=k, top_p=p, seed=1)
        x = torch.randn(4, 49152, generator=gen) * 3
        x[3, :k + 2] = x[3].max()  # a tie across the k-th: every tied token stays, as the sort keeps them
        ref = x.float() / temp
        kth = torch.topk(ref, k, dim=-1).values[..., -1:]
        ref = ref.masked_fill(ref < kth, float("-inf"))
        if p < 1.0:
            sx, idx = torch.sort(ref, descending=True, dim=-1)
            q = torch.softmax(sx, dim=-1)
            ref = torch.full_like(ref, float("-inf")).scatter(-1, idx, sx.masked_fill(q.cumsum(-1) - q >= p,
                                                                                          float("-inf")))
        ref = torch.softmax(ref, dim=-1)
        got = target_probs(x, s)
        assert torch.equal(got[:3] > 0, ref[:3] > 0) and torch.allclose(got[:3], ref[:3], atol=1e-6)
        assert int((got[3] > 0).sum()) == int((ref[3] > 0).sum())  # which tied tokens a cut keeps is the sort's


def test_a_seed_draws_the_same_answer_whatever_is_drafted(smol_gguf):
    """Every emitted token takes the same count of numbers of the request's generator, so a seeded sampled answer is the same
    tokens with no drafter as with every drafter (and so alone as batched: the tree's size never matters)."""
    from ragspec.decoding.drafters import METHODS, make_drafter
    from ragspec.decoding.generate import SpeculativeGenerator

    model, tok = smol_gguf
    prompt = colour_prompt(tok)
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=5)

    def answer(method):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), sampling=sampling,
                                   max_new_tokens=32, eos_token_ids=[])
        gen.generate(prompt)
        return gen.tokens, gen.stats.accepted_draft_tokens

    plain, _ = answer("none")
    accepted = 0
    for method in [m for m in METHODS if m != "pldplus-a"]:  # pldplus-a: pldplus-h's walk after a head calibration
        tokens, drafted = answer(method)
        assert tokens == plain, method
        accepted += drafted
    assert accepted > 0  # drafts were taken: the equality is not that of plain steps
    other = SpeculativeGenerator(model, tok, sampling=SamplingSettings(temperature=0.9, top_p=0.95, seed=6),
                                 max_new_tokens=32, eos_token_ids=[])
    other.generate(prompt)
    assert other.tokens != plain  # the seed does choose the answer


def test_a_rounding_in_the_logits_keeps_each_seeds_token(smol):
    """A reused prefix cache or another prompt chunking moves the logits by a rounding. The race draws every seed's
    token again from the moved row; an inverse CDF, where the tail's tokens lie a rounding apart, moved 16 of these
    2,000 seeds (and one served answer in 30 kept-prefix seeds)."""
    from ragspec.decoding.backends.accept import draw

    model, tok = smol
    with torch.no_grad():
        logits = model(torch.tensor([chat(tok, "Name one colour of the rainbow.")])).logits[0, -1]
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    s = SamplingSettings(temperature=1.0)
    p, moved = target_probs(logits[None], s)[0], target_probs((logits * (1 + 1e-5 * noise))[None], s)[0]
    assert not torch.equal(p, moved)
    seeds = [k for k in range(2000)
             if draw(p, torch.Generator().manual_seed(k)) != draw(moved, torch.Generator().manual_seed(k))]
    assert seeds == []
