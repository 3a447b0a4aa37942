"""The shipped GGUF run as it ships (`generator.dtype: gguf`): each linear keeps its GGUF blocks as integers.

Why: a one-token step on a CPU is bound by the bytes of weights it reads. De-quantized to float32 the 0.5B reads
~2 GB a token; its GGUF's own 4-8-bit blocks are ~0.5 GB, what llama.cpp reads. So the weights stay in the
GGUF's blocks, re-laid for one kernel (`gguf_kernel.cpp`), in five formats of 32-weight groups:

| GGUF type | kernel format | how |
|---|---|---|
| Q4_K | u4k: q 0..15, w = (D·sc)·q − Dmin·mn | exact: the 6-bit sub-scales and mins as bytes, D and Dmin fp16 per 256 inputs |
| Q6_K | u6: q 0..63, w = (D·sc)·(q − 32) | exact: the int8 sub-scale per 16 inputs, D fp16 per 256 |
| Q4_0, Q4_1 | u4: q 0..15, w = d·q + m | exact |
| Q5_0, Q5_1 | u5: q 0..31, w = d·q + m | exact (Q5_0's m = -16·d is exact in fp16) |
| Q8_0 | s8: q -127..127, w = d·q | exact |
| F16, BF16, F32, others | s8 | re-quantized from the de-quantized weights: d = max|w|/127 per group |

u4k and u6 read what the file holds (4.625 and 6.5625 bits a weight against the GGUF's 4.5 and 6.5625); a step of
the 1.5B reads ~1.0 GB, what llama.cpp reads, where rounding them onto u4 (5 bits) and s8 (8.5 bits) read 1.16 GB.

Activations are quantized per row and per group of 32 to int8 (llama.cpp's Q8 rule), so the group's product is
an exact integer and a row never depends on another: a token's logits are bit-identical alone or inside a
draft tree (greedy stays identical to plain greedy of this same model for every drafter). With
AMX tiles (or RAGSPEC_GGUF_Q8K=1; =0 turns it off), Q4_K linears (but an MLP's down projection, whose input the fused
MLP quantizes a group at a time) take llama.cpp's Q8_K rule instead, one scale per 256 inputs (kernel format u4k8): a super-block's sub-scales
and mins then apply in integers, and its float work is two operations per 256 inputs instead of two per 32.

Reading a prompt is another matter: hundreds of rows reuse every weight, so the bound is arithmetic, not bytes.
RAGSPEC_GGUF_PROMPT picks a second copy of the weights for it; unset, a model's measured setting does (registry
`prompt_copy`: the 0.5B's and the 1.5B's int8, answers within one standard error), and other models run every
forward on the integer kernel:
- `int8`, where `torch._int_mm` runs on int8 units (VNNI/AMX): each linear but lm_head keeps its de-quantized
  weights re-quantized to int8 per output channel (`int8_linear.Int8Linear`: activations int8 per row, exact
  int32 sums), used by the forwards the backends mark as reading prompt positions (`decoding/prompt_mode.py`),
  however many rows they have. Rows stay independent, so a prompt read in any chunks, or behind a reused prefix,
  gives the same bits. 1 byte a weight more memory, and other numbers than the blocks' for those positions. Those
  forwards' attention runs `prompt_attention.cpp` and the copy's per-row int8 steps `int8_rows.cpp` (the MLP's
  SiLU and quantization for down in one pass): prompt positions are never read as steps, so their arithmetic
  may be a prompt's own.
- `1` (bf16), where the CPU has native bf16 (AVX512_BF16/AMX): a bf16 copy packed for oneDNN that any forward of
  more than `PROMPT_ROWS` rows uses (2 bytes a weight). No draft step is that large (trees stop at 256), but a
  prompt partly served by the prefix cache is read in fewer rows than the same prompt fresh and takes the other
  kernels, so it can answer otherwise.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import nn

from ragspec.decoding.prompt_mode import reading_prompt
from ragspec.errors import RagspecError
from ragspec.models.cpu_linear import replace_module

log = logging.getLogger(__name__)

GROUP = 32
FORMATS = {"u4": 0, "u5": 1, "s8": 2, "u6": 3, "u4k": 4}
SUPERBLOCK = 5  # the kernel's code for u4k weights with one activation scale per 256 inputs (u4k8)
PROMPT_ROWS = 320  # forwards of more rows than this (prompt chunks only; trees stop at 256) use the bf16 copy


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 values stored in two bytes of each block (the last axis), as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] values: ggml's order (low nibbles are elements 0-15, high 16-31)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) → [..., 32] bits, bit i for element i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode_blocks(raw: np.ndarray, qtype: str, rows: int, cols: int):
    """A GGUF tensor's raw blocks → (format, q [rows, cols] uint8 (s8: int8), d, m), exact:
    u4/u5/s8: d, m [rows, cols/32] float32 (m None for s8; both fp16 values when they come from the file);
    u4k: d [rows, cols/256, 2] float32 (D, Dmin), m [rows, cols/32, 2] uint8 (sc, mn);
    u6:  d [rows, cols/256] float32 (D), m [rows, cols/32, 2] int8 (the scales of each half group)."""
    if cols % GROUP:
        raise RagspecError(f"a GGUF linear of {cols} input features is not a multiple of {GROUP}")
    g = cols // GROUP
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype]
        blk = b.reshape(rows, g, size)
        d = _f16(blk[..., 0:2])
        if qtype == "Q8_0":
            return "s8", blk[..., 2:34].view(np.int8).reshape(rows, cols), d, None
        has_min = qtype in ("Q4_1", "Q5_1")
        m = _f16(blk[..., 2:4]) if has_min else None
        at = 4 if has_min else 2
        if qtype.startswith("Q4"):
            q = _nibbles(blk[..., at : at + 16])
            m = m if has_min else -8.0 * d
            return "u4", q.reshape(rows, cols), d, m
        q = _nibbles(blk[..., at + 4 : at + 20]) | (_high_bits(blk[..., at : at + 4]) << 4)
        m = m if has_min else -16.0 * d
        return "u5", q.reshape(rows, cols), d, m
    if qtype == "Q4_K":
        blk = b.reshape(rows, g // 8, 144)
        dd, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _k4_scales(blk[..., 4:16])
        qs = blk[..., 16:144].reshape(rows, g // 8, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, sb, 4, 2, 32]: sub-block 2i low nibbles, 2i+1 high
        # ggml's Q4_K orders a sub-block's 32 values byte by byte; the u4 layout pairs element i with i+16
        return "u4k", q.reshape(rows, cols), np.stack([dd, dmin], -1), np.stack([sc, mn], -1).reshape(rows, g, 2)
    if qtype == "Q6_K":
        blk = b.reshape(rows, g // 8, 210)
        ql = blk[..., 0:128].reshape(rows, g // 8, 2, 64)
        qh = blk[..., 128:192].reshape(rows, g // 8, 2, 1, 32)
        low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # [rows, sb, 2, 4, 32]: ggml's order
        sc = blk[..., 192:208].view(np.int8).reshape(rows, g, 2)  # one scale per 16 inputs, in order
        return "u6", (low | (high << 4)).reshape(rows, cols), _f16(blk[..., 208:210]), sc
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(b, GGMLQuantizationType[qtype]).reshape(rows, cols).astype(np.float32)
    return ("s8", *requantize_s8(w))


def requantize_s8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Float weights → symmetric int8 per group of 32 (d = max|w|/127, rounded to fp16 first)."""
    rows, cols = w.shape
    wg = w.reshape(rows, cols // GROUP, GROUP)
    d = (np.abs(wg).max(-1) / 127.0).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(wg / safe[..., None]), -127, 127).astype(np.int8)
    return q.reshape(rows, cols), d, None


def _blocks8(a: np.ndarray) -> np.ndarray:
    """[N, ...] → [N/8 (rounded up), 8, ...], zero rows added: the kernel runs outputs in blocks of 8."""
    pad = -a.shape[0] % 8
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(a.shape[0] // 8, 8, *a.shape[1:])


def pack(fmt: str, q: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """q values [N, K] → the kernel's bytes (w, wh), laid out as `gguf_kernel.cpp` says: per block of 8 outputs
    and group of 32 inputs, 8 chunks of 4 inputs of each output (byte 4j + t of chunk c = q[8b + j][32g + 4c + t]);
    the others pair chunk c with chunk c + 4 in one byte's nibbles; u5's fifth bits follow as 4 bytes a chunk,
    u6's top two bits as two 32-byte vectors (chunk 4h + k at bits 2k..2k+1 of vector h)."""
    cols = q.shape[1]
    g = cols // GROUP
    qb = _blocks8(q).reshape(-1, 8, g, 8, 4).transpose(0, 2, 3, 1, 4)  # [b, g, c, j, t]
    qc = np.ascontiguousarray(qb).reshape(-1, g, 8, 32)
    none = np.empty((0,), np.uint8)
    if fmt == "s8":
        return torch.from_numpy(np.ascontiguousarray(qc.view(np.uint8).reshape(-1, g, 256))), torch.from_numpy(none)
    qc = qc.astype(np.uint8)
    w = (qc[:, :, :4] & 0x0F) | ((qc[:, :, 4:] & 0x0F) << 4)
    if fmt == "u5":
        wh = np.packbits((qc >> 4) & 1, axis=-1, bitorder="little").reshape(-1, g, 32)
    elif fmt == "u6":
        top = ((qc >> 4) & 3).reshape(-1, g, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        wh = np.bitwise_or.reduce(top, axis=3).reshape(-1, g, 64)
    else:
        wh = none
    return torch.from_numpy(np.ascontiguousarray(w.reshape(-1, g, 128))), torch.from_numpy(np.ascontiguousarray(wh))


def unpack(fmt: str, w: torch.Tensor, wh: torch.Tensor, rows: int) -> torch.Tensor:
    """`pack`'s inverse: q [rows, K] as int16."""
    nb, g = w.shape[0], w.shape[1]
    if fmt == "s8":
        qc = w.view(torch.int8).reshape(nb, g, 8, 32).to(torch.int16)
    else:
        b = w.reshape(nb, g, 4, 32).to(torch.int16)
        qc = torch.cat([b & 0x0F, b >> 4], dim=2)
        if fmt == "u5":
            bits = wh.reshape(nb, g, 8, 4).to(torch.int16)
            high = torch.stack([(bits >> i) & 1 for i in range(8)], dim=-1).reshape(nb, g, 8, 32)
            qc = qc + 16 * high
        elif fmt == "u6":
            v = wh.reshape(nb, g, 2, 1, 32).to(torch.int16)
            high = (v >> (2 * torch.arange(4, dtype=torch.int16))[:, None]) & 3
            qc = qc + 16 * high.reshape(nb, g, 8, 32)
    q = qc.reshape(nb, g, 8, 8, 4).permute(0, 3, 1, 2, 4)  # [b, j, g, c, t]
    return q.reshape(nb * 8, g * GROUP)[:rows]


def scale_tensors(fmt: str, d: np.ndarray, m: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_blocks`' scales → the kernel's (d, mn) buffers: the output axis in blocks of 8, innermost."""
    if fmt in ("u4", "u5", "s8"):
        return _half_bits(d), _half_bits(m if fmt != "s8" else None)
    lanes = lambda a: np.ascontiguousarray(np.moveaxis(_blocks8(a), 1, -1))  # [N, ...] → [N/8, ..., 8]  # noqa: E731
    return torch.from_numpy(lanes(_fp16(d).view(np.int16))), torch.from_numpy(lanes(np.asarray(m)))


def _fp16(a: np.ndarray) -> np.ndarray:
    h = np.asarray(a, np.float32).astype(np.float16)
    if not np.isfinite(h).all():
        raise RagspecError("a GGUF block scale does not fit fp16")
    return h


def _half_bits(a: np.ndarray | None) -> torch.Tensor:
    """Scales [N, G] → fp16 bits [N/8, G, 8] (the kernel's layout), or an empty tensor for None."""
    if a is None:
        return torch.empty(0, dtype=torch.int16)
    hb = _blocks8(_fp16(a).view(np.int16)).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(hb))


def _unblock(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N/8, G, 8] fp16 bits → [rows, G] float32."""
    return t.view(torch.float16).float().permute(0, 2, 1).reshape(-1, t.shape[1])[:rows]


def superblock_activations() -> bool:
    """Q4_K linears on llama.cpp's Q8_K activation rule: by default where the kernel drives AMX tiles (the 1.5B's
    prompts 0.89× the time there, its answers within one standard error), not elsewhere (slower without AMX);
    RAGSPEC_GGUF_Q8K=1 or 0 decides instead (docs/decoding.md)."""
    env = os.environ.get("RAGSPEC_GGUF_Q8K", "")
    if env in ("0", "1"):
        return env == "1"
    from ragspec.models.gguf_kernel import amx_expected

    return amx_expected()


PROMPT_COPIES = {"0": None, "": None, "1": "bf16", "bf16": "bf16", "int8": "int8"}


def prompt_copy_kind(default: str | None = None) -> str | None:
    """The prompt's weight copy, where this machine runs it: "int8" (int8 units that `torch._int_mm` uses),
    "bf16" (native bf16 that oneDNN packs) or None. RAGSPEC_GGUF_PROMPT decides (0: none); unset, `default` does
    (the model's measured setting: registry `prompt_copy`). The bf16 copy is chosen by row count, so a prompt
    whose start comes from the prefix cache reads its remainder with other kernels than a fresh one and can
    answer differently (seen: two serve replicas, 5-7 of 8 answers as asked alone); the int8 copy is chosen by
    role (`decoding/prompt_mode.py`) and keeps every read exact."""
    value = os.environ.get("RAGSPEC_GGUF_PROMPT")
    asked = value is not None
    value = value.strip().lower() if asked else (default or "0")
    if value not in PROMPT_COPIES:
        raise RagspecError(f"RAGSPEC_GGUF_PROMPT '{value}' is not one of 0, 1 (bf16), bf16, int8")
    kind = PROMPT_COPIES[value]
    if kind == "int8":
        from ragspec.models.int8_linear import int8_kernel

        if int8_kernel() != "int_mm":
            if asked:
                log.warning("RAGSPEC_GGUF_PROMPT=int8: torch._int_mm has no int8 units to run on here (no "
                            "VNNI/AMX), so prompts keep the integer kernel")
            return None
    elif kind == "bf16":
        from ragspec.cpu_flags import native_bf16
        from ragspec.models.cpu_linear import bf16_packing_available

        if not (native_bf16() and bf16_packing_available()):
            return None
    return kind


def prompt_copy_available() -> bool:
    """The bf16 prompt copy is on (RAGSPEC_GGUF_PROMPT=1): forwards of more than `PROMPT_ROWS` rows use it."""
    return prompt_copy_kind() == "bf16"


def dequantize(fmt: str, w: torch.Tensor, wh: torch.Tensor, d: torch.Tensor, mn: torch.Tensor, n: int,
               k: int) -> torch.Tensor:
    """Packed blocks (the kernel's layout) as the float32 [n, k] weight the kernel computes with."""
    q = unpack(fmt, w, wh, n).float().reshape(n, k // GROUP, GROUP)
    if fmt in ("u4k", "u6"):
        rows = lambda t: t.movedim(-1, 1).reshape(-1, *t.shape[1:-1])[:n]  # noqa: E731  [N/8, ..., 8] → [n, ...]
        sup = rows(d.view(torch.float16).float()).repeat_interleave(8, dim=1)  # per group
        sc = rows(mn).float()
        if fmt == "u4k":
            out = q * (sup[..., 0] * sc[..., 0])[..., None] - (sup[..., 1] * sc[..., 1])[..., None]
        else:
            halves = (q - 32).reshape(n, k // GROUP, 2, GROUP // 2)
            out = halves * (sup[..., None] * sc)[..., None]
        return out.reshape(n, k)
    out = q * _unblock(d, n)[..., None]
    if fmt != "s8":
        out = out + _unblock(mn, n)[..., None]
    return out.reshape(n, k)


def int8_copy(fmt: str, w: torch.Tensor, wh: torch.Tensor, d: torch.Tensor, mn: torch.Tensor, n: int,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 prompt copy of packed blocks: (int8 [n, k], scale per output), as `Int8Linear` quantizes."""
    from ragspec.models.int8_linear import quantize_rows

    q, scale = quantize_rows(dequantize(fmt, w, wh, d, mn, n, k))
    return q.to(torch.int8), scale.reshape(-1)


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
        kept = (b.q8, b.q8s) if b.q8 is not None else None
        self._setup(b.fmt, b.rows, b.cols, b.w, b.wh, b.d, b.mn, bias, b.gguf_type, prompt_copy, superblock, kept)
        return self

    def _setup(self, fmt, rows, cols, w, wh, sd, smn, bias, gguf_type, prompt_copy, superblock, kept=None) -> None:
        super().__init__()
        from ragspec.models.gguf_kernel import load_kernels

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
        self.prompt_int8 = None  # the int8 copy (an Int8Linear)
        kind = prompt_copy_kind() if prompt_copy is None else {True: "bf16", False: None}.get(prompt_copy, prompt_copy)
        if kind == "bf16":
            self.prompt = torch.ops.mkldnn._reorder_linear_weight(self.dequantize().to(torch.bfloat16), 16)
        elif kind == "int8":
            from ragspec.models.int8_linear import Int8Linear

            # kept with the packed blocks (`gguf_blocks.py`), or made here; the fp32 kernel gives the same numbers
            w_q, w_scale = kept if kept is not None else int8_copy(fmt, w, wh, sd, smn, rows, cols)
            self.prompt_int8 = Int8Linear.from_quantized(w_q, w_scale, self.bias, ops=self.ops)
        elif kind:
            raise RagspecError(f"prompt copy '{kind}' is not bf16 or int8")

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel computes with, as float32 [out, in] (d and m as stored)."""
        return dequantize(self.fmt, self.w, self.wh, self.d, self.mn, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prompt_int8 is not None and reading_prompt():
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
                f"{', int8 prompt copy' if self.prompt_int8 is not None else ''}")

    def nbytes(self) -> tuple[int, int]:
        """(bytes read by a decode step, bytes of the prompt copy)."""
        step = sum(t.numel() * t.element_size() for t in (self.w, self.wh, self.d, self.mn))
        if self.prompt_int8 is not None:
            return step, self.prompt_int8.nbytes()
        return step, (self.out_features * self.in_features * 2 if self.prompt is not None else 0)


# GGUF tensor name (per block) → the Hugging Face module name of llama-family models (Llama, Qwen2, SmolLM2)
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of Llama's q/k weights (transformers' GGUF
    loader undoes it the same way): rows grouped [head, half, pair] back to [head, pair, half]."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(rows)


def hf_module_name(gguf_name: str) -> str | None:
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def quantize_from_gguf(model: nn.Module, gguf_file, prompt_copy: bool | str | None = None, head: bool = True) -> dict:
    """Replace each linear of a CPU model loaded from `gguf_file` (the same weights, de-quantized) by a
    `GGUFLinear` built from the file's own blocks (packed once per machine: `gguf_blocks.py`); the lm_head too
    (from `output.weight`, or the tied `token_embd.weight`) unless `head` is False. Returns {module name: GGUF
    type}. The int8 prompt copy leaves lm_head out: a prompt forward keeps one row's logits, the last one, and
    the prompt's last token is read as a step reads it."""
    from ragspec.models.gguf_blocks import packed_blocks

    kind = prompt_copy_kind() if prompt_copy is None else {True: "bf16", False: None}.get(prompt_copy, prompt_copy)
    cfg = model.config
    _, packed = packed_blocks(gguf_file, cfg.num_attention_heads, cfg.num_key_value_heads, int8_copy=kind == "int8")
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
        copy = None if kind == "int8" and target == "lm_head" else kind
        replace_module(model, target, GGUFLinear.from_packed(b, module.bias, copy or False))
        done[target] = b.gguf_type
    if not done:
        raise RagspecError(f"generator dtype gguf: no linear of {gguf_file} matched the model")
    model.ragspec_gguf = done  # the t(n) cost key's kernels part: kernels_key, once the MLPs are fused
    model.ragspec_prompt_copy = "int8" if kind == "int8" else None  # the backends mark its prompt forwards
    from ragspec.models.exact_attention import model_configs

    for cfg in model_configs(model):  # its prompt rows' attention: exact_attention.py
        cfg.ragspec_prompt_attention = kind == "int8"
    return done


def kernels_key(model: nn.Module) -> str:
    """For the t(n) cost key: another build of the kernels, or Q4_K linears on the other activation rule, cost
    otherwise. Read from the linears as they run (the fused MLPs keep the rule only for gate/up pairs), so a
    model that has none on it (the 0.5B, SmolLM2) keeps its key."""
    q8k = any(isinstance(m, GGUFLinear) and m.code == SUPERBLOCK for m in model.modules())
    from ragspec.models.gguf_kernel import source_digest

    return source_digest() + ("-q8k" if q8k else "")
