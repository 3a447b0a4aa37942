"""Attention whose float32 (or bf16) result does not depend on how many queries and keys run together.

Why: greedy draft-and-verify is identical to plain greedy decoding only if a position's logits are the same
whether it is computed alone (a decode step), in a prompt, or as one row of a draft tree over a masked cache.
The linears are row-independent (packed fp32, bf16 and per-row int8 measured bit-identical), but PyTorch's
attention kernels are not: their GEMMs and softmax sums change order with the number of rows and keys, by an
ulp or so. In float32 an ulp almost never turns an argmax. Quantised numerics amplify it: int8 activations (one
rounding step ≈ 1 % of a row's largest value) and bf16 roundings turn an ulp into a different rounding, which
spreads through the layers; measured on SmolLM2 int8, logits of one-forward vs token-by-token decoding differed
by 1.6 (median) and greedy output diverged on 2 of 3 prompts within 20 tokens.

Here scores, softmax and the weighted sum run in float64 and round once to the model's dtype: the float64
differences (~1e-16 relative) cross a float32 rounding boundary about once in 10⁸ values, so the rounded result
is, in practice, the same bits whichever way the rows were batched. The cost is in prefill: Qwen2.5-0.5B int8 on
2 Zen 3 cores prefilled 1,000 tokens at 103 tok/s against 154 with PyTorch's attention; t(1)–t(16) barely moved
(docs/decoding.md, *CPU dtypes*). Keys hidden from a whole block of queries (a prompt's causal future) are left out.

A model whose runtime has `native_attention` (dtype gguf, whose C++ kernels are built anyway) runs
`attention_kernel.cpp` instead: float32 with every sum in a fixed order, one task per query row and key/value head
reading the float32 cache in place (its query heads together, block by block), so a row's result is the same bits
however rows are batched by construction, and no step converts the whole cache to float64. A model that reads its
prompts by role (`prompt_attention`: dtype gguf but with the bf16 copy) runs the rows of its prompt
forwards (`runtime/prompt_mode.py`) in `prompt_attention.cpp`: as row-independent, in GEMM-shaped tiles (prompt
positions are never read as steps there, so their arithmetic may differ from a step's).
"""

from __future__ import annotations

import torch

from ragspec.runtime.model_runtime import attach, runtime_of
from ragspec.runtime.prompt_mode import reading_prompt

WEIGHTS_FLAG = "ragspec_attention_weights"  # on an attention module: the exact attention returns its weights too

NAME = "ragspec_exact"
QUERY_BLOCK = 256  # queries per float64 score block: bounds memory on long prompts (rows are independent)


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q·kᵀ·scaling + mask)·v in float64, rounded to `query.dtype`; transformers' attention signature
    (query [B, H, Q, D], key/value [B, Hkv, K, D], an additive float mask or None) → ([B, Q, H, D], None).
    The query heads sharing a key/value head are stacked as rows (no copies of the cache per head)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by ragspec's exact attention")
    softcap = kwargs.get("softcap")
    weights = _weights(query, key, attention_mask, scaling) if getattr(module, WEIGHTS_FLAG, False) else None
    rt = runtime_of(module)
    if (rt is not None and rt.native_attention and not softcap and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.float32):
        prompt = rt.prompt_attention and reading_prompt() and query.shape[-1] % 16 == 0
        return _native(query, key, value, attention_mask, scaling, prompt), weights
    b, h, q_len, d = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = h // kv_heads  # query head i reads key/value head i // groups (transformers' repeat_kv)
    k = key.double().transpose(2, 3)  # [B, Hkv, D, K]
    v = value.double()
    mask = visible = None
    if attention_mask is not None:
        mask = attention_mask[..., :k_len]
        if mask.dtype == torch.bool:  # True = visible
            visible = mask
            mask = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill_(
                ~mask, torch.finfo(torch.float64).min)
        else:  # additive: the dtype's minimum where hidden
            visible = mask > torch.finfo(mask.dtype).min
            mask = mask.double()
        mask = mask[:, :, None]  # [B, 1|H, 1, Q|1, K] against scores [B, Hkv, groups, Q, K]
        if mask.shape[1] > 1:
            mask = mask.reshape(b, kv_heads, groups, *mask.shape[-2:])
    qg = query.reshape(b, kv_heads, groups, q_len, d)
    out = torch.empty((b, kv_heads, groups, q_len, d), dtype=torch.float64, device=query.device)
    for start in range(0, q_len, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, q_len)
        # keys hidden from every row of the block (a causal prompt's future) add exact zeros: leave them out
        keys = k_len
        if visible is not None and visible.shape[-2] > 1:
            cols = visible[..., start:end, :].reshape(-1, k_len).any(dim=0).nonzero()
            keys = int(cols[-1]) + 1 if len(cols) else k_len
        rows = qg[:, :, :, start:end].double().reshape(b, kv_heads, groups * (end - start), d)
        scores = (torch.matmul(rows, k[..., :keys]) * scaling).reshape(b, kv_heads, groups, end - start, keys)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + (mask[..., start:end, :keys] if mask.shape[-2] > 1 else mask[..., :keys])
        probs = torch.softmax(scores, dim=-1).reshape(b, kv_heads, groups * (end - start), keys)
        out[:, :, :, start:end] = torch.matmul(probs, v[:, :, :keys]).reshape(b, kv_heads, groups, end - start, d)
    return out.reshape(b, h, q_len, d).to(query.dtype).transpose(1, 2).contiguous(), weights


def _weights(query, key, attention_mask, scaling) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask) [B, H, Q, K] in float32, for a module whose weights are captured (PLD+ (a)
    ranks draft candidates by them; the output never reads them)."""
    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1)


def _native(query, key, value, attention_mask, scaling, prompt: bool = False) -> torch.Tensor:
    """`attention_kernel.cpp`'s exact attention ([B, Q, H, D]), or with `prompt` `prompt_attention.cpp`'s (rows
    read by a prompt copy); a boolean mask becomes an additive one."""
    from ragspec.runtime.gguf_kernel import load_kernels

    mask = torch.empty(0) if attention_mask is None else kernel_mask(attention_mask, key.shape[2])
    ops = load_kernels()
    return (ops.prompt_attention if prompt else ops.exact_attention)(query, key, value, mask, float(scaling))


def kernel_mask(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """A forward's mask over its first `keys` keys as the C++ kernels read it: additive float32 (the dtype's
    minimum where hidden; a boolean mask's False), rows contiguous."""
    mask = mask[..., :keys]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    elif mask.dtype != torch.float32:
        mask = mask.float().masked_fill_(mask <= torch.finfo(mask.dtype).min, torch.finfo(torch.float32).min)
    return mask.contiguous() if mask.shape[-1] > 1 and mask.stride(-1) != 1 else mask


def fast_prompt_attention(module, query, *args, **kwargs):
    """Exact attention for up to the runtime's `prompt_rows` query rows (every draft step), PyTorch's SDPA for
    more (prompt chunks: always read the same way, so their ulps never meet a draft tree's)."""
    rt = runtime_of(module)
    limit = rt.prompt_rows if rt is not None else None
    if limit is not None and query.shape[2] > limit:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, *args, **kwargs)
    return exact_attention(module, query, *args, **kwargs)


def rows_independent(model) -> bool:
    """Whether every forward of `model` computes each row the same way however rows are batched (this attention
    for all of them, with row-independent linears): then a prompt read behind a reused prefix is the same bits as
    read whole, and the head's KV can be reused exactly."""
    cfg = getattr(model, "config", None)  # a llama.cpp model has none (and its backend takes no prefix)
    rt = runtime_of(model)
    return (getattr(cfg, "_attn_implementation", None) == NAME and rt is not None and rt.exact_attention
            and rt.prompt_rows is None)


def register() -> None:
    """Make `NAME` an attention implementation transformers knows (masks built as for eager: additive floats)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, fast_prompt_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def use_exact_attention(model, prompt_rows: int | None = None, native: bool = False) -> None:
    """Switch a loaded model to this attention; with `prompt_rows`, forwards of more query rows use SDPA; with
    `native`, float32 attention runs in the C++ kernel (`attention_kernel.cpp`)."""
    register()
    rt = attach(model)
    rt.exact_attention, rt.prompt_rows, rt.native_attention = True, prompt_rows, native
    model.set_attn_implementation(NAME)
