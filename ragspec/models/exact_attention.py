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
is, in practice, the same bits whichever way the rows were batched. It costs attention ~2× its float32 time
(a small share of a forward at RAG context lengths; measured in README).
"""

from __future__ import annotations

import torch

NAME = "ragspec_exact"
QUERY_BLOCK = 256  # queries per float64 score block: bounds memory on long prompts (rows are independent)


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q·kᵀ·scaling + mask)·v in float64, rounded to `query.dtype`; transformers' attention signature
    (query [B, H, Q, D], key/value [B, Hkv, K, D], an additive float mask or None) → ([B, Q, H, D], None)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by ragspec's exact attention")
    softcap = kwargs.get("softcap")
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1).transpose(2, 3)
    v = value.double().repeat_interleave(groups, dim=1)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:  # True = visible
            mask = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float64).min)
        else:
            mask = mask.double()
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for start in range(0, query.shape[2], QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, query.shape[2])
        scores = torch.matmul(query[:, :, start:end].double(), k) * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask[:, :, start:end] if mask.shape[2] > 1 else scores + mask
        out[:, :, start:end] = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `NAME` an attention implementation transformers knows (masks built as for eager: additive floats)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def use_exact_attention(model) -> None:
    """Switch a loaded model to this attention."""
    register()
    model.set_attn_implementation(NAME)
