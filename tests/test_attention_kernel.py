"""attention_kernel.cpp's exact attention (dtype gguf's attention): close to a float64 reference, and a query row's
output the same bits wherever its keys sit in the cache and whatever else the call holds — the property that keeps
a draft tree's rows equal to plain greedy's one-token steps."""
from __future__ import annotations

import pytest
import torch

from ragspec.runtime.gguf_kernel import load_kernels

MIN = torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def ops():
    return load_kernels()


def reference(q, k, v, mask, scaling):
    """softmax(q·kᵀ·scaling + mask)·v in float64, grouped heads repeated; output [B, Q, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k64.transpose(2, 3) * scaling
    if mask.numel():
        scores = scores.masked_fill(mask.double() <= MIN, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v64).transpose(1, 2)


def causal(q_len: int, k_len: int) -> torch.Tensor:
    mask = torch.zeros(1, 1, q_len, k_len)
    mask[..., -q_len:] = torch.triu(torch.full((q_len, q_len), MIN), 1)
    return mask


@pytest.mark.parametrize("d", [64, 128, 40])  # 40: not a multiple of 16, the scalar dot products
@pytest.mark.parametrize("q_len,k_len", [(1, 300), (16, 1100), (5, 33), (9, 17)])
def test_close_to_float64(ops, d, q_len, k_len):
    g = torch.Generator().manual_seed(d + q_len)
    q = torch.randn(1, 14, q_len, d, generator=g) * 3
    k, v = torch.randn(1, 2, k_len, d, generator=g), torch.randn(1, 2, k_len, d, generator=g)
    for mask in (causal(q_len, k_len), torch.empty(0)):
        out = ops.exact_attention(q, k, v, mask, d**-0.5)
        torch.testing.assert_close(out.double(), reference(q, k, v, mask, d**-0.5), rtol=1e-5, atol=1e-5)
    # the cache's buffer views are read in place (rows of a longer buffer)
    kb, vb = torch.randn(1, 2, k_len + 20, d, generator=g), torch.randn(1, 2, k_len + 20, d, generator=g)
    mask = causal(q_len, k_len)
    out = ops.exact_attention(q, kb[:, :, :k_len], vb[:, :, :k_len], mask, d**-0.5)
    torch.testing.assert_close(out.double(), reference(q, kb[:, :, :k_len], vb[:, :, :k_len], mask, d**-0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_a_row_does_not_depend_on_where_its_keys_sit(ops, d):
    """A draft tree's row sees its prefix and its ancestors with hidden siblings between them; the same token
    decoded alone sees those keys side by side. Both, and the row inside a 16-row call, give the same bits."""
    g = torch.Generator().manual_seed(d)
    k_len = 203
    q = torch.randn(1, 14, 16, d, generator=g) * 3
    k, v = torch.randn(1, 2, k_len, d, generator=g), torch.randn(1, 2, k_len, d, generator=g)
    visible = torch.rand(16, k_len, generator=g) < 0.6
    visible[:, :150] = True  # the prefix, then a tree's scattered ancestors
    mask = torch.where(visible, 0.0, MIN)[None, None]
    tree = ops.exact_attention(q, k, v, mask, d**-0.5)
    for row in (0, 7, 15):
        keep = visible[row].nonzero().squeeze(1)
        alone = ops.exact_attention(q[:, :, row : row + 1], k[:, :, keep], v[:, :, keep], torch.empty(0), d**-0.5)
        assert torch.equal(alone[0, 0], tree[0, row])
        one = ops.exact_attention(q[:, :, row : row + 1], k, v, mask[:, :, row : row + 1], d**-0.5)
        assert torch.equal(one[0, 0], tree[0, row])


def test_fully_hidden_row_is_zero(ops):
    q, k, v = torch.randn(1, 4, 2, 64), torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    mask = torch.zeros(1, 1, 2, 20)
    mask[0, 0, 1] = MIN
    out = ops.exact_attention(q, k, v, mask, 0.125)
    assert torch.equal(out[0, 1], torch.zeros(4, 64)) and out[0, 0].abs().sum() > 0
