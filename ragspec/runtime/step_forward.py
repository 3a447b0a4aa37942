"""A dtype-gguf model's draft steps in one lean loop over its layers: the same kernels, without the module tree.

Why: once the linears, the MLP, RMSNorm and the attention are each one C++ call (`gguf_kernel.cpp`), what a
one-token step spends around them is transformers' machinery: ~260 module calls, config reads, mask building and
keyword plumbing a step. Here a step's forward calls the same modules' `forward`s and the same kernels in the same
order, with the mask and the rotary angles made once for all layers, so a row's logits are the same bits as the
modules' forward gives (`tests/test_step_forward.py` compares them) and greedy identity and batch invariance hold
as before. A one-token step takes 0.87x (0.5B) and 0.91x (1.5B) the module tree's time on a Zen 4
(docs/decoding.md, "The step loop").

It runs only where it is the same computation: a Llama- or Qwen2-shaped decoder whose MLPs, norms and linears
are ragspec's fused GGUF modules on the native exact attention, full attention in every layer, a DynamicCache of
plain or growing layers, and a forward that is not a prompt read (`prompt_mode.py`) and asks for nothing else
(hidden states, attention weights, input embeddings, a loss). Any other call goes to the model's own forward.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ragspec.runtime.exact_attention import NAME, WEIGHTS_FLAG, kernel_mask
from ragspec.runtime.gguf_kernel import load_kernels
from ragspec.runtime.growing_cache import GrowingLayer
from ragspec.runtime.model_runtime import attach, runtime_of
from ragspec.runtime.prompt_mode import reading_prompt

# the output's cache field: `cache` in recent transformers 5.x (5.24 warns on `past_key_values`), that before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
DECODERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")  # pre-norm, SiLU MLP, rotary q/k, no embedding scale


def wanted() -> bool:
    """RAGSPEC_STEP_FORWARD=0 keeps every forward on the module tree (for comparisons; the bits are the same)."""
    from ragspec.runtime.options import current_options

    return current_options().step_forward


def install(model) -> bool:
    """Route `model`'s qualifying forwards through `step_forward` (see the module); False where it is switched
    off or the model's layers are not all of the fused kinds, so nothing changes."""
    if not wanted() or not _supported(model):
        return False
    ref = weakref.ref(model)  # the model holds its forward: no cycle through a bound method
    own = type(model).forward

    def forward(*args, **kwargs):
        m = ref()
        out = None if args else step_forward(m, **kwargs)
        return own(m, *args, **kwargs) if out is None else out

    forward.__signature__ = inspect.signature(model.forward)  # generate() reads which arguments it takes
    forward.__doc__ = own.__doc__
    model.forward = forward
    attach(model).step_forward = True
    return True


def _supported(model) -> bool:
    from ragspec.runtime.exact_attention import NAME
    from ragspec.runtime.fused_layers import FusedMLP, FusedRMSNorm
    from ragspec.runtime.gguf_linear import GGUFLinear

    inner = getattr(model, "model", None)
    cfg = getattr(model, "config", None)
    layers = getattr(inner, "layers", None)
    if cfg is None or layers is None or not isinstance(getattr(inner, "norm", None), FusedRMSNorm):
        return False
    rt = runtime_of(model)
    if getattr(cfg, "_attn_implementation", None) != NAME or rt is None or not rt.native_attention:
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return False
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if type(layer).__name__ not in DECODERS or attn is None or not isinstance(layer.mlp, FusedMLP):
            return False
        if not all(isinstance(getattr(layer, n), FusedRMSNorm) for n in ("input_layernorm",
                                                                         "post_attention_layernorm")):
            return False
        if not all(isinstance(getattr(attn, n), GGUFLinear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
    return True


def _cache_ok(cache, layers: int) -> bool:
    """A DynamicCache whose layers append (plain or growing: not the static verifier's slots, not a window)."""
    return (isinstance(cache, DynamicCache) and not getattr(cache, "offloading", False)
            and len(cache.layers) == layers and all(type(x) in (DynamicLayer, GrowingLayer) for x in cache.layers))


def step_forward(model, input_ids=None, position_ids=None, attention_mask=None, cache=None, past_key_values=None,
                 use_cache=True, logits_to_keep=0, output_hidden_states=False, output_attentions=False,
                 return_dict=True, cache_position=None, **rest):
    """`model`'s forward for a step (`CausalLMOutputWithPast` with its logits and cache), or None where the
    module tree must run it (see the module)."""
    cache = cache if cache is not None else past_key_values
    inner = model.model
    layers = inner.layers
    cfg = model.config
    if (rest or input_ids is None or input_ids.dim() != 2 or input_ids.device.type != "cpu" or not use_cache
            or output_hidden_states or output_attentions or not return_dict or not isinstance(logits_to_keep, int)
            or reading_prompt() or not _cache_ok(cache, len(layers))
            or cfg._attn_implementation != NAME or not (rt := runtime_of(model)) or not rt.native_attention):
        return None
    batch, rows = input_ids.shape
    limit = rt.prompt_rows  # the opt-in bf16 copy reads longer forwards with PyTorch's attention
    if batch != 1 or rows == 0 or (limit is not None and rows > limit):
        return None
    if any(vars(layer.self_attn).get(WEIGHTS_FLAG) for layer in layers):  # set as a plain attribute
        return None  # attention weights captured (PLD+ (a)): the modules' hooks read them
    past = cache.get_seq_length()
    mask = _mask(attention_mask, rows, past + rows)
    if mask is None or (attention_mask is None and rows > 1 and cache_position is not None):
        return None  # a mask of another form; a causal mask that would follow cache_position
    if position_ids is None:
        position_ids = torch.arange(past, past + rows)[None]
    ops = load_kernels()
    h, cos, sin = _embedded(inner, input_ids, position_ids)
    for layer in layers:
        attn = layer.self_attn
        q, k, v = _attention_inputs(attn, layer.input_layernorm.forward(h), cos, sin)
        k, v = cache.layers[attn.layer_idx].update(k, v)
        o = ops.exact_attention(q, k, v, mask, float(attn.scaling))
        h = h + attn.o_proj.forward(o.reshape(batch, rows, -1).contiguous())
        h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
    h = inner.norm.forward(h)
    return _output(model.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h), cache)


MAX_ROWS = 256  # rows of one fused forward of several generations: a draft tree's largest, below PROMPT_ROWS


def step_forward_many(model, parts: list[tuple]) -> list[torch.Tensor] | None:
    """One forward for the draft steps of several generations: `parts` holds, per generation, (input_ids [1, r],
    position_ids [1, r], its 4-D mask or None, its cache); returns each part's logits [r, vocab], its cache
    extended as its own forward would, or None where `step_forward` would not run every part alone.

    The rows of all parts share each linear, norm and MLP call (row-independent kernels: a row's bits do not
    depend on the other rows), while each part's attention reads only its own cache with its own mask, in the
    same kernel as alone. So each generation's logits are the bits of its forward alone (`continuous batching`
    in docs/serving.md; tests/test_batched_steps.py compares them)."""
    inner = model.model
    layers = inner.layers
    cfg = model.config
    rt = runtime_of(model)
    if (not parts or reading_prompt() or rt is None or not rt.step_forward or not rt.native_attention
            or cfg._attn_implementation != NAME or any(vars(x.self_attn).get(WEIGHTS_FLAG) for x in layers)):
        return None
    sizes, masks = [], []
    for ids, _pos, mask, cache in parts:
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.device.type != "cpu" or not _cache_ok(cache, len(layers)):
            return None
        rows = ids.shape[1]
        m = _mask(mask, rows, cache.get_seq_length() + rows)
        if rows == 0 or m is None:
            return None
        sizes.append(rows)
        masks.append(m)
    total = sum(sizes)
    if total > MAX_ROWS or (rt.prompt_rows is not None and total > rt.prompt_rows):
        return None
    ops = load_kernels()
    ids = torch.cat([p[0] for p in parts], dim=1)
    position_ids = torch.cat([p[1] for p in parts], dim=1)
    h, cos, sin = _embedded(inner, ids, position_ids)
    for layer in layers:
        attn = layer.self_attn
        q, k, v = _attention_inputs(attn, layer.input_layernorm.forward(h), cos, sin)
        outs, at = [], 0
        for (_, _, _, cache), rows, mask in zip(parts, sizes, masks):
            kc, vc = cache.layers[attn.layer_idx].update(k[:, :, at : at + rows].contiguous(),
                                                        v[:, :, at : at + rows].contiguous())
            o = ops.exact_attention(q[:, :, at : at + rows].contiguous(), kc, vc, mask, float(attn.scaling))
            outs.append(o.reshape(1, rows, -1))
            at += rows
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        h = h + attn.o_proj.forward(o.contiguous())
        h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
    logits = model.lm_head(inner.norm.forward(h))[0]
    return list(logits.split(sizes))


def _embedded(inner, input_ids: torch.Tensor, position_ids: torch.Tensor):
    """(the rows' embeddings, cos, signed sin): the rotary angles made once for every layer (see `_rotated`)."""
    h = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(h, position_ids)
    half = cos.shape[-1] // 2
    return h, cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]


def _output(logits: torch.Tensor, cache):
    return CausalLMOutputWithPast(logits=logits, **{_CACHE_FIELD: cache})


def _attention_inputs(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q and k rotated, and v, [B, heads, rows, D], from the layer's normed input x [B, rows, hidden]."""
    b, rows, d = x.shape[0], x.shape[1], attn.head_dim
    q, k, v = (p.forward(x).view(b, rows, -1, d) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    return _rotated(q, cos, sin).transpose(1, 2), _rotated(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` on x [B, rows, heads, D] with cos [B, rows, 1, D] and `sin` signed
    (-sin on the first half): x·cos + roll(x)·sin, the same bits as x·cos + rotate_half(x)·sin, since
    rotate_half(x) = roll(x) with the first half negated and (-a)·s = a·(-s) exactly."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * sin)


def _mask(attention_mask, rows: int, keys: int):
    """The additive float32 mask [1, 1, rows, keys] the kernel reads (`exact_attention.kernel_mask`), an empty
    tensor for one row and no mask, or None for a mask of another form."""
    if attention_mask is None:
        if rows == 1:
            return torch.empty(0)
        hidden = torch.ones(rows, keys, dtype=torch.bool).triu_(keys - rows + 1)  # each row's causal future
        return torch.zeros(1, 1, rows, keys).masked_fill_(hidden, torch.finfo(torch.float32).min)
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 4 or attention_mask.shape[-1] < keys:
        return None
    return kernel_mask(attention_mask, keys)
