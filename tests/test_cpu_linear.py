"""Pre-packed oneDNN linears compute what `nn.Linear` computes: same logits (to float rounding), same greedy text."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ragspec.runtime.cpu_linear import PackedLinear, pack_linears, packing_available
from ragspec.runtime.model_runtime import runtime_of

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN linear ops")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        assert torch.allclose(packed(x), lin(x), atol=1e-5, rtol=1e-5)
        assert torch.allclose(packed(x[0]), lin(x[0]), atol=1e-5, rtol=1e-5)  # 2-D input too
    assert torch.equal(packed.weight, lin.weight.detach())


def test_packed_model_matches_plain_model(monkeypatch):
    from ragspec.models.generator import load_generator

    monkeypatch.setenv("RAGSPEC_PACKED_LINEAR", "0")
    plain, tok = load_generator("smollm2-135m-instruct")
    assert not getattr(runtime_of(plain), "packed_linears", 0)
    monkeypatch.setenv("RAGSPEC_PACKED_LINEAR", "1")
    packed, _ = load_generator("smollm2-135m-instruct")
    assert runtime_of(packed).packed_linears > 0
    assert not any(type(m) is nn.Linear for m in packed.modules())
    messages = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        a = plain(input_ids=ids).logits
        b = packed(input_ids=ids).logits
        assert (a - b).abs().max().item() < 1e-3
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        out_a = plain.generate(ids, max_new_tokens=24, do_sample=False)
        out_b = packed.generate(ids, max_new_tokens=24, do_sample=False)
    assert out_a.tolist() == out_b.tolist()


def test_pack_linears_is_a_no_op_when_disabled(monkeypatch):
    monkeypatch.setenv("RAGSPEC_PACKED_LINEAR", "0")
    model = nn.Sequential(nn.Linear(4, 4))
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear
