"""dtype gguf (`runtime/gguf_linear.py`, `runtime/gguf_kernel.cpp`): the shipped GGUF's blocks run as integers.

What is checked: the block mapping reproduces `gguf`'s own de-quantization exactly (Q4_0/Q4_1/Q5_0/Q8_0, and Q4_K
and Q6_K with their sub-scales as stored); the kernel computes the de-quantized weight
times the int8-quantized activations (float rounding only); a row's output is bit-identical alone or inside any
batch; and greedy draft-and-verify on SmolLM2 (Q4_1 linears, a Q8_0 tied head) equals plain greedy of the same
model for every drafter that runs on transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt, reference

from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import RagspecError
from ragspec.models.registry import installed, lookup
from ragspec.runtime.gguf_formats import GROUP, decode_blocks, pack, requantize_s8, unpack
from ragspec.runtime.gguf_linear import PROMPT_ROWS, GGUFLinear
from ragspec.runtime.model_runtime import runtime_of

FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"


def quantized_input(x: torch.Tensor, span: int = GROUP) -> torch.Tensor:
    """The activations as the kernel sees them: int8 per row and group of 32 (256 for u4k8), de-quantized."""
    g = x.reshape(x.shape[0], -1, span)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(g * (127.0 / amax)), torch.zeros_like(g)).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


PACKED = ["u4", "u5", "s8", "u6", "u4k"]
FMTS = PACKED + ["u4k8"]  # u4k8: u4k's weights, one activation scale per 256 inputs (llama.cpp's Q8_K rule)
TOP = {"u4": 16, "u5": 32, "u6": 64, "u4k": 16}
SUPER = ("u6", "u4k", "u4k8")  # K-quants: super-blocks of 256 inputs


def random_linear(fmt: str, rows: int, cols: int, seed: int = 0, bias: bool = False,
                  rule: bool | None = False, top: bool = False) -> GGUFLinear:
    """`fmt` "u4k8": u4k weights on the Q8_K rule; "u4k" on the group rule, or with `rule` None as the machine's
    default decides. `top`: every unsigned weight at its format's largest value (the integer sums' worst case)."""
    rng = np.random.default_rng(seed)
    g = cols // GROUP
    superblock = fmt == "u4k8"
    fmt = "u4k" if superblock else fmt
    if fmt == "s8":
        q, d, m = requantize_s8((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
    elif fmt == "u4k":  # Q4_K: D, Dmin per 256 inputs, 6-bit scale and min per 32
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        d = (rng.random((rows, g // 8, 2)) * 0.001).astype(np.float32)
        m = rng.integers(0, 64, (rows, g, 2)).astype(np.uint8)
    elif fmt == "u6":  # Q6_K: D per 256 inputs, an int8 scale per 16
        q = rng.integers(0, 64, (rows, cols)).astype(np.uint8)
        d = (rng.random((rows, g // 8)) * 0.001).astype(np.float32)
        m = rng.integers(-128, 128, (rows, g, 2)).astype(np.int8)
    else:
        q = rng.integers(0, TOP[fmt], (rows, cols)).astype(np.uint8)
        d = (rng.random((rows, g)) * 0.01).astype(np.float32)
        m = (-rng.random((rows, g)) * 0.05).astype(np.float32)
    if top and fmt != "s8":
        q = np.full_like(q, TOP[fmt] - 1)
    b = torch.randn(rows) if bias else None
    return GGUFLinear(fmt, q, d, m, b, prompt_copy=False, superblock=True if superblock else rule)


@pytest.mark.parametrize("fmt", PACKED)
def test_pack_round_trips(fmt):
    rng = np.random.default_rng(1)
    q = (rng.integers(-127, 128, (20, 64)).astype(np.int8) if fmt == "s8"
         else rng.integers(0, TOP[fmt], (20, 64)).astype(np.uint8))
    w, wh = pack(fmt, q)
    assert np.array_equal(unpack(fmt, w, wh, 20).numpy(), q.astype(np.int16))


@pytest.mark.parametrize("fmt", PACKED)
def test_int8_copy_is_made_with_the_torch_reference_bits(fmt):
    """`int8_copy.cpp` (the prompt copy made at load) gives `gguf_formats.int8_copy`'s int8 values and scales
    exactly, on 203 outputs (not a multiple of the kernel's 8) and with an all-zero row."""
    from ragspec.runtime.gguf_formats import FORMATS, int8_copy

    cols = 768 if fmt in SUPER else 640
    lin = random_linear(fmt, 203, cols, seed=3)
    if fmt in ("u4", "u5", "s8"):
        lin.d[-1, :, 2] = 0  # output 202's scales: a row of zeros
        if lin.mn.numel():
            lin.mn[-1, :, 2] = 0
    q, scale = int8_copy(lin.fmt, lin.w, lin.wh, lin.d, lin.mn, 203, cols)
    got_q, got_scale = lin.ops.int8_copy(lin.w, lin.wh, lin.d, lin.mn, FORMATS[fmt], 203, cols)
    assert got_q.dtype == torch.int8 and torch.equal(got_q, q) and torch.equal(got_scale, scale)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_equals_dequantized_reference(fmt):
    """y = quantized x · Wᵀ within float rounding (the int8 activation error is in the reference too)."""
    cols = 768 if fmt in SUPER else 640  # K-quants come in super-blocks of 256 inputs
    lin = random_linear(fmt, 200, cols, bias=True)  # 200 outputs: not a multiple of the kernel's 8
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(0))  # the same input whatever ran before
    with torch.inference_mode():
        y = lin(x)
        ref = quantized_input(x, 256 if fmt == "u4k8" else GROUP) @ lin.dequantize().t() + lin.bias
    assert y.shape == (9, 200)
    assert ((y - ref).abs().max() / ref.abs().max()) < 1e-5
    # and the activation quantization is what makes it differ from the float product: about 1 %
    exact = x @ lin.dequantize().t() + lin.bias
    assert ((y - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.03


@pytest.mark.parametrize("fmt", FMTS)
def test_rows_are_independent(fmt):
    """Every row is the same bits alone, in a 16-row tree, at any place in any batch (across the kernel's tiles
    of rows, and its one-block and two-block (512-bit) passes: 136 outputs are 17 blocks, the last one alone)."""
    lin = random_linear(fmt, 136, 512, seed=2)
    x = torch.randn(37, 512)
    with torch.inference_mode():
        full = lin(x)
        for m in (1, 2, 3, 5, 7, 8, 16, 17, 33):
            assert torch.equal(lin(x[:m]), full[:m])
        for i in (0, 5, 16, 36):
            assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])
        assert torch.equal(lin(x[:16].reshape(1, 16, 512)), full[:16].reshape(1, 16, 136))  # 3-D input


def test_amx_tiles_give_the_same_bits():
    """Where the CPU has AMX, tiles of 16 rows take each group's integer sums from the tile unit and then run the
    512-bit pass's float operations in its order: the same bits as the VNNI/AVX path, for every format, across
    full and partial tiles, an odd last block, and inside the fused MLP."""
    from ragspec.runtime.gguf_kernel import load_kernels

    ops = load_kernels()
    if not ops.amx(-1):
        pytest.skip("no AMX on this CPU (or not granted by the kernel)")
    cases = [(random_linear(fmt, rows, 768 if fmt in SUPER else 640, seed=5), rows)
             for fmt in FMTS for rows in (200, 56, 8)]
    mlps = [[random_linear(f, n, k, seed=s) for f, n, k, s in parts]
            for parts in ((("u4k", 256, 256, 1), ("u5", 256, 256, 2), ("u6", 48, 256, 3)),
                          (("u4k8", 256, 256, 1), ("u4k8", 256, 256, 2), ("u4k", 48, 256, 3)))]
    try:
        with torch.inference_mode():
            for m in (15, 16, 17, 31, 32, 48, 100, 300):
                for lin, _ in cases:
                    x = torch.randn(m, lin.in_features, generator=torch.Generator().manual_seed(m)) * 2
                    ops.amx(1)
                    tiles = lin(x)
                    ops.amx(0)
                    assert torch.equal(tiles, lin(x)), (lin.fmt, lin.out_features, m)
                x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 3
                for gate, up, down in mlps:
                    args = [a for lin in (gate, up, down) for a in (*lin.kernel_args()[:4], lin.code)]
                    ops.amx(1)
                    tiles = ops.mlp(x, *args, 256, 48)
                    ops.amx(0)
                    assert torch.equal(tiles, ops.mlp(x, *args, 256, 48)), (m, gate.code)
    finally:
        ops.amx(1)


def test_paired_integer_sums_give_the_same_bits():
    """On AVX2 without VNNI the kernel adds two (6-bit weights) or four (at most 5 bits) chunks' u8 x s8 products
    in int16 before widening to int32: exact while a lane's sum stays under 2^15, so the same bits as one chunk per
    widening, shown at the worst case too (every weight at its top value, every activation at +-127)."""
    from ragspec.runtime.gguf_kernel import load_kernels

    ops = load_kernels()
    if not ops.paired(-1):
        pytest.skip("this build widens every chunk (VNNI, or no AVX2)")
    try:
        with torch.inference_mode():
            for fmt in FMTS:
                cols = 768 if fmt in SUPER else 640
                for top in (False, True):
                    lin = random_linear(fmt, 136, cols, seed=6, top=top)
                    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(3))
                    x[:4] = torch.tensor([[1.0], [-1.0], [3.0], [-0.5]])  # rows whose every activation is +-127
                    out = []
                    for mode in (0, 1, 2):
                        ops.paired(mode)
                        out.append(lin(x))
                    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2]), (fmt, top)
    finally:
        ops.paired(2)


def test_blocks_unpacked_once_give_the_same_bits():
    """Without AVX-512 the kernel unpacks u5 and u6 blocks once per call for every tile of rows (from two tiles):
    the same bytes as unpacked tile by tile, so the same bits, whole and in its fused MLP."""
    from ragspec.runtime.gguf_kernel import load_kernels

    ops = load_kernels()
    if not ops.unpacked(-1):
        pytest.skip("this build unpacks per tile (AVX-512 byte masks, or no AVX2)")
    try:
        with torch.inference_mode():
            for fmt in ("u5", "u6"):
                lin = random_linear(fmt, 136, 768, seed=7, top=fmt == "u6")
                x = torch.randn(37, 768, generator=torch.Generator().manual_seed(4))
                out = []
                for mode in (0, 1):
                    ops.unpacked(mode)
                    out.append(lin(x))
                assert torch.equal(out[0], out[1]), fmt
                assert all(torch.equal(lin(x[i:i + 1]), out[1][i:i + 1]) for i in (0, 8, 36))
    finally:
        ops.unpacked(1)


def test_zero_rows_and_bad_shapes():
    lin = random_linear("u4", 16, 64)
    with torch.inference_mode():
        assert torch.equal(lin(torch.zeros(3, 64)), torch.zeros(3, 16))
    with pytest.raises(RagspecError, match="multiple of 32"):
        decode_blocks(np.zeros(10, np.uint8), "Q8_0", 1, 40)


def _tensors(name: str, types: set[str]):
    from gguf import GGUFReader

    from ragspec.models.gguf_cache import gguf_path

    reader = GGUFReader(str(gguf_path(lookup(name, "generator"))))
    seen = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in types and kind not in seen and len(t.shape) == 2:
            seen[kind] = t
    return seen


def _check_mapping(t):
    """decode_blocks, packed and de-quantized as the kernel stores it, against gguf's de-quantization."""
    from gguf.quants import dequantize

    cols, rows = (int(v) for v in t.shape)
    rows = min(rows, 64)  # the first 64 output rows are plenty; the block format is the same everywhere
    raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:rows]
    want = dequantize(raw, t.tensor_type).reshape(rows, cols).astype(np.float32)
    fmt, q, d, m = decode_blocks(raw, t.tensor_type.name, rows, cols)
    got = GGUFLinear(fmt, q, d, m, None, t.tensor_type.name, prompt_copy=False).dequantize().numpy()
    return fmt, got, want, d, m


def test_q4_1_and_q8_0_map_exactly():
    """SmolLM2's Q4_1 linears and Q8_0 embedding (its tied head): fp16 scales as in the file, so exact."""
    found = _tensors(SMOL, {"Q4_1", "Q8_0"})
    assert set(found) == {"Q4_1", "Q8_0"}
    for kind, t in found.items():
        fmt, got, want, _, _ = _check_mapping(t)
        assert fmt == {"Q4_1": "u4", "Q8_0": "s8"}[kind]
        assert np.array_equal(got, want), kind


@pytest.mark.skipif(not installed(QWEN), reason="the 0.5B's weight packages are not installed")
def test_qwen_blocks_map_as_documented():
    """Q5_0, Q4_K and Q6_K exactly: the K-quants keep their sub-scales as stored, D·sc is exact in float32."""
    found = _tensors(QWEN, {"Q5_0", "Q4_K", "Q6_K"})
    assert set(found) == {"Q5_0", "Q4_K", "Q6_K"}
    for kind, fmt in (("Q5_0", "u5"), ("Q4_K", "u4k"), ("Q6_K", "u6")):
        got_fmt, got, want, _, _ = _check_mapping(found[kind])
        assert got_fmt == fmt and np.array_equal(got, want), kind


# -- the whole model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_gguf():
    from ragspec.models.generator import load_generator

    return load_generator(SMOL, dtype="gguf")


@pytest.fixture(scope="module")
def gguf_cases(smol_gguf):
    model, tok = smol_gguf
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    out = []
    for q, p in QUESTIONS:
        prompt = chat_prompt(tok, PASSAGES[p], q)
        assert len(prompt) <= PROMPT_ROWS
        out.append((prompt, reference(model, prompt, 40, eos)))
    return out


def test_every_linear_runs_the_gguf_blocks(smol_gguf):
    model, _ = smol_gguf
    layers = model.config.num_hidden_layers
    kinds = runtime_of(model).gguf
    assert len(kinds) == 7 * layers + 1 and kinds["lm_head"] == "Q8_0"
    assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == 7 * layers + 1
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.config._attn_implementation == "ragspec_exact"


def test_fused_mlp_and_norm(smol_gguf):
    """Every MLP and RMSNorm runs as one kernel call; each equals the modules' own formula within float (and
    int8 re-quantization) rounding, and a row is the same bits alone or in any batch."""
    from ragspec.runtime.fused_layers import FusedMLP, FusedRMSNorm

    model, _ = smol_gguf
    layers = model.config.num_hidden_layers
    mlps = [m for m in model.modules() if isinstance(m, FusedMLP)]
    norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(mlps) == layers and len(norms) == 2 * layers + 1
    mlp, norm = mlps[3], norms[3]
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y, n = mlp(x), norm(x)
        ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-3
        ref_n = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
        assert ((n - ref_n).abs().max() / ref_n.abs().max()) < 1e-6
        for m in (1, 2, 5, 16, 33):
            assert torch.equal(mlp(x[:m]), y[:m]) and torch.equal(norm(x[:m]), n[:m])
        assert torch.equal(mlp(x[5:6]), y[5:6]) and torch.equal(norm(x[:16].reshape(2, 8, -1)), n[:16].reshape(2, 8, -1))


@pytest.mark.parametrize("gate_fmt, inter", [("u5", 96), ("u6", 256), ("u4k", 256), ("u4", 32), ("u4k8", 256)])
def test_fused_mlp_equals_its_parts(gate_fmt, inter):
    """The MLP kernel computes gate and up 32 outputs at a time and quantizes their product for down while it is
    in cache: bit for bit what gate, up, silu·mul and down give as separate calls, across its 64-row chunks."""
    from ragspec.runtime.gguf_kernel import load_kernels

    ops = load_kernels()
    gate = random_linear(gate_fmt, inter, 256, seed=1)
    up = random_linear("u4k8" if gate_fmt == "u4k8" else "u5", inter, 256, seed=2)  # one rule for x
    down = random_linear("u6" if inter % 256 == 0 else "u4", 48, inter, seed=3)
    x = torch.randn(150, 256, generator=torch.Generator().manual_seed(0)) * 3
    with torch.inference_mode():
        for m in (1, 9, 64, 150):
            h = ops.silu_mul(gate(x[:m]), up(x[:m]))
            g, u, d = gate.kernel_args(), up.kernel_args(), down.kernel_args()
            y = ops.mlp(x[:m], *g[:4], gate.code, *u[:4], up.code, *d[:4], down.code, inter, 48)
            assert torch.equal(y, down(h)), m


@pytest.mark.parametrize("method", ["none", "pld", "trie", "suffix", "lookahead", "ngrammys", "auto",
                                    "pldplus-h", "pldplus-a"])
def test_greedy_matches_plain_greedy(smol_gguf, gguf_cases, method):
    model, tok = smol_gguf
    accepted = 0
    for prompt, ref in gguf_cases:
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=40,
                                   budget=AdaptiveBudget(FLAT))
        gen.generate(prompt)
        assert gen.tokens == ref, method
        accepted += gen.stats.accepted_draft_tokens
    assert accepted > 0 or method == "none"


def test_long_prompt_still_matches(smol_gguf):
    """A prompt longer than PROMPT_ROWS (the bf16 copy's threshold when it is turned on) is read by the integer
    kernel by default; plain greedy and drafting agree token for token."""
    model, tok = smol_gguf
    passage = " ".join(PASSAGES * 6)
    prompt = chat_prompt(tok, passage, QUESTIONS[1][0])
    assert len(prompt) > PROMPT_ROWS
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    ref = reference(model, prompt, 24, eos)
    gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix"), max_new_tokens=24,
                               budget=AdaptiveBudget(FLAT))
    gen.generate(prompt)
    assert gen.tokens == ref


def test_earlier_prompts_are_reused_exactly(smol_gguf):
    """Every ask reads its prompt from where its longest shared prefix with an earlier prompt ends (the head
    for other sources, past the sources for the same sources sent in the same order, all but the last token for
    the same prompt), and answers exactly as with every prompt read whole."""
    from ragspec.decoding.prefix_cache import common_prefix
    from ragspec.pipeline import Pipeline

    model, tok = smol_gguf
    spec = {"generator": {"model": SMOL, "max_new_tokens": 24}, "drafting": {"method": "suffix"},
            "prompt": {"relevance_floor": "off", "source_tokens": "off"}}
    reuse, whole = (Pipeline(spec, model=model, tokenizer=tok) for _ in range(2))
    whole._prompts = False  # as on a model whose prompt rows are not independent
    (q0, _), (q1, _) = QUESTIONS[:2]
    a0, a1 = PASSAGES[:2]
    asked = [(q0, [a0]), (q1, [a1]), (q1, [a0]), (q0, [a0, a1]), (q0, [a0])]
    prompts = []
    for i, (q, docs) in enumerate(asked):
        ids = reuse.prepare(q, documents=docs).built.ids
        a, b = reuse.ask(q, documents=docs), whole.ask(q, documents=docs)
        assert a.text == b.text and b.stats.prefix_reused_tokens == 0
        shared = max([common_prefix(ids, p) for p in prompts] + [0])
        assert a.stats.prefix_reused_tokens == min(shared, len(ids) - 1), i
        prompts.append(ids)
    head = common_prefix(prompts[0], prompts[1])
    assert tok.decode(prompts[0][:head]).rstrip().endswith("Sources:") or head > 20
    assert common_prefix(prompts[2], prompts[0]) > head + 20  # past the first source, sent again
    assert reuse._prompts.tokens() < sum(len(p) for p in prompts)  # shared runs stored once
    assert reuse.prompt_cache_bytes == reuse._prompts.nbytes > 0 and whole.prompt_cache_bytes == 0


def test_prompts_assembled_from_the_source_cache_stay_out_of_the_tree(smol_gguf, monkeypatch, tmp_path):
    """A prompt assembled from reused source pieces is not a whole prefill's KV: with the source cache on, the
    tree of earlier prompts is neither read nor filled, so its answers never depend on it."""
    from ragspec.pipeline import Pipeline

    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path))
    model, tok = smol_gguf
    spec = {"generator": {"model": SMOL, "max_new_tokens": 8, "source_cache": "on"}, "drafting": {"method": "suffix"},
            "prompt": {"relevance_floor": "off", "source_tokens": "off"}}
    pipe = Pipeline(spec, model=model, tokenizer=tok)
    (q0, _), (q1, _) = QUESTIONS[:2]
    first, second = (pipe.ask(q, documents=[PASSAGES[0]]) for q in (q0, q1))
    assert not first.stats.cache_note and second.stats.cache_reused_tokens > 0
    assert second.stats.prefix_reused_tokens == 0 and not pipe._prompts  # never made


def test_gguf_is_cpu_only_and_named_in_the_cost_key(smol_gguf):
    from ragspec.decoding.backends.transformers import TransformersBackend
    from ragspec.models.generator import load_generator
    from ragspec.settings import GeneratorSettings

    model, _ = smol_gguf
    from ragspec.runtime.gguf_kernel import source_digest

    assert TransformersBackend.cost_key(model).endswith(f"-gguf-{source_digest()}-step")  # another build costs otherwise
    assert GeneratorSettings(dtype="gguf").dtype == "gguf"
    with pytest.raises(RagspecError, match="CPU only"):
        load_generator(SMOL, device="cuda", dtype="gguf")
    with pytest.raises(RagspecError, match=r"embedded model or a local \.gguf"):
        load_generator("/nonexistent/model", dtype="gguf")


def test_logits_follow_the_float_model(smol_gguf):
    """The blocks are laid out right (Llama's q/k rows un-permuted as transformers does): the GGUF model's logits
    track the de-quantized float32 model's (measured: 98 % same top-1, cosine ≥ 0.99 on every position)."""
    from ragspec.models.generator import load_generator

    model, tok = smol_gguf
    ref, _ = load_generator(SMOL, dtype="float32")
    prompt = chat_prompt(tok, PASSAGES[0], QUESTIONS[1][0])
    with torch.inference_mode():
        a, b = model(torch.tensor([prompt])).logits[0], ref(torch.tensor([prompt])).logits[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.97


def test_q8k_rule_is_on_where_amx_runs_and_kept_where_the_fused_mlp_can_run_it(monkeypatch):
    """Q4_K linears (only) take the Q8_K activation rule where the kernels drive AMX tiles, or as
    RAGSPEC_GGUF_Q8K=0/1 says; the fused MLP quantizes x once for gate and up, so it keeps the rule only where both
    take it, and its down (input quantized a group at a time) on the group rule."""
    from ragspec.runtime.fused_layers import FusedMLP
    from ragspec.runtime.gguf_formats import FORMATS, SUPERBLOCK
    from ragspec.runtime.gguf_kernel import amx_expected
    from ragspec.runtime.gguf_linear import superblock_activations

    monkeypatch.delenv("RAGSPEC_GGUF_Q8K", raising=False)
    assert random_linear("u4k", 16, 256, rule=None).code == (SUPERBLOCK if amx_expected() else FORMATS["u4k"])
    monkeypatch.setenv("RAGSPEC_GGUF_AMX", "0")
    assert not amx_expected() and not superblock_activations()
    monkeypatch.setenv("RAGSPEC_GGUF_Q8K", "0")
    monkeypatch.delenv("RAGSPEC_GGUF_AMX")
    assert random_linear("u4k", 16, 256, rule=None).code == FORMATS["u4k"]
    monkeypatch.setenv("RAGSPEC_GGUF_Q8K", "1")
    assert random_linear("u4k", 16, 256, rule=None).code == SUPERBLOCK
    assert random_linear("u5", 16, 256, rule=None).code == FORMATS["u5"]

    def mlp(gate, up, down):
        m = torch.nn.Module()
        m.gate_proj, m.up_proj, m.down_proj = (random_linear(f, n, k, seed=s, rule=None) for f, n, k, s in
                                               ((gate, 256, 256, 1), (up, 256, 256, 2), (down, 48, 256, 3)))
        m.act_fn = torch.nn.functional.silu
        return FusedMLP(m)

    both = mlp("u4k", "u4k", "u4k")
    assert (both.gate_proj.code, both.up_proj.code, both.down_proj.code) == (SUPERBLOCK, SUPERBLOCK, FORMATS["u4k"])
    mixed = mlp("u4k", "u5", "u6")
    assert (mixed.gate_proj.code, mixed.up_proj.code) == (FORMATS["u4k"], FORMATS["u5"])
    from ragspec.runtime.gguf_linear import kernels_key

    assert kernels_key(both).endswith("-q8k") and not kernels_key(mixed).endswith("-q8k")  # t(n) measured apart
    x = torch.randn(5, 256)
    with torch.inference_mode():
        ref = both.down_proj(torch.nn.functional.silu(both.gate_proj(x)) * both.up_proj(x))
        assert ((both(x) - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-3


def test_packing_is_kept_read_back_exactly_and_packed_again_when_damaged(tmp_path, monkeypatch, caplog):
    """The packed blocks are written once and read back as the same tensors; a cut file is deleted and packed
    again, and a changed GGUF (its modification time) takes a new packing and the old one goes."""
    import os
    import shutil

    from ragspec.models.generator import generator_gguf
    from ragspec.runtime import gguf_blocks

    src = tmp_path / "smol.gguf"
    shutil.copy(generator_gguf(SMOL), src)  # the file as installed; RAGSPEC_HOME moved below
    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path / "home"))
    arch, fresh = gguf_blocks._pack(src, 9, 3)  # SmolLM2: 9 query heads, 3 key/value heads
    path = gguf_blocks.blocks_path(src, 9, 3)
    assert not path.exists()

    def same(got):
        assert got[0] == arch == "llama" and set(got[1]) == set(fresh)
        for name, b in fresh.items():
            c = got[1][name]
            assert (c.gguf_type, c.fmt, c.rows, c.cols) == (b.gguf_type, b.fmt, b.rows, b.cols)
            assert all(torch.equal(getattr(c, p), getattr(b, p)) for p in gguf_blocks.PARTS), name

    same(gguf_blocks.packed_blocks(src, 9, 3))  # packed and kept
    assert path.is_file() and len(fresh) == 7 * 30 + 1  # 30 layers of 7 linears and the tied head
    same(gguf_blocks.packed_blocks(src, 9, 3))  # read back
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    same(gguf_blocks.packed_blocks(src, 9, 3))
    assert "did not read back" in caplog.text and path.stat().st_size > 0
    assert gguf_blocks.blocks_path(src, 8, 3) != path  # other heads: another un-permutation of Llama's q, k rows
    os.utime(src, ns=(1, 1))
    same(gguf_blocks.packed_blocks(src, 9, 3))
    assert not path.exists() and gguf_blocks.blocks_path(src, 9, 3).is_file()


def test_the_tensor_table_is_read_as_gguf_reads_it():
    """`gguf_blocks.read_tensors` (metadata skipped) finds the tensors, types, shapes and bytes `GGUFReader` does."""
    from gguf import GGUFReader

    from ragspec.models.generator import generator_gguf
    from ragspec.runtime.gguf_blocks import read_tensors

    path = generator_gguf(SMOL)
    arch, ours = read_tensors(path)
    ref = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert arch == "llama" and set(ours) == set(ref)
    for name, t in ours.items():
        r = ref[name]
        assert (t.type_name, t.shape) == (r.tensor_type.name, tuple(int(n) for n in r.shape)), name
        assert np.array_equal(t.data, np.asarray(r.data).view(np.uint8).reshape(-1)), name
    with pytest.raises(RagspecError, match="not a GGUF"):
        read_tensors(__file__)


def test_a_header_cut_short_is_told_wherever_it_ends():
    """`parse_header` over a GGUF's first bytes: cut inside the vocabulary (skipped by lengths alone) or inside the
    tensor table, it raises struct.error (which `GGUFSource.parsed` reports as one line); whole, the table."""
    import struct

    from ragspec.models.generator import generator_gguf
    from ragspec.runtime.gguf_file import parse_header

    with open(generator_gguf(SMOL), "rb") as f:
        head = f.read(8 << 20)
    meta, infos, start = parse_header(head)
    assert meta["general.architecture"] == "llama" and len(infos) > 0
    for cut in (100_000, start // 2, start - 40):
        with pytest.raises(struct.error):
            parse_header(head[:cut])
