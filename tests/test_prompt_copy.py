"""dtype gguf's int8 prompt copy (RAGSPEC_GGUF_PROMPT=int8): prompt positions read by int8 weights per output
channel, steps by the GGUF blocks. What must hold: the copy is the de-quantized weights within int8's rounding,
a prompt position gets the same bits however the prompt is read (whole, in chunks, behind a reused head or a
follow-up's prefix), steps never read it, and greedy output equals plain greedy of this same model for every
drafter. On a CPU whose `torch._int_mm` has no int8 units the copy runs its fp32 kernel (the same numbers), so
these run everywhere."""

from __future__ import annotations

import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt

from ragspec.decoding.backends.transformers import generate_kwargs
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import RagspecError
from ragspec.runtime import gguf_linear
from ragspec.runtime.fused_layers import FusedMLP
from ragspec.runtime.gguf_linear import GGUFLinear
from ragspec.runtime.prompt_mode import prompt_copy, prompt_forward, reads_by_role

SMOL = "smollm2-135m-instruct"
FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])


@pytest.fixture(scope="module")
def copied():
    from ragspec.models.generator import load_generator

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_linear, "prompt_copy_kind", lambda default=None: "int8")
        return load_generator(SMOL, dtype="gguf")


@pytest.fixture(scope="module")
def mlp_copied():
    from ragspec.models.generator import load_generator

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_linear, "prompt_copy_kind", lambda default=None: "int8-mlp")
        return load_generator(SMOL, dtype="gguf")


@pytest.fixture(scope="module")
def plain():
    from ragspec.models.generator import load_generator

    return load_generator(SMOL, dtype="gguf")


def greedy_reference(model, prompt, max_new, eos):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
                             attention_mask=torch.ones_like(ids), **generate_kwargs(model, prompt))
    return out[0, len(prompt):].tolist()


def test_every_linear_but_the_head_has_the_copy(copied):
    model, _ = copied
    assert prompt_copy(model) == "int8"
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert model.lm_head.prompt_int8 is None
    assert all(m.prompt_int8 is not None for m in linears if m is not model.lm_head)
    assert all(m._int8 for m in model.modules() if isinstance(m, FusedMLP))
    step, copy = map(sum, zip(*(m.nbytes() for m in linears), strict=True))
    assert copy > step  # 1 byte a weight against ~4.5-5 bits


def test_the_mlp_copy_leaves_the_attention_projections_on_their_blocks(mlp_copied, copied):
    """`int8-mlp`: the MLPs' linears alone have the copy (most of a layer's weights); q, k, v and o read prompt
    positions on their blocks, and the prompt is still read by role (its attention in prompt_attention.cpp)."""
    model, _ = mlp_copied
    assert prompt_copy(model) == "int8-mlp" and reads_by_role(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert all((m.prompt_int8 is not None) == (".mlp." in n) for n, m in linears.items())
    assert all(m._int8 for m in model.modules() if isinstance(m, FusedMLP))
    full = sum(m.nbytes()[1] for m in copied[0].modules() if isinstance(m, GGUFLinear))
    part = sum(m.nbytes()[1] for m in linears.values())
    assert 0.5 * full < part < full


def test_the_mlp_products_reuse_one_buffer_with_the_same_bits(copied):
    """The int8 MLP's gate and up products go into one reused int32 buffer (`fused_layers._PRODUCTS`): the same
    logits as fresh products, whether the buffer is free or held by another forward (which then allocates)."""
    from ragspec.runtime import fused_layers
    from ragspec.runtime.int8_linear import int8_kernel

    if int8_kernel() != "int_mm":
        pytest.skip("no int8 units here: the copy runs its fp32 kernel, which makes no int32 products to reuse")
    model, tok = copied
    ids = torch.tensor([chat_prompt(tok, PASSAGES[1], QUESTIONS[1][0])[:80]])
    with torch.inference_mode(), prompt_forward():
        reused = model(input_ids=ids).logits
        buf = fused_layers._PRODUCTS._buf
        assert buf is not None and buf.dtype == torch.int32
        with fused_layers._PRODUCTS.pair(1, 1):  # held here: the forward makes its own products
            fresh = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(reused, fresh) and torch.equal(reused, again)
    assert fused_layers._PRODUCTS._buf is buf  # no larger forward came: the same buffer


def test_copy_is_the_blocks_within_int8_rounding(copied):
    """Per output channel int8 of the de-quantized blocks, per row int8 activations, against the blocks
    de-quantized in float32 on Gaussian rows: relative RMS error under 2 % and every output within 5 % of its
    row's largest (measured: 1.1-1.2 % and 2.2-3.9 %, about twice the integer kernel's own 0.5 % and 0.7-1.6 %,
    whose activations take a scale per 32)."""
    model, _ = copied
    torch.manual_seed(0)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj", "model.layers.29.mlp.up_proj"):
        lin = model.get_submodule(name)
        x = torch.randn(24, lin.in_features)
        ref = x @ lin.dequantize().T
        with prompt_forward():
            got = lin(x)
        assert float(((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt()) < 0.02, name
        assert float(((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max()) < 0.05, name
        assert not torch.equal(got, lin(x))  # outside a prompt forward the blocks run


def test_the_copy_is_made_from_the_packed_blocks(copied):
    """Not kept on disk (only the blocks are): made from them by `int8_copy.cpp` with the bits of the torch
    reference (`gguf_formats.int8_copy`), so the same outputs as a copy made from the de-quantized weight."""
    from safetensors import safe_open

    from ragspec.models.gguf_source import gguf_source
    from ragspec.runtime.gguf_blocks import blocks_path
    from ragspec.runtime.gguf_formats import int8_copy
    from ragspec.runtime.int8_linear import Int8Linear

    model, _ = copied
    cfg = model.config
    kept = blocks_path(gguf_source(SMOL), cfg.num_attention_heads, cfg.num_key_value_heads)
    with safe_open(str(kept), framework="pt") as f:
        assert all(key.rsplit("/", 1)[1] in ("w", "wh", "d", "mn") for key in f.keys())
    assert not list(kept.parent.glob(kept.name.split(".blocks-")[0] + ".blocks8-*"))  # an older packing with it
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.7.mlp.gate_proj", "model.layers.3.mlp.down_proj"):
        lin = model.get_submodule(name)
        x = torch.randn(5, lin.in_features)
        q, scale = int8_copy(lin.fmt, lin.w, lin.wh, lin.d, lin.mn, lin.out_features, lin.in_features)
        assert torch.equal(lin.prompt_int8.w_scale.reshape(-1), scale), name
        if hasattr(lin.prompt_int8, "w_q"):  # the int_mm kernel's weights as made
            assert torch.equal(lin.prompt_int8.w_q, q), name
        assert torch.equal(lin.prompt_int8(x), Int8Linear.from_weight(lin.dequantize(), lin.bias)(x)), name


def test_the_copy_is_made_when_a_prompt_first_reads_it_and_steps_never_make_it(copied):
    """Made late (so a new machine's t(n) measurement, steps only, does not hold it beside its own logits): a
    step leaves every copy unmade, the first prompt forward makes them all, `make_prompt_copies` the rest."""
    from ragspec.models.generator import load_generator
    from ragspec.runtime.gguf_linear import make_prompt_copies

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_linear, "prompt_copy_kind", lambda default=None: "int8")
        model, tok = load_generator(SMOL, dtype="gguf")
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.wants_int8]
    assert len(linears) == 7 * model.config.num_hidden_layers and all(m._int8 is None for m in linears)
    ids = torch.tensor([chat_prompt(tok, PASSAGES[0], QUESTIONS[0][0])])
    with torch.inference_mode():
        step = model(input_ids=ids).logits
        assert all(m._int8 is None for m in linears)
        with prompt_forward():
            read = model(input_ids=ids).logits
        assert all(m._int8 is not None for m in linears) and make_prompt_copies(model) == 0
        with prompt_forward():
            assert torch.equal(read, copied[0](input_ids=ids).logits)  # the bits of a copy made at once
    assert torch.equal(step, copied[0](input_ids=ids).logits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_linear, "prompt_copy_kind", lambda default=None: "int8")
        fresh, _ = load_generator(SMOL, dtype="gguf")
    assert make_prompt_copies(fresh) == len(linears) and make_prompt_copies(fresh) == 0


def test_steps_never_read_the_copy(copied, plain):
    """Outside prompt forwards the model with the copy computes the same bits as the model without it."""
    (a, tok), (b, _) = copied, plain
    ids = torch.tensor([chat_prompt(tok, PASSAGES[0], QUESTIONS[0][0])])
    with torch.inference_mode():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
        with prompt_forward():
            assert not torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


@pytest.mark.parametrize("which", ["copied", "mlp_copied", "plain"])
def test_a_prompt_position_is_the_same_however_the_prompt_is_read(which, request):
    """Whole, or in chunks of 7 and the rest, or one row at a time: the same keys, values and logits, with the
    int8 copy and without it (prompt attention alone reads prompt rows otherwise than steps)."""
    from transformers import DynamicCache

    from ragspec.decoding.backends.transformers import cache_arg

    model, tok = request.getfixturevalue(which)
    assert reads_by_role(model)
    prompt = chat_prompt(tok, PASSAGES[1], QUESTIONS[1][0])[:60]

    def read(cuts):
        cache, logits = DynamicCache(config=model.config), []
        with torch.inference_mode(), prompt_forward():
            for a, b in zip([0, *cuts], [*cuts, len(prompt)], strict=True):
                out = model(input_ids=torch.tensor([prompt[a:b]]), **cache_arg(model, cache), use_cache=True)
                logits.append(out.logits[0])
        return cache, torch.cat(logits)

    whole, logits = read([])
    for cuts in ([7], [1, 2, 3, 40], list(range(1, 60))):
        cache, got = read(cuts)
        assert torch.equal(got, logits), cuts
        for x, y in zip(cache.layers, whole.layers, strict=True):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values), cuts


@pytest.mark.parametrize(("which", "method"), [
    *(("copied", m) for m in ("none", "pld", "trie", "suffix", "lookahead", "ngrammys", "auto", "pldplus-h",
                              "pldplus-a")),
    *(("mlp_copied", m) for m in ("none", "pld", "suffix", "pldplus-a"))])
def test_greedy_matches_plain_greedy_with_the_copy(which, method, request):
    model, tok = request.getfixturevalue(which)
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    accepted = 0
    for q, p in QUESTIONS:
        prompt = chat_prompt(tok, PASSAGES[p], q)
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=40,
                                   budget=AdaptiveBudget(FLAT))
        gen.generate(prompt)
        assert gen.tokens == greedy_reference(model, prompt, 40, eos), (method, q)
        accepted += gen.stats.accepted_draft_tokens
    assert accepted > 0 or method == "none"


def test_reused_heads_and_follow_ups_answer_as_read_whole(copied):
    """The tree of earlier prompts keeps only positions read as prompt (before the prompt's
    last token), so every ask answers as its prompt read whole; the source cache says it does not apply."""
    from ragspec.pipeline import Pipeline

    model, tok = copied
    spec = {"generator": {"model": SMOL, "max_new_tokens": 24}, "drafting": {"method": "suffix"},
            "prompt": {"relevance_floor": "off", "source_tokens": "off"}}
    reuse, whole = (Pipeline(spec, model=model, tokenizer=tok) for _ in range(2))
    whole._prompts = False
    for q, p in QUESTIONS:
        a, b = reuse.ask(q, documents=[PASSAGES[p]]), whole.ask(q, documents=[PASSAGES[p]])
        assert a.text == b.text and b.stats.prefix_reused_tokens == 0
    assert a.stats.prefix_reused_tokens > 20  # the head

    q, p = QUESTIONS[1]
    follow = Pipeline(spec, model=model, tokenizer=tok).enable_prefix_cache(4)
    first = follow.ask(q, documents=[PASSAGES[p]])
    history = [{"role": "user", "content": q}, {"role": "assistant", "content": first.text}]
    again = follow.ask("Quote the sentence that says so.", documents=[PASSAGES[p]], history=history)
    fresh = whole.ask("Quote the sentence that says so.", documents=[PASSAGES[p]], history=history)
    assert again.text == fresh.text
    assert again.stats.prefix_reused_tokens == first.stats.prompt_tokens - 1  # not the root, nor the answer

    cached = whole.ask(q, documents=[PASSAGES[p]], source_cache="on")
    assert "second weight copy" in cached.stats.cache_note and cached.text == first.text


def test_the_setting_is_checked_and_wins_over_a_models_own():
    """RAGSPEC_GGUF_PROMPT decides when set; unset, a model's measured setting (registry `prompt_copy`: the Qwen
    models' int8) does, where int8 units run it."""
    import os
    from unittest import mock

    from ragspec.models.generator import prompt_copy_key
    from ragspec.models.registry import lookup
    from ragspec.runtime.int8_linear import int8_kernel

    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "fp4"}), pytest.raises(RagspecError, match="int8"):
        gguf_linear.prompt_copy_kind()
    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "0"}):
        assert gguf_linear.prompt_copy_kind(default="int8") is None
    with mock.patch.dict(os.environ, {"RAGSPEC_GGUF_PROMPT": "int8"}):
        assert prompt_copy_key(SMOL) == "int8"
    env = {k: v for k, v in os.environ.items() if k != "RAGSPEC_GGUF_PROMPT"}
    with mock.patch.dict(os.environ, env, clear=True):
        here = "int8" if int8_kernel() == "int_mm" else None
        assert gguf_linear.prompt_copy_kind(default="int8") == here and gguf_linear.prompt_copy_kind() is None
        assert prompt_copy_key(SMOL) == "0"  # models without one keep their calibration keys
        assert lookup("qwen2.5-coder-1.5b-instruct").extra["prompt_copy"] == "int8"
        assert lookup("qwen2.5-coder-0.5b-instruct").extra["prompt_copy"] == "int8-mlp"  # its memory: see registry
        assert prompt_copy_key("qwen2.5-coder-1.5b-instruct") == (here or "0")


def test_the_gate_takes_the_band_of_the_copy_the_loaded_model_reads_prompts_with(copied, plain, monkeypatch):
    """The copy's answers judge the doubtful questions a little differently (the 1.5B's refusal with the int8
    copy was 0.013 lower at its plain floor), so a generator may have a band per copy (registry
    `relevance_band_with_copy`); the pipeline's gate takes the one of the model it loaded."""
    from ragspec.models.registry import generator_entry
    from ragspec.pipeline import Pipeline

    extra = generator_entry(SMOL).extra
    monkeypatch.setitem(extra, "relevance_band", {"all-minilm-l6-v2": (0.40, 0.60)})
    monkeypatch.setitem(extra, "relevance_band_with_copy", {"int8": {"all-minilm-l6-v2": (0.45, 0.60)}})
    for (model, tok), band in ((plain, (0.40, 0.60)), (copied, (0.45, 0.60))):
        gate = Pipeline({"generator": {"model": SMOL}}, model=model, tokenizer=tok).relevance_gate
        assert (gate.floor, gate.doubt) == band
