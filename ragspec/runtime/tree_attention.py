"""PyTorch's SDPA for masked multi-row steps, reading grouped key/value heads where they are (CPU).

Why: a draft-tree step runs several query rows over the cache under a custom 4-D mask. Given a mask,
transformers' `sdpa` attention copies every key/value head once per query head that shares it (`repeat_kv`)
before calling the kernel, because its CUDA kernels cannot take both a mask and grouped heads. On CPU they can
(`enable_gqa=True`), and the copy is not small: Qwen2.5-0.5B (14 query heads on 2 key/value heads, 24 layers)
copies ~190 MB per forward over a 1,100-token cache. Measured on 2 Zen 4 cores, fp32, a forward of 8 / 16 / 24
rows over 1,600 cached tokens went from 136 / 179 / 219 ms to 117 / 160 / 196 ms (docs/decoding.md, *Attention in
draft-tree steps*). Everything else (one-row steps, unmasked prompts, other devices) is transformers' own `sdpa`.

In float32 the result differs from the copying path by rounding only (tests compare logits and greedy output).
"""

from __future__ import annotations

import torch

NAME = "ragspec_sdpa"


def tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B, H, Q, D], key/value [B, Hkv, K, D], a mask or None →
    ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (attention_mask is None or groups == 1 or query.shape[2] == 1 or query.device.type != "cpu"
             or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_tree_attention(model) -> None:
    """Switch a loaded model that runs transformers' `sdpa` to this attention (masks built as for sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return  # eager, flash or another chosen kernel: left as it is
    AttentionInterface.register(NAME, tree_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
