"""bf16 and int8 on CPU (SmolLM2): greedy draft-and-verify identical to the same model's own `generate`, and
the properties that identity rests on — a row's linear output and a position's logits do not depend on the
other rows computed with it.

These run on every CPU: without native bf16 (AVX512_BF16/AMX) bf16 is emulated, and without int8 units
(VNNI/AMX) int8 runs its exact fp32 kernel; both compute the same numbers as the native kernels, only slower,
so the identities hold and are checked regardless. A test is skipped only where its kernel cannot run at all
(bf16 packed linears need oneDNN bf16: AVX512BW/VL/DQ or AVX-NE-CONVERT; `torch._int_mm` needs PyTorch ≥ 2.2).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt, reference
from torch import nn

from ragspec.cpu_flags import native_bf16, native_int8
from ragspec.decoding.backends.transformers import cache_arg
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.suffix import SuffixDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import RagspecError
from ragspec.runtime.cpu_linear import PackedLinear, bf16_packing_available
from ragspec.runtime.int8_linear import EXACT_SLICE, Int8Linear
from ragspec.runtime.model_runtime import runtime_of

FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
# ragspec runs torch._int_mm only where the CPU has int8 units (VNNI/AMX: `int8_linear.int8_kernel`). Elsewhere
# PyTorch runs a reference loop, or, under examples/avx2_emulation (PyTorch still sees the host's VNNI), oneDNN held
# to AVX2, whose s8 x s8 pair sums saturate in int16: neither is a path ragspec takes.
HAS_INT_MM = hasattr(torch, "_int_mm") and native_int8()
INT_MM_SKIP = "no int8 units (VNNI/AMX) on this CPU, or no torch._int_mm in this PyTorch: ragspec runs it only with both"


def rows_alone_equal_batched(layer, x: torch.Tensor) -> bool:
    """Every row of `layer(x)` is bit-identical to the row computed alone and in shorter batches."""
    with torch.inference_mode():
        full = layer(x)
        for m in (1, 2, 3, 7, 16, 17, x.shape[0]):
            if not torch.equal(layer(x[:m]), full[:m]):
                return False
        return all(torch.equal(layer(x[i : i + 1])[0], full[i]) for i in range(x.shape[0]))


# -- int8 linears --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["fp32", pytest.param("int_mm", marks=pytest.mark.skipif(
    not HAS_INT_MM, reason=INT_MM_SKIP))])
@pytest.mark.parametrize("shape", [(96, 200), (2 * EXACT_SLICE + 3, 64)], ids=["one-slice", "three-slices"])
def test_int8_rows_are_independent(kernel, shape):
    """Per-row activation scales: a draft row can never change another row's output (a batch-wide scale would:
    one outlier row coarsens every row's quantisation)."""
    torch.manual_seed(0)
    lin = nn.Linear(*shape)
    x = torch.randn(40, shape[0]) * torch.logspace(-2, 2, 40)[:, None]  # rows of very different ranges
    x[5, 3] = 500.0  # an outlier row
    layer = Int8Linear(lin, kernel)
    assert rows_alone_equal_batched(layer, x)
    with torch.inference_mode():
        y, ref = layer(x), lin(x)
    assert ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.03  # int8 error, per row


@pytest.mark.skipif(not HAS_INT_MM, reason=INT_MM_SKIP)
def test_int8_kernels_compute_the_same_bits():
    """The fp32 kernel is the exact integer product (every partial sum < 2²⁴), so it equals `torch._int_mm`,
    bit for bit, including at the worst case (all ±127) and over several slices."""
    torch.manual_seed(1)
    for k, n in ((64, 40), (EXACT_SLICE, 24), (3 * EXACT_SLICE + 5, 16)):
        lin = nn.Linear(k, n)
        x = torch.randn(9, k)
        worst = nn.Linear(k, n, bias=False)
        worst.weight.data.fill_(-1.0)
        for layer, inp in ((lin, x), (worst, torch.ones(3, k))):
            with torch.inference_mode():
                a, b = Int8Linear(layer, "int_mm")(inp), Int8Linear(layer, "fp32")(inp)
            assert torch.equal(a, b)
    with torch.inference_mode():
        assert Int8Linear(worst, "fp32")(torch.ones(1, worst.in_features))[0, 0].item() == -worst.in_features


def test_int8_zero_row_and_3d_input():
    lin = nn.Linear(32, 8)
    layer = Int8Linear(lin, "fp32")
    x = torch.randn(2, 5, 32)
    x[1, 2] = 0.0
    with torch.inference_mode():
        y = layer(x)
        assert y.shape == (2, 5, 8)
        assert torch.equal(y[1, 2], lin.bias.detach())  # an all-zero row: exactly the bias


# -- bf16 linears --------------------------------------------------------------------------------------------
def test_bf16_linear_rows_are_independent():
    """Plain bf16 `nn.Linear` (what runs where oneDNN has no bf16 linear) is row-independent."""
    torch.manual_seed(2)
    lin = nn.Linear(576, 1536).to(torch.bfloat16)
    assert rows_alone_equal_batched(lin, torch.randn(40, 576, dtype=torch.bfloat16))


@pytest.mark.skipif(not bf16_packing_available(),
                    reason="oneDNN bf16 linears need AVX512BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")
def test_bf16_packed_linear_rows_are_independent():
    torch.manual_seed(3)
    lin = nn.Linear(576, 1536).to(torch.bfloat16)
    packed = PackedLinear(lin)
    x = torch.randn(40, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert (packed(x).float() - lin(x).float()).abs().max() < 0.1
    assert rows_alone_equal_batched(packed, x)


@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (4864, 896)])
def test_float32_packed_linear_rows_are_independent(shape):
    """On a Xeon (AVX-512, model 207) oneDNN's float32 kernel gave a row alone other bits than the same row among
    others once a weight had 1,536 inputs or more (SmolLM2's down_proj): a step of one row and a batched step
    disagreed, and eight answers at once could differ from each asked alone."""
    torch.manual_seed(4)
    lin = nn.Linear(*shape)
    packed = PackedLinear(lin)
    x = torch.randn(40, shape[0])
    with torch.inference_mode():
        assert (packed(x) - lin(x)).abs().max() < 1e-3
    assert rows_alone_equal_batched(packed, x)


def test_onednn_stops_short_of_amx_unless_the_user_chose():
    """On a CPU with AMX, importing ragspec caps oneDNN at AVX-512 BF16 (its AMX kernels change a row's bits with
    the batch: the two tests above fail there without it); a value the user set is kept."""
    import subprocess
    import sys

    from ragspec.cpu_flags import cpu_flags

    if "amx_bf16" not in cpu_flags():
        pytest.skip("no AMX on this CPU: oneDNN is left as it is")
    code = "import os, ragspec; print(os.environ.get('ONEDNN_MAX_CPU_ISA'))"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "AVX512_CORE_BF16"
    env["ONEDNN_MAX_CPU_ISA"] = "DEFAULT"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DEFAULT"


# -- whole models ----------------------------------------------------------------------------------------------
def load(dtype: str):
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct", dtype=dtype)


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def smol(request):
    return request.param, *load(request.param)


@pytest.fixture(scope="module")
def cases(smol):
    _, model, tok = smol
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    return [(prompt, reference(model, prompt, 40, eos))
            for prompt in (chat_prompt(tok, PASSAGES[p], q) for q, p in QUESTIONS)]


def test_model_kernels(smol):
    dtype, model, _ = smol
    assert model.config._attn_implementation == "ragspec_exact"
    if dtype == "int8":
        assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 7 * model.config.num_hidden_layers
        assert isinstance(model.lm_head, PackedLinear)  # lm_head stays float32 (packed)
    else:
        assert next(model.parameters()).dtype == torch.bfloat16
        want = PackedLinear if bf16_packing_available() else nn.Linear
        assert type(model.model.layers[0].mlp.down_proj) is want


def test_logits_do_not_depend_on_batching(smol, cases):
    """A position's logits are the same bits in one forward over the whole sequence and decoding token by
    token over the cache: rows are independent in the linears, and attention (exact_attention) rounds float64
    to the same bits whatever the number of queries and keys."""
    from transformers import DynamicCache

    _, model, _ = smol
    prompt, ref = cases[1]
    seq = prompt + ref[:8]
    with torch.inference_mode():
        full = model(torch.tensor([seq])).logits[0, len(prompt) - 1 :]
        cache = DynamicCache(config=model.config)
        steps = [model(torch.tensor([prompt]), **cache_arg(model, cache), use_cache=True).logits[0, -1]]
        for t in ref[:8]:
            steps.append(model(torch.tensor([[t]]), **cache_arg(model, cache), use_cache=True).logits[0, -1])
    assert torch.equal(full, torch.stack(steps))


@pytest.mark.parametrize("drafter", [PromptLookupDrafter, SuffixDrafter], ids=["pld", "suffix"])
def test_greedy_matches_generate(smol, cases, drafter):
    _, model, tok = smol
    accepted = 0
    for prompt, ref in cases:
        gen = SpeculativeGenerator(model, tok, drafter=drafter(), max_new_tokens=40, budget=AdaptiveBudget(FLAT))
        text = gen.generate(prompt)
        assert gen.tokens == ref
        assert text == tok.decode(ref, skip_special_tokens=True)
        accepted += gen.stats.accepted_draft_tokens
    assert accepted > 0


# -- settings, keys, errors ------------------------------------------------------------------------------------
def test_cost_key_names_the_numerics(smol):
    """t(n) is cached per cost key: int8 (float32 parameters, packed lm_head) must not share float32's."""
    from ragspec.decoding.backends.transformers import TransformersBackend

    dtype, model, _ = smol
    key = TransformersBackend.cost_key(model)
    if dtype == "bfloat16":
        assert "-bfloat16-" in key
        return
    marker = runtime_of(model).int8
    runtime_of(model).int8 = None
    try:
        as_fp32 = TransformersBackend.cost_key(model)
    finally:
        runtime_of(model).int8 = marker
    assert "-float32-" in as_fp32 and key == f"{as_fp32}-int8-{marker}"
    model.config._attn_implementation = "sdpa"  # the attention kernel is named unless it is transformers' sdpa
    try:
        assert TransformersBackend.cost_key(model) == key.replace("-ragspec_exact", "")
    finally:
        model.config._attn_implementation = "ragspec_exact"
    assert "-packed-ragspec_exact-int8-" in key


def test_int8_is_cpu_only_and_bad_names_are_one_line():
    from ragspec.models.generator import load_generator, torch_dtype
    from ragspec.settings import GeneratorSettings

    assert GeneratorSettings(dtype="int8").dtype == "int8"
    with pytest.raises(RagspecError, match="CPU only"):
        load_generator("smollm2-135m-instruct", device="cuda", dtype="int8")
    with pytest.raises(RagspecError, match="not one of"):
        torch_dtype("int4", "generator")


def test_bad_int8_kernel_is_one_line(monkeypatch):
    from ragspec.runtime.int8_linear import int8_kernel

    monkeypatch.setenv("RAGSPEC_INT8_KERNEL", "fbgemm")
    with pytest.raises(RagspecError, match="RAGSPEC_INT8_KERNEL"):
        int8_kernel()


def test_emulated_dtypes_say_so(caplog):
    """Without native units, bf16 and int8 still load (emulated) and say, in one line each, that they are slow."""
    if native_bf16() and native_int8():
        pytest.skip("this CPU has native bf16 and int8: nothing to warn about")
    with caplog.at_level(logging.WARNING):
        if not native_bf16():
            load("bfloat16")
        if not native_int8():
            load("int8")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("bfloat16" in m and "emulated" in m for m in lines) or native_bf16()
    assert any("int8" in m and "no faster than float32" in m for m in lines) or native_int8()
