"""int8 linears for CPU inference (`generator.dtype: int8`), with one activation scale per row.

Weights: symmetric int8, one scale per output channel (row of W). Activations: quantised when the layer runs,
symmetric int8 with one scale PER ROW (per token), never one scale over the batch: with a batch scale a draft
row's values would change the quantisation of every other row, so a verify step's logits would depend on the
draft tree, and greedy output on the drafter. Per row, a token's output depends on that token alone. (PyTorch's
dynamic int8 linear, fbgemm's `quantized.linear_dynamic`, takes one scale over the whole input: measured on
random rows, one row's output moved by up to 2.8 between alone and in a batch of 8.)

The integer product is exact (int32 accumulation), so the order of summation cannot change it: a row's output is
bit-identical alone or in any batch, and the two kernels below compute the same bits:

- `int_mm`: `torch._int_mm`, fast where the CPU has VNNI/AMX (777 GOP/s on 2 Zen 4 cores, issue 21). Without
  them PyTorch runs a slow loop: 4–6 GOP/s on 2 Zen 3 cores, against 70–135 GFLOP/s for packed fp32.
- `fp32`: the same integer product in packed fp32 GEMMs, one per slice of ≤ 1040 input features: products are
  ≤ 127² and every partial sum stays below 2²⁴, so each float addition is exact in any order; slices add in
  int32. It runs at fp32 speed and saves no memory: it is how int8 numerics run on a CPU without int8 units.

Embeddings and lm_head stay float32 (lm_head packed): the embedding is a lookup (no matmul to speed up), and
the logits decide every greedy token and every draft's acceptance, so lm_head keeps full precision.
"""

from __future__ import annotations

import functools
import logging
import time
from types import SimpleNamespace

import torch
from torch import nn

from ragspec.cpu_flags import native_int8
from ragspec.errors import RagspecError
from ragspec.runtime.cpu_linear import replace_module

log = logging.getLogger(__name__)

QMAX = 127  # symmetric: -127..127 (never -128, so negation and the fp32 bound stay exact)
EXACT_SLICE = (1 << 24) // (QMAX * QMAX)  # 1040 input features: the most whose int8 dot product fp32 sums exactly
KERNELS = ("int_mm", "fp32")


@functools.lru_cache(maxsize=1)
def _int_mm_is_fast() -> bool:
    """`torch._int_mm` runs an int8 GEMM kernel here, not the reference loop (which flags alone cannot tell:
    the dispatch is PyTorch's). A 64×1024×1024 product: ~0.1 ms with VNNI, tens of ms in the loop."""
    if not hasattr(torch, "_int_mm"):
        return False
    a = torch.ones(64, 1024, dtype=torch.int8)
    b = torch.ones(1024, 1024, dtype=torch.int8)
    x, w = a.float(), b.float()
    torch._int_mm(a, b), torch.mm(x, w)
    t0 = time.perf_counter()
    torch._int_mm(a, b)
    t1 = time.perf_counter()
    torch.mm(x, w)
    t2 = time.perf_counter()
    return (t1 - t0) < 2 * (t2 - t1)


def int8_kernel() -> str:
    """`int_mm` where the CPU has int8 units and PyTorch uses them, else `fp32` (the same numbers);
    RAGSPEC_INT8_KERNEL=int_mm|fp32 forces one."""
    from ragspec.runtime.options import current_options

    forced = current_options().int8_kernel
    if forced:
        if forced not in KERNELS:
            raise RagspecError(f"RAGSPEC_INT8_KERNEL '{forced}' is not one of {', '.join(KERNELS)}")
        if forced == "int_mm" and not hasattr(torch, "_int_mm"):
            raise RagspecError("RAGSPEC_INT8_KERNEL=int_mm: this PyTorch has no torch._int_mm")
        return forced
    return "int_mm" if native_int8() and _int_mm_is_fast() else "fp32"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 values (as integer-valued float32) and one scale per row: [M, K] → ([M, K], [M, 1]).
    Everything is elementwise or a per-row max, so a row's result never depends on the other rows."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(QMAX)
    return torch.div(x, scale).round_().clamp_(-QMAX, QMAX), scale  # an all-zero row quantises to zeros


class Int8Linear(nn.Module):
    """`nn.Linear` (inference only) on int8 weights (per output channel) and int8 activations (per row)."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None):
        super().__init__()
        w_q, w_scale = quantize_rows(linear.weight.detach().float())
        self._setup(w_q, w_scale, linear.bias, kernel)

    def _setup(self, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, kernel: str | None,
               ops=None):
        """w_q: [N, K] integer values (any dtype), w_scale: N scales; `ops`: the GGUF kernels, whose one-pass
        quantize and scaling (`int8_rows.cpp`, the same bits) the `int_mm` kernel then uses."""
        self.out_features, self.in_features = w_q.shape
        self.kernel = kernel or int8_kernel()
        self.ops = ops if self.kernel == "int_mm" else None
        self._no_bias = torch.empty(0)
        self.register_buffer("w_scale", w_scale.reshape(1, -1).float().contiguous())  # [1, N]
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if self.kernel == "int_mm":
            self.register_buffer("w_q", w_q.to(torch.int8))  # [N, K]; `_int_mm` takes its transpose as a view
            self.slices = []
        else:
            from ragspec.runtime.cpu_linear import packing_available

            k = self.in_features
            step = -(-k // -(-k // EXACT_SLICE))  # equal slices of at most EXACT_SLICE features
            self.packed = packing_available()
            self.slices = []  # (start, end, weight): packed for oneDNN where it is built in, else dense
            for start in range(0, k, step):
                part = w_q[:, start : start + step].float().contiguous()
                if self.packed:
                    part = torch.ops.mkldnn._reorder_linear_weight(part, 16)
                self.slices.append((start, min(start + step, k), part))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None) -> Int8Linear:
        """From a float [out, in] weight (dtype gguf's prompt copy: its blocks de-quantized)."""
        out_features, in_features = weight.shape
        return cls(SimpleNamespace(weight=weight, bias=bias, in_features=in_features, out_features=out_features),
                   kernel)

    @classmethod
    def from_quantized(cls, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       kernel: str | None = None, ops=None) -> Int8Linear:
        """From weights already quantized as `quantize_rows` does (int8 [out, in] and a scale per output), as
        dtype gguf's kept packing holds its prompt copy (`ops`: its kernels)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(w_q, w_scale, bias, kernel, ops)
        return self

    def nbytes(self) -> int:
        """Bytes of the weights as this kernel holds them (int8, or the exact fp32 slices' 4 bytes a weight)."""
        return self.in_features * self.out_features * (1 if self.kernel == "int_mm" else 4) + 4 * self.out_features

    def _fp32_product(self, x_q: torch.Tensor) -> torch.Tensor:
        """x_q @ w_qᵀ, exact, as int32 (or as float32 when one slice: its integers are exact there)."""
        acc = None
        for start, end, part in self.slices:
            xs = x_q[:, start:end].contiguous()
            if self.packed:
                r = torch.ops.mkldnn._linear_pointwise(xs, part, None, "none", [], "")
            else:
                r = torch.nn.functional.linear(xs, part)
            if len(self.slices) == 1:
                return r
            acc = r.to(torch.int32) if acc is None else acc.add_(r.to(torch.int32))
        return acc

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_rows` of float32 rows [M, K], as this layer's product takes them (int8 from the one-pass
        kernel)."""
        return self.ops.quantize_rows_int8(x2) if self.ops is not None else quantize_rows(x2)

    def product(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """(x_q @ w_qᵀ) · s_x[row] · s_w[col] (+ bias) as float32 [M, N], from `quantize`'s rows."""
        if self.ops is not None:
            return self.ops.scale_int32(torch._int_mm(x_q, self.w_q.t()), x_scale, self.w_scale,
                                        self._no_bias if self.bias is None else self.bias)
        if self.kernel == "int_mm":
            acc = torch._int_mm(x_q.to(torch.int8), self.w_q.t())
        else:
            acc = self._fp32_product(x_q)
        y = acc.to(torch.float32).mul_(x_scale).mul_(self.w_scale)  # per element: s_x[row] × s_w[col]
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        y = self.product(*self.quantize(x2))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 ({self.kernel})")


def quantize_linears(model: nn.Module, kernel: str | None = None) -> int:
    """Replace each `nn.Linear` of a CPU float32 model but its output head by an `Int8Linear`; returns how many.
    The head (lm_head) stays a float32 `nn.Linear` for `pack_linears` to pack."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        raise RagspecError("generator dtype int8 runs on CPU only: set generator.device: cpu, or use bfloat16 on cuda")
    kernel = kernel or int8_kernel()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and mod is not head]
    for name, mod in targets:
        replace_module(model, name, Int8Linear(mod, kernel))
    from ragspec.runtime.model_runtime import attach

    attach(model).int8 = kernel if targets else ""
    if targets and kernel == "fp32" and not native_int8():
        log.warning("generator dtype int8: this CPU has no int8 units (VNNI/AMX), so int8 runs as exact fp32 GEMMs, "
                    "no faster than float32")
    return len(targets)
