"""The MLP and RMSNorm of a dtype-gguf model as one kernel call each (`gguf_kernel.cpp`'s `mlp`, `rms_norm`).

Why: once the linears read what the GGUF holds, a one-token step of the 1.5B spends a quarter of its time outside
them, in ~40 small PyTorch ops and module calls a layer. The MLP fused quantizes its input once for gate and up
and never leaves C++; RMSNorm runs its mean in a fixed order. Both compute each row from that row alone, so a
token's logits stay the same bits alone or inside a draft tree. A prompt forward with the int8 prompt copy (the
default of both Qwen models) quantizes x once for gate and up and runs the middle in `int8_glu`; a forward of more
rows than `PROMPT_ROWS` with the opt-in bf16 copy keeps the modules' own path (their linears multiply with it).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from ragspec.runtime.gguf_formats import FORMATS, SUPERBLOCK
from ragspec.runtime.gguf_linear import PROMPT_ROWS, GGUFLinear
from ragspec.runtime.prompt_mode import reading_prompt


class _ProductBuffer:
    """One int32 buffer for the int8 prompt MLP's gate and up products, reused by every prompt forward of every
    model. Why: each layer's two fresh [rows, intermediate] products (15.5 MB for the 0.5B at 398 rows) churn the C
    heap, which then keeps the churn's high-water mark: reusing one buffer lowered the 0.5B's first-ask peak by
    0.03 GB, with the same bits and speed (`torch._int_mm(..., out=)`). A forward that finds it in use (another
    thread's) allocates as before."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    @contextlib.contextmanager
    def pair(self, rows: int, cols: int):
        """Two [rows, cols] int32 views, or (None, None) while another forward holds the buffer."""
        if not self._lock.acquire(blocking=False):
            yield None, None
            return
        try:
            need = 2 * rows * cols
            if self._buf is None or self._buf.numel() < need:
                self._buf = None  # the old one freed before the larger one is made
                self._buf = torch.empty(need, dtype=torch.int32)
            yield self._buf[: rows * cols].view(rows, cols), self._buf[rows * cols : need].view(rows, cols)
        finally:
            self._lock.release()


_PRODUCTS = _ProductBuffer()


class FusedMLP(nn.Module):
    """down(silu(gate(x)) · up(x)) on three `GGUFLinear`s in one call; the linears stay its children."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        from ragspec.runtime.gguf_kernel import load_kernels

        self.ops = load_kernels()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self._prompt = any(m.prompt is not None for m in (self.gate_proj, self.up_proj, self.down_proj))
        self._int8 = all(m.wants_int8 for m in (self.gate_proj, self.up_proj, self.down_proj))
        # one activation rule for gate and up (x is quantized once), and the group rule for down (its input is
        # quantized a group of outputs at a time): u4k8 only where both hold
        mixed = (self.gate_proj.code == SUPERBLOCK) != (self.up_proj.code == SUPERBLOCK)
        for m in (self.gate_proj, self.up_proj) if mixed else ():
            m.code = FORMATS[m.fmt]
        if self.down_proj.code == SUPERBLOCK:
            self.down_proj.code = FORMATS[self.down_proj.fmt]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if self._int8 and reading_prompt():  # the int8 copy: x quantized once for gate and up
            gc, uc, dc = g.prompt_int8, u.prompt_int8, d.prompt_int8
            x_q, x_scale = gc.quantize(x.reshape(-1, gc.in_features).float())
            if gc.ops is not None and uc.ops is not None and dc.ops is not None and dc.bias is None:
                # gate and up scaled, SiLU-gated and quantized for down in one pass (int8_rows.cpp)
                with _PRODUCTS.pair(x_q.shape[0], gc.out_features) as (gate, up):
                    h_q, h_scale = gc.ops.int8_glu(torch._int_mm(x_q, gc.w_q.t(), out=gate),
                                                   torch._int_mm(x_q, uc.w_q.t(), out=up),
                                                   x_scale, gc.w_scale, uc.w_scale)
                return dc.product(h_q, h_scale).to(x.dtype).reshape(*x.shape[:-1], dc.out_features)
            h = self.act_fn(gc.product(x_q, x_scale)) * uc.product(x_q, x_scale)
            return d(h.to(x.dtype).reshape(*x.shape[:-1], gc.out_features))
        if self._prompt and x.numel() > PROMPT_ROWS * g.in_features:
            return d(self.act_fn(g(x)) * u(x))
        y = self.ops.mlp(x if x.dtype == torch.float32 else x.float(), *g.kernel_args()[:4], g.code,
                         *u.kernel_args()[:4], u.code, *d.kernel_args()[:4], d.code, g.out_features, d.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class FusedRMSNorm(nn.Module):
    """w · x / sqrt(mean(x²) + eps) per row, the mean in a fixed order."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        from ragspec.runtime.gguf_kernel import load_kernels

        self.ops = load_kernels()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self._w = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._w is None or self._w[0] is not self.weight:  # (re)read after a .to(); a load shares storage
            self._w = (self.weight, self.weight.detach().float().contiguous())
        y = self.ops.rms_norm(x if x.dtype == torch.float32 else x.float(), self._w[1], self.variance_epsilon)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fixed order"


def fuse_layers(model: nn.Module) -> dict:
    """Swap each MLP whose three linears are `GGUFLinear`s without bias (SiLU-gated, as Llama and Qwen2 are) and
    each RMSNorm for the fused modules. Returns how many of each."""
    from ragspec.runtime.cpu_linear import replace_module

    silu = getattr(model.config, "hidden_act", None) == "silu"
    done = {"mlp": 0, "rms_norm": 0}
    for name, module in list(model.named_modules()):
        parts = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if silu and all(isinstance(p, GGUFLinear) and p.bias is None for p in parts):
            replace_module(model, name, FusedMLP(module))
            done["mlp"] += 1
        elif type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and \
                getattr(module, "weight", None) is not None and module.weight.dim() == 1:
            replace_module(model, name, FusedRMSNorm(module))
            done["rms_norm"] += 1
    return done
