"""Prompt forwards read only for the cache: the last decoder layer stops at its keys and values.

A prompt chunk read to fill the KV cache (every chunk when the prompt's last token is read alone as a step, all
chunks but the last otherwise) needs each layer's keys and values. The last layer's come from its input, so its
attention output projection and its MLP feed only the final norm and a logits row nobody reads. Under
`cache_only()` they return zeros instead: the cache holds the same bits, and a prompt costs one layer's MLP less
per token (1/28 of the 1.5B's prefill, 1/24 of the 0.5B's). The caller promises not to read the forward's
logits or hidden states.
"""

from __future__ import annotations

import contextvars
import weakref

import torch

from ragspec.runtime.prompt_mode import flagged

# decoder layers whose `mlp` maps a tensor to one of its shape (a mixture of experts may return more)
DENSE = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer", "Gemma2DecoderLayer",
         "Gemma3DecoderLayer")
_ON = contextvars.ContextVar("ragspec_cache_only", default=False)
_ENABLED = [True]  # switch(): off runs every layer whole, for the benchmark and tests that compare


def cache_only(on: bool = True):
    """Forwards run inside fill the cache only (see the module); `on=False` is a no-op, for conditional use."""
    return flagged(_ON, on)


def switch(on: bool) -> None:
    """Skip (True, the default) or run the last layer's o_proj and MLP under `cache_only()`: the same cache bits
    either way; `python -m ragspec.bench.verifier --cache-only N` times the two."""
    _ENABLED[0] = bool(on)


def install(model) -> bool:
    """Let `model`'s last decoder layer skip its o_proj and MLP under `cache_only()`; False where that layer is not
    of a dense kind above with `self_attn.o_proj` and `mlp` to wrap (nothing changes then)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    last = layers[-1]
    if type(last).__name__ not in DENSE:
        return False
    o_proj = getattr(getattr(last, "self_attn", None), "o_proj", None)
    mlp = getattr(last, "mlp", None)
    out = getattr(o_proj, "out_features", None)
    if not isinstance(o_proj, torch.nn.Module) or not isinstance(mlp, torch.nn.Module) or not out:
        return False
    if getattr(mlp, "_ragspec_cache_only", False):
        return True
    _skip(o_proj, lambda x: x.new_zeros(*x.shape[:-1], out))
    _skip(mlp, torch.zeros_like)  # an MLP's output has its input's shape
    mlp._ragspec_cache_only = True
    return True


def _skip(module: torch.nn.Module, zeros) -> None:
    inner = vars(module).get("forward")  # a forward set on the instance already (another wrapper) runs as set
    ref = weakref.ref(module)  # the module holds the wrapper: no cycle through a bound method
    own = type(module).forward

    def forward(x, *args, **kwargs):
        if _ON.get() and _ENABLED[0]:
            return zeros(x)
        return inner(x, *args, **kwargs) if inner is not None else own(ref(), x, *args, **kwargs)

    module.forward = forward
