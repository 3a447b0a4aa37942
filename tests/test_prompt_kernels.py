"""The kernels that read prompt rows for dtype gguf's int8 prompt copy: `prompt_attention.cpp` (attention in
GEMM-shaped tiles) and `int8_rows.cpp` (the per-row int8 steps around `torch._int_mm` in one pass each).

What must hold: the attention is softmax(q·kᵀ·scale + mask)·v within float32 rounding, and a row's bits do not
depend on the rows or keys read with it (whole, in chunks behind a prefix, one row at a time, other rows hidden);
the one-pass int8 steps give exactly the bits of the PyTorch ops they replace (`int8_linear.quantize_rows` and the
product's scaling; SiLU as the GGUF kernels' MLP computes it)."""

from __future__ import annotations

import pytest
import torch

from ragspec.runtime.int8_linear import Int8Linear, quantize_rows

MIN = torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def ops():
    from ragspec.runtime.gguf_kernel import load_kernels

    return load_kernels()


def causal(rows: int, keys: int, past: int) -> torch.Tensor:
    """An additive mask: row i sees keys 0 .. past + i."""
    visible = torch.arange(keys)[None, :] <= past + torch.arange(rows)[:, None]
    return torch.zeros(1, 1, rows, keys).masked_fill_(~visible, MIN)


def reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = q.double() @ kk.transpose(2, 3) * scale + mask.double()
    return (torch.softmax(scores, -1) @ vv).transpose(1, 2).float()


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (12, 2, 128), (4, 2, 48), (3, 3, 16)])
def test_prompt_attention_is_attention_and_row_independent(ops, heads, kv_heads, dim):
    torch.manual_seed(0)
    n, scale = 150, dim ** -0.5
    q, k, v = torch.randn(1, heads, n, dim), torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    whole = ops.prompt_attention(q, k, v, causal(n, n, 0), scale)
    assert whole.shape == (1, n, heads, dim)
    assert (whole - reference(q, k, v, causal(n, n, 0), scale)).abs().max() < 1e-5
    # in two chunks, the second behind the first's keys
    first = ops.prompt_attention(q[:, :, :61], k[:, :, :61], v[:, :, :61], causal(61, 61, 0), scale)
    second = ops.prompt_attention(q[:, :, 61:], k, v, causal(n - 61, n, 61), scale)
    assert torch.equal(torch.cat([first, second], 1), whole)
    # one row at a time, over only the keys it sees
    for i in (0, 1, 15, 16, 17, 99, n - 1):
        row = ops.prompt_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], causal(1, i + 1, i), scale)
        assert torch.equal(row[:, 0], whole[:, i])


def test_prompt_attention_masks_and_hidden_rows(ops):
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 20, 32), torch.randn(1, 2, 20, 32), torch.randn(1, 2, 20, 32)
    open_rows = ops.prompt_attention(q, k, v, torch.empty(0), 0.2)  # no mask: every key seen
    assert (open_rows - reference(q, k, v, torch.zeros(1, 1, 20, 20), 0.2)).abs().max() < 1e-5
    mask = causal(20, 20, 0)
    mask[0, 0, 5] = MIN  # a row that sees nothing (padding): zeros, as the step kernel gives
    out = ops.prompt_attention(q, k, v, mask, 0.2)
    assert torch.equal(out[:, 5], torch.zeros_like(out[:, 5]))
    step = ops.exact_attention(q, k, v, mask, 0.2)
    assert torch.equal(step[:, 5], out[:, 5])
    keep = torch.ones(20, dtype=torch.bool)
    keep[5] = False
    assert (out[:, keep] - step[:, keep]).abs().max() < 1e-5  # other arithmetic, the same attention


@pytest.mark.parametrize("rows,cols", [(1, 896), (37, 896), (300, 4864), (5, 23)])
def test_one_pass_int8_steps_are_the_same_bits(ops, rows, cols):
    torch.manual_seed(2)
    x = torch.randn(rows, cols) * torch.rand(rows, 1) * 10
    x[0] = 0.0  # an all-zero row quantizes to zeros
    q, scale = ops.quantize_rows_int8(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref.to(torch.int8)) and torch.equal(scale, scale_ref)
    w = torch.randint(-127, 128, (64, cols), dtype=torch.int8)
    ws, bias = torch.rand(64), torch.randn(64)
    torch_steps = Int8Linear.from_quantized(w, ws, bias, kernel="int_mm")
    one_pass = Int8Linear.from_quantized(w, ws, bias, kernel="int_mm", ops=ops)
    assert torch.equal(torch_steps(x), one_pass(x))


def test_halves_round_to_even(ops):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 100.5] + [0.0] * 9])
    q, _ = ops.quantize_rows_int8(x)
    assert q.tolist() == quantize_rows(x)[0].to(torch.int8).tolist() == [[127, 0, 2, 2, 0, -2, 4, 100] + [0] * 9]


def test_glu_is_scale_silu_and_quantize(ops):
    torch.manual_seed(3)
    m, n = 33, 4864 + 7
    gate, up = (torch.randint(-2 ** 20, 2 ** 20, (m, n), dtype=torch.int32) for _ in range(2))
    rows, gs, us = torch.rand(m, 1) * 1e-4, torch.rand(1, n) * 1e-3, torch.rand(1, n) * 1e-3
    none = torch.empty(0)
    h = ops.silu_mul(ops.scale_int32(gate, rows, gs, none), ops.scale_int32(up, rows, us, none))
    q, scale = ops.int8_glu(gate, up, rows, gs, us)
    q_ref, scale_ref = ops.quantize_rows_int8(h)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
