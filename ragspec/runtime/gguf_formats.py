"""The GGUF block formats and the kernel's layout of them: decode a tensor's blocks, pack them for `gguf_kernel.cpp`,
de-quantize them, and make the int8 prompt copy.

Why a module of its own: this is all that decides what `gguf_blocks.py` keeps on disk, so its packing key hashes
this file (and `int8_linear.quantize_rows`), not the modules that run the kernels; an edit to those does not
make every machine pack its models again. The five kernel formats, groups of 32 weights:

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
"""

from __future__ import annotations

import numpy as np
import torch

from ragspec.errors import RagspecError

GROUP = 32
FORMATS = {"u4": 0, "u5": 1, "s8": 2, "u6": 3, "u4k": 4}
SUPERBLOCK = 5  # the kernel's code for u4k weights with one activation scale per 256 inputs (u4k8)


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
    from ragspec.runtime.int8_linear import quantize_rows

    q, scale = quantize_rows(dequantize(fmt, w, wh, d, mn, n, k))
    return q.to(torch.int8), scale.reshape(-1)


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
