"""The GPU path with the real SmolLM2-135M: greedy through every drafter equals `generate` on the same device
(float32 and bfloat16), sampling keeps the model's distribution, tree masks and tree forwards, the source
cache's re-rotated keys and assembly, the index's embeddings. Skipped with the reason where torch sees no CUDA
device; `RAGSPEC_TEST_DEVICE=cpu` runs them on the CPU (to check the tests themselves). On the device they run
from examples/gpu_check.sh, where `RAGSPEC_TEST_EMBEDDER` names the carried MiniLM folder."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt

from ragspec.bench.decoding import top2_margin
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import METHODS, make_drafter
from ragspec.decoding.drafters.oracle import OracleDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.tree import DraftTree

DEVICE = os.environ.get("RAGSPEC_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                   reason="no CUDA device on this machine")]
SMOL = "smollm2-135m-instruct"
NEW = 48
# t(n) flat, as on a GPU: the budget drafts wide, so big trees (and their masks) are exercised
FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [10, 10, 10, 10.2, 10.4, 10.8, 11.6, 13, 16])
# A greedy token may differ from `generate`'s only where the reference's top two logits are this close: a tree
# forward runs other matrix shapes than one-token steps, so its sums round otherwise (bfloat16 keeps 8 bits)
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.5}
_models: dict = {}


def smol(dtype: str = "float32"):
    if dtype not in _models:
        from ragspec.models.generator import load_generator

        torch.manual_seed(0)
        _models[dtype] = load_generator(SMOL, device=DEVICE, dtype=dtype)
    return _models[dtype]


def reference(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cases(request):
    model, tok = smol(request.param)
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    prompts = [chat_prompt(tok, PASSAGES[p], q) for q, p in QUESTIONS]
    return request.param, [(prompt, reference(model, prompt, NEW, eos)) for prompt in prompts]


@pytest.mark.parametrize("method", [*METHODS, "oracle"])
def test_greedy_matches_generate(cases, method):
    dtype, pairs = cases
    model, tok = smol(dtype)
    assert next(model.parameters()).device.type == DEVICE
    accepted = 0
    for prompt, ref in pairs:
        drafter = OracleDrafter(ref, FLAT) if method == "oracle" else make_drafter(method, model, tok)
        gen = SpeculativeGenerator(model, tok, drafter=drafter, max_new_tokens=NEW,
                                   budget=256 if method == "oracle" else AdaptiveBudget(FLAT))
        gen.generate(prompt)
        if gen.tokens != ref:
            at = next(i for i, (x, y) in enumerate(zip(gen.tokens + [-1], ref)) if x != y)
            margin = top2_margin(model, prompt, ref[:at])
            assert margin < NEAR_TIE[dtype], (method, dtype, at, margin)
        accepted += gen.stats.accepted_draft_tokens
    assert accepted > 0 or method == "none"


def test_sampling_keeps_the_distribution():
    """The suffix drafter's scored tree (several continuations of a repeated spot), sampled through one verifier
    forward on the device: the first two tokens follow the model's exact joint (chi-square, with power)."""
    from test_engine_sampling import SETTINGS, assert_follows, colour_prompt, tree_pairs

    from ragspec.decoding.drafters.base import DraftState
    from ragspec.decoding.drafters.suffix import SuffixDrafter
    from ragspec.decoding.sampling import target_probs

    model, tok = smol("float32")
    prompt = colour_prompt(tok)
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([prompt], device=DEVICE)).logits[0, -1], SETTINGS).cpu()
        joint = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = target_probs(model(torch.tensor([prompt + [t1]], device=DEVICE)).logits[0, -1], SETTINGS).cpu()
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    drafter = SuffixDrafter()
    state = DraftState(tokens=list(prompt), prompt_len=len(prompt))
    drafter.prepare(state)
    tree = drafter.propose(state, 12)
    assert len(tree.children(-1)) >= 2 and tree.max_depth() >= 2
    assert_follows(joint, tree_pairs(model, prompt, joint, tree, seed=7))


def assert_rows_follow_paths(model, prompt: list[int], t: DraftTree, logits) -> None:
    """Each node's row of a tree forward (row 0: the root) equals the last row of a plain forward over the
    prompt and that node's path."""
    for node in range(len(t)):
        path, n = [], node
        while n >= 0:
            path.append(t.tokens[n])
            n = t.parents[n]
        with torch.inference_mode():
            ref = model(torch.tensor([prompt + path[::-1]], device=DEVICE)).logits[0, -1].float()
        assert torch.allclose(logits[node + 1], ref, atol=2e-3 * ref.abs().max().item()), node


def test_tree_mask_and_forward_on_the_device():
    """The tree's mask built on the device equals the CPU's, and each node's row of one tree forward equals the
    last row of a plain forward over the cache plus that node's path."""
    from ragspec.decoding.backends.transformers import TransformersBackend
    from ragspec.decoding.sampling import SamplingSettings

    model, tok = smol("float32")
    t = DraftTree()
    t.add_chain([5, 6, 7])
    t.add_chain([5, 9])
    t.add_chain([4, 11, 12, 13])
    for window in (None, 2):
        cpu = t.attention_mask(40, torch.float32, "cpu", window)
        dev = t.attention_mask(40, torch.float32, DEVICE, window)
        assert dev.device.type == DEVICE and torch.equal(cpu, dev.cpu())
    prompt = chat_prompt(tok, PASSAGES[0], QUESTIONS[0][0])
    backend = TransformersBackend(model, SamplingSettings())
    backend.prefill(prompt)
    logits = backend.score(t).float()  # row 0: the root (the prompt's last token, cached by the prefill)
    assert_rows_follow_paths(model, prompt, t, logits)


def test_static_verifier_replays_graphs():
    """On the device the static verifier captures each bucket's forward as a CUDA graph (no capture error),
    and each node's row of a replayed tree forward equals the last row of a plain forward over its path; the
    loop picks it there by default (`RAGSPEC_STATIC_VERIFIER=auto`), so the greedy tests above ran through it."""
    from ragspec.decoding.backends import backend_class
    from ragspec.decoding.backends.static_verifier import StaticBackend
    from ragspec.decoding.sampling import SamplingSettings

    model, tok = smol("float32")
    if DEVICE == "cuda":
        assert backend_class(model) is StaticBackend
    t = DraftTree()
    t.add_chain([5, 6, 7])
    t.add_chain([4, 11, 12, 13])
    prompt = chat_prompt(tok, PASSAGES[1], QUESTIONS[1][0])
    backend = StaticBackend(model, SamplingSettings())
    backend.prefill(prompt)
    for _ in range(2):  # the first call captures (on CUDA), the second replays
        logits = backend.score(t).float()
    assert backend.graph_error is None
    assert bool(backend._graphs) == (DEVICE == "cuda")
    assert_rows_follow_paths(model, prompt, t, logits)


def test_source_cache_rerotation_and_assembly_on_the_device():
    """Re-rotated keys equal keys computed at the target position; assembly with every source token recomputed
    equals a full prefill."""
    from conftest import PARAGRAPHS
    from transformers import DynamicCache

    from ragspec.decoding.backends import source_kv
    from ragspec.decoding.backends.transformers import cache_arg
    from ragspec.decoding.source_cache import SourceKVStore, SourcePlan
    from ragspec.pipeline.prompt import PromptBuilder, SourceText

    model, tok = smol("float32")

    def full(ids, start=0):
        cache = DynamicCache(config=model.config)
        pos = torch.arange(start, start + len(ids), device=DEVICE)[None]
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], device=DEVICE), position_ids=pos, **cache_arg(model, cache),
                        use_cache=True)
        return cache, out.logits[0, -1]

    sources = [SourceText(n + 1, text, path) for n, (path, text) in enumerate(PARAGRAPHS.items())]
    b = PromptBuilder(tok).build("Where does the Danube rise?", sources)
    at0, _ = full(b.ids[:80])
    for d in (1, 37, 900):
        atd, _ = full(b.ids[:80], d)
        inv = source_kv.rotary(model).inv_freq
        for l0, ld in zip(at0.layers, atd.layers):
            moved = source_kv.rotate(l0.keys, d, inv)
            assert moved.device.type == DEVICE
            assert torch.allclose(moved, ld.keys, atol=1e-4 * ld.keys.abs().max().item(), rtol=0)
    _, ref = full(b.ids)
    plan = SourcePlan(SourceKVStore(), b.head, b.pieces, recompute=10_000)
    cache, logits = source_kv.assemble(model, b.ids, plan)
    assert torch.allclose(logits, ref, atol=1e-3)
    assert cache.layers[0].keys.shape[2] == len(b.ids)


def test_index_embeddings_on_the_device():
    """The embedder on the device (float16 on CUDA) gives the CPU's float32 vectors: cosine ≥ 0.999 for every
    text (0.995 where `auto` picks bfloat16: a CPU run of this test)."""
    from conftest import PARAGRAPHS

    from ragspec.models.embedder import load_embedder

    name = os.environ.get("RAGSPEC_TEST_EMBEDDER", "all-minilm-l6-v2")
    texts = [*PARAGRAPHS.values(), "How do I open a file for appending?", "Where does the Danube rise?"]
    cpu = load_embedder(name, "cpu", "float32", 256).encode(texts)
    emb = load_embedder(name, DEVICE, "auto", 256)
    cos = (np.asarray(cpu) * np.asarray(emb.encode(texts))).sum(axis=1)
    assert cos.min() >= (0.995 if emb.dtype == "bfloat16" else 0.999), (emb.dtype, cos)  # bf16 keeps 8 bits
