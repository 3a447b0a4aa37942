"""The shipped GGUF run as it ships (`generator.dtype: gguf`): each linear keeps its GGUF blocks as integers.

Why: a one-token step on a CPU is bound by the bytes of weights it reads. De-quantized to float32 the 0.5B reads
~2 GB a token; its GGUF's own 4-8-bit blocks are ~0.5 GB, what llama.cpp reads. So the weights stay in the
GGUF's blocks, re-laid for one kernel (`gguf_kernel.cpp`) in five formats of 32-weight groups (`gguf_formats.py`:
Q4_K, Q6_K and the legacy types exactly; other types re-quantized to 8 bits).

Activations are quantized per row and per group of 32 to int8 (llama.cpp's Q8 rule), so the group's product is
an exact integer and a row never depends on another: a token's logits are bit-identical alone or inside a
draft tree (greedy stays identical to plain greedy of this same model for every drafter). With
AMX tiles (or RAGSPEC_GGUF_Q8K=1; =0 turns it off), Q4_K linears (but an MLP's down projection, whose input the fused
MLP quantizes a group at a time) take llama.cpp's Q8_K rule instead, one scale per 256 inputs (kernel format u4k8): a super-block's sub-scales
and mins then apply in integers, and its float work is two operations per 256 inputs instead of two per 32.

Reading a prompt is another matter: hundreds of rows reuse every weight, so the bound is arithmetic, not bytes.
RAGSPEC_GGUF_PROMPT picks a second copy of the weights for it; unset, a model's measured setting does (registry
`prompt_copy`: the 0.5B's and the 1.5B's int8, answers within one standard error), and other models (and these
where there are no int8 units: an AVX2-only CPU) read prompts on the integer kernel too. Without the bf16 copy,
the forwards the backends mark as reading prompt positions (`runtime/prompt_mode.py`) run their attention in
`prompt_attention.cpp` (GEMM-shaped tiles: a prompt position is never read as a step):
- `int8`, where `torch._int_mm` runs on int8 units (VNNI/AMX): each linear but lm_head keeps its de-quantized
  weights re-quantized to int8 per output channel (`int8_linear.Int8Linear`: activations int8 per row, exact
  int32 sums), used by the forwards the backends mark as reading prompt positions (`runtime/prompt_mode.py`),
  however many rows they have. Rows stay independent, so a prompt read in any chunks, or behind a reused prefix,
  gives the same bits. 1 byte a weight more memory, and other numbers than the blocks' for those positions. Those
  forwards' attention runs `prompt_attention.cpp` and the copy's per-row int8 steps `int8_rows.cpp` (the MLP's
  SiLU and quantization for down in one pass): prompt positions are never read as steps, so their arithmetic
  may be a prompt's own.
- `int8-mlp`: the same copy for the MLPs' linears alone (88 % of a layer's weights); the attention projections read
  prompt positions on their blocks. The 0.5B's default: 12 % of the copy for 5-8 % of the prompt read, which keeps
  it within 2x llama.cpp's memory (docs/decoding.md, *The int8 prompt copy*).
- `1` (bf16), where the CPU has native bf16 (AVX512_BF16/AMX): a bf16 copy packed for oneDNN that any forward of
  more than `PROMPT_ROWS` rows uses (2 bytes a weight). No draft step is that large (trees stop at 256), but a
  prompt partly served by the prefix cache is read in fewer rows than the same prompt fresh and takes the other
  kernels, so it can answer otherwise.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch
from torch import nn

from ragspec.errors import RagspecError
from ragspec.runtime.cpu_linear import replace_module
from ragspec.runtime.gguf_formats import (
    FORMATS,
    SUPERBLOCK,
    dequantize,
    pack,
    scale_tensors,
)
from ragspec.runtime.prompt_mode import reading_prompt

log = logging.getLogger(__name__)

PROMPT_ROWS = 320  # forwards of more rows than this (prompt chunks only; trees stop at 256) use the bf16 copy


def superblock_activations() -> bool:
    """Q4_K linears on llama.cpp's Q8_K activation rule: by default where the kernel drives AMX tiles (the 1.5B's
    prompts 0.89× the time there, its answers within one standard error), not elsewhere (slower without AMX);
    RAGSPEC_GGUF_Q8K=1 or 0 decides instead (docs/decoding.md)."""
    from ragspec.runtime.options import current_options

    forced = current_options().q8k
    if forced is not None:
        return forced
    from ragspec.runtime.gguf_kernel import amx_expected

    return amx_expected()


PROMPT_COPIES = {"0": None, "": None, "1": "bf16", "bf16": "bf16", "int8": "int8", "int8-mlp": "int8-mlp"}
INT8_COPIES = ("int8", "int8-mlp")  # every linear but lm_head; the MLPs' alone (see `quantize_from_gguf`)


def prompt_copy_kind(default: str | None = None) -> str | None:
    """The prompt's weight copy, where this machine runs it: "int8" (int8 units that `torch._int_mm` uses),
    "bf16" (native bf16 that oneDNN packs) or None. RAGSPEC_GGUF_PROMPT decides (0: none); unset, `default` does
    (the model's measured setting: registry `prompt_copy`). The bf16 copy is chosen by row count, so a prompt
    whose start comes from the prefix cache reads its remainder with other kernels than a fresh one and can
    answer differently (seen: two serve replicas, 5-7 of 8 answers as asked alone); the int8 copy is chosen by
    role (`runtime/prompt_mode.py`) and keeps every read exact."""
    from ragspec.runtime.options import current_options

    value = current_options().prompt_copy
    asked = value is not None
    value = value if asked else (default or "0")
    if value not in PROMPT_COPIES:
        raise RagspecError(f"RAGSPEC_GGUF_PROMPT '{value}' is not one of 0, 1 (bf16), bf16, int8, int8-mlp")
    kind = PROMPT_COPIES[value]
    if kind in INT8_COPIES:
        from ragspec.runtime.int8_linear import int8_kernel

        if int8_kernel() != "int_mm":
            if asked:
                log.warning(f"RAGSPEC_GGUF_PROMPT={kind}: torch._int_mm has no int8 units to run on here (no "
                            "VNNI/AMX), so prompts keep the integer kernel")
            return None
    elif kind == "bf16":
        from ragspec.cpu_flags import native_bf16
        from ragspec.runtime.cpu_linear import bf16_packing_available

        if not (native_bf16() and bf16_packing_available()):
            return None
    return kind


def prompt_copy_available() -> bool:
    """The bf16 prompt copy is on (RAGSPEC_GGUF_PROMPT=1): forwards of more than `PROMPT_ROWS` rows use it."""
    return prompt_copy_kind() == "bf16"


class GGUFLinear(nn.Module):
    """`nn.Linear` (inference only) on a GGUF tensor's blocks: the integer kernel, and where RAGSPEC_GGUF_PROMPT
    asks for one, a copy for prompt positions (int8) or for forwards of more than `PROMPT_ROWS` rows (bf16).
    `prompt_copy`: None (as the variable says), False (none), True or "bf16", "int8"."""

    def __init__(self, fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, bias: torch.Tensor | None,
                 gguf_type: str = "", prompt_copy: bool | str | None = None, superblock: bool | None = None):
        w, wh = pack(fmt, q)
        sd, smn = scale_tensors(fmt, d, m)
        self._setup(fmt, *q.shape, w, wh, sd, smn, bias, gguf_type, prompt_copy, superblock)

    @classmethod
    def from_packed(cls, b, bias: torch.Tensor | None, prompt_copy: bool | str | None = None,
                    superblock: bool | None = None) -> GGUFLinear:
        """From blocks already in the kernel's layout (`gguf_blocks.Packed`): no decoding, no packing."""
        self = cls.__new__(cls)
        self._setup(b.fmt, b.rows, b.cols, b.w, b.wh, b.d, b.mn, bias, b.gguf_type, prompt_copy, superblock)
        return self

    def _setup(self, fmt, rows, cols, w, wh, sd, smn, bias, gguf_type, prompt_copy, superblock) -> None:
        super().__init__()
        from ragspec.runtime.gguf_kernel import load_kernels

        self.ops = load_kernels()
        self.out_features, self.in_features = rows, cols
        self.fmt, self.code, self.gguf_type = fmt, FORMATS[fmt], gguf_type
        if fmt == "u4k" and (superblock if superblock is not None else superblock_activations()):
            self.code = SUPERBLOCK
        self.register_buffer("w", w)
        self.register_buffer("wh", wh)
        self.register_buffer("d", sd)
        self.register_buffer("mn", smn)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._no_bias = torch.empty(0)
        self._args = None  # the buffers as a tuple: a step reads them ~170 times, Module.__getattr__ is slow
        self.prompt = None  # the bf16 copy
        self._int8 = None  # the int8 copy (an Int8Linear), once made
        kind = prompt_copy_kind() if prompt_copy is None else {True: "bf16", False: None}.get(prompt_copy, prompt_copy)
        self.wants_int8 = kind == "int8"  # its int8 copy is made when first read (or by `make_prompt_copies`)
        if kind == "bf16":
            self.prompt = torch.ops.mkldnn._reorder_linear_weight(self.dequantize().to(torch.bfloat16), 16)
        elif kind and kind != "int8":
            raise RagspecError(f"prompt copy '{kind}' is not bf16 or int8")

    @property
    def prompt_int8(self):
        """The int8 prompt copy (an `Int8Linear`), made from the blocks on first use: in one pass
        (`int8_copy.cpp`: gguf_formats.int8_copy's bits, 0.2 s for 100 M weights on 2 cores against torch's 0.7
        s); None where the linear has none. Made late so that a new machine's one-time t(n) measurement (steps
        only: 256 rows of logits) does not hold the copy (the 0.5B's 0.31 GB) beside its own."""
        if self._int8 is None and self.wants_int8:
            from ragspec.runtime.int8_linear import Int8Linear

            with _COPYING:
                if self._int8 is None:
                    w, wh, sd, smn, bias = self.kernel_args()
                    w_q, w_scale = self.ops.int8_copy(w, wh, sd, smn, FORMATS[self.fmt], self.out_features,
                                                      self.in_features)
                    self._int8 = Int8Linear.from_quantized(w_q, w_scale, bias, ops=self.ops)
        return self._int8

    def use_int8_copy(self, copy) -> None:
        """Put an int8 copy on (an `Int8Linear`) or off (None): the verifier bench compares both."""
        self._int8, self.wants_int8 = copy, copy is not None

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel computes with, as float32 [out, in] (d and m as stored)."""
        return dequantize(self.fmt, self.w, self.wh, self.d, self.mn, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wants_int8 and reading_prompt():
            return self.prompt_int8(x)
        if self.prompt is None or x.numel() <= PROMPT_ROWS * self.in_features:  # one call: quantize, multiply, bias
            args = self.kernel_args()
            y = self.ops.linear(x if x.dtype == torch.float32 else x.float(), *args[:4],
                                self._no_bias if args[4] is None else args[4], self.code, self.out_features)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.prompt, None, "none", [], "").float()
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def kernel_args(self) -> tuple:
        """(w, wh, d, mn, bias) as the kernel takes them."""
        args = self._args
        b = self._buffers
        if args is None or args[0] is not b["w"] or args[4] is not b["bias"]:  # (re)read after a load or .to()
            args = self._args = (b["w"], b["wh"], b["d"], b["mn"], b["bias"])
        return args

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.gguf_type}→{self.fmt}{'8' if self.code == SUPERBLOCK else ''}"
                f"{', bf16 prompt copy' if self.prompt is not None else ''}"
                f"{', int8 prompt copy' if self.wants_int8 else ''}")

    def nbytes(self) -> tuple[int, int]:
        """(bytes read by a decode step, bytes of the prompt copy)."""
        step = sum(t.numel() * t.element_size() for t in (self.w, self.wh, self.d, self.mn))
        if self.prompt_int8 is not None:
            return step, self.prompt_int8.nbytes()
        return step, (self.out_features * self.in_features * 2 if self.prompt is not None else 0)


def quantize_from_gguf(model: nn.Module, gguf_file, prompt_copy: bool | str | None = None, head: bool = True) -> dict:
    """Replace each linear of a CPU model loaded from `gguf_file` (the same weights, de-quantized) by a
    `GGUFLinear` built from the file's own blocks (packed once per machine: `gguf_blocks.py`); the lm_head too
    (from `output.weight`, or the tied `token_embd.weight`) unless `head` is False. Returns {module name: GGUF
    type}. The int8 prompt copy leaves lm_head out: a prompt forward keeps one row's logits, the last one, and
    the prompt's last token is read as a step reads it."""
    from ragspec.runtime.gguf_blocks import packed_blocks

    kind = prompt_copy_kind() if prompt_copy is None else {True: "bf16", False: None}.get(prompt_copy, prompt_copy)
    cfg = model.config
    _, packed = packed_blocks(gguf_file, cfg.num_attention_heads, cfg.num_key_value_heads)
    done = {}
    for target, b in packed.items():
        if target == "lm_head" and not head:
            continue
        module = model.get_submodule(target)
        if not isinstance(module, nn.Linear):
            raise RagspecError(f"generator dtype gguf: {target} is not a linear layer")
        if (b.rows, b.cols) != (module.out_features, module.in_features):
            raise RagspecError(f"generator dtype gguf: {target} is {b.rows}x{b.cols} in {gguf_file}, "
                               f"{module.out_features}x{module.in_features} in the model")
        copy = kind
        if kind in INT8_COPIES:
            copy = "int8" if target != "lm_head" and (kind == "int8" or ".mlp." in f".{target}.") else None
        replace_module(model, target, GGUFLinear.from_packed(b, module.bias, copy or False))
        done[target] = b.gguf_type
    if not done:
        raise RagspecError(f"generator dtype gguf: no linear of {gguf_file} matched the model")
    from ragspec.runtime.model_runtime import attach

    rt = attach(model)
    rt.gguf = done  # with the kernels' key (kernels_key, once the MLPs are fused): the t(n) cost key
    rt.prompt_copy = kind if kind in INT8_COPIES else None
    # the backends mark its prompt forwards, whose attention runs prompt_attention.cpp (but with the bf16 copy,
    # chosen by row count)
    rt.prompt_role = rt.prompt_attention = kind != "bf16"
    return done


def make_prompt_copies(model: nn.Module) -> int:
    """Make every int8 prompt copy `model`'s linears still owe (else each is made when a prompt first reads it);
    returns how many were made."""
    owed = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.wants_int8 and m._int8 is None]
    for m in owed:
        _ = m.prompt_int8
    return len(owed)


_COPYING = threading.Lock()


def kernels_key(model: nn.Module) -> str:
    """For the t(n) cost key: another build of the kernels, or Q4_K linears on the other activation rule, cost
    otherwise. Read from the linears as they run (the fused MLPs keep the rule only for gate/up pairs), so a
    model that has none on it (the 0.5B, SmolLM2) keeps its key."""
    q8k = any(isinstance(m, GGUFLinear) and m.code == SUPERBLOCK for m in model.modules())
    from ragspec.runtime.gguf_kernel import source_digest

    return source_digest() + ("-q8k" if q8k else "")
