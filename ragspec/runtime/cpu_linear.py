"""Pre-packed oneDNN linears for CPU inference: a flat verify cost for small batches of tokens.

PyTorch's CPU `F.linear` goes to MKL sgemm, which repacks the weight on every call and, on CPUs it does not
tune for (AMD), runs a few-row GEMM at about one GEMV per row: t(2) ≈ 2·t(1) for Qwen2.5-0.5B's 152k-row
lm_head. Speculative decoding lives on the cost of checking k tokens versus one, so that curve decides
whether drafting pays. oneDNN with the weight reordered once into its blocked layout reads each weight once
per call whatever the row count (measured on 2 AMD EPYC cores, lm_head 896→151936: M=1 22 ms, M=16 46 ms,
versus 36 ms and 140 ms through MKL).

`pack_linears(model)` swaps every `nn.Linear` of a CPU model in place, so everything that runs the model —
HF `generate` (our vanilla baseline) included — uses the same kernels and computes the same function (up to
float summation order). Tied weights (lm_head = embed_tokens) are packed as a copy; the embedding table
stays as it is.

bfloat16 models are packed the same way where oneDNN has bf16 linears (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT;
native bf16 dot products, AVX512_BF16 or AMX, make them fast); elsewhere they keep plain bf16 `nn.Linear`s.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    """oneDNN is built in and the ops we need exist (they are private PyTorch ops, so check, never assume)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def bf16_packing_available() -> bool:
    """oneDNN reorders and runs bf16 linear weights on this CPU: it says so, and a small one goes through (the
    reorder refuses CPUs without AVX512BW/VL/DQ or AVX-NE-CONVERT, whatever the flag says)."""
    if not packing_available() or not getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 16)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


_ONE_ROW_DIFFERS: dict[tuple, bool] = {}  # (in, out, dtype, bias) -> a single row gets other bits than among rows


class PackedLinear(nn.Module):
    """`nn.Linear` (inference only) on a oneDNN-reordered weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 16):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.one_row_as_two = self.dtype == torch.bfloat16 or self._one_row_sums_otherwise()

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy (for code that inspects weights; the forward never uses it)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or not x.is_contiguous():
            x = x.to(self.dtype).contiguous()
        if self.one_row_as_two and x.numel() == x.shape[-1]:
            # one row: oneDNN's kernel for a single row may sum in another order than for several (bf16 on
            # AVX512_BF16, Zen 4; float32 with 1,536 inputs or more on a Xeon), so a token decoded alone would get
            # other bits than the same token verified in a batch. Run it as two rows (the weight is read once:
            # 0.99-1.10x one row's time, examples/packed_linear_rows.py) and keep the first.
            two = x.reshape(1, -1).expand(2, -1).contiguous()
            return self._run(two)[:1].reshape(*x.shape[:-1], self.out_features)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _one_row_sums_otherwise(self) -> bool:
        """oneDNN picks its float32 kernel by shape, so whether one row gets other bits than the same row among
        others is a fact of the weight's shape on this CPU: probed once a shape, with random rows."""
        key = (self.in_features, self.out_features, self.dtype, self.bias is not None)
        if key not in _ONE_ROW_DIFFERS:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(4, self.in_features, generator=g, dtype=self.dtype)
            together = self._run(x)
            _ONE_ROW_DIFFERS[key] = any(not torch.equal(self._run(x[i : i + 1]), together[i : i + 1]) for i in range(4))
        return _ONE_ROW_DIFFERS[key]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule at dotted path `name` is: how packed, int8 and GGUF linears swap in."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def pack_linears(model: nn.Module, batch_hint: int = 16) -> int:
    """Replace each `nn.Linear` of a CPU float32 model (bfloat16 where oneDNN has bf16 kernels) by a
    `PackedLinear`; returns how many.

    A no-op (0) on other devices, other dtypes, without oneDNN, or with RAGSPEC_PACKED_LINEAR=0."""
    from ragspec.runtime.options import current_options

    if not current_options().packed_linear or not packing_available():
        return 0
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return 0
    if not (param.dtype == torch.float32 or (param.dtype == torch.bfloat16 and bf16_packing_available())):
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        replace_module(model, name, PackedLinear(mod, batch_hint))
    if targets:
        from ragspec.runtime.model_runtime import attach

        attach(model).packed_linears = len(targets)
    return len(targets)
