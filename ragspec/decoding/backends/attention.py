"""Attention capture for PLD+ (a) on a transformers model: eager attention for a block, and forward hooks
keeping the chosen heads' weights. The transformers backend drives it; `heads` calibrates which heads.

A model on ragspec's exact attention (`runtime/exact_attention.py`: the CPU dtypes whose greedy identity depends
on it) keeps it while capturing: switching to eager would verify drafts with other kernels than plain greedy
decodes with. The captured layers' attention modules are marked, and the exact attention returns their weights
beside its output (computed apart: they only rank draft candidates)."""

from __future__ import annotations

import contextlib

import torch

from ragspec.runtime.exact_attention import WEIGHTS_FLAG


@contextlib.contextmanager
def eager_attention(model, keep_exact: bool = False):
    """Run the block with eager attention (attention weights are computed and returned), then restore. With
    `keep_exact`, a model on ragspec's exact attention keeps it (it returns the weights of marked modules)."""
    before = model.config._attn_implementation
    if before == "eager" or (keep_exact and before == "ragspec_exact"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


class AttentionCapture:
    """Forward hooks on the chosen layers' attention modules keeping the chosen heads' weights of the last
    forward (eager attention only): [rows, keys] per head, max-aggregated over heads (Eq. 2)."""

    def __init__(self, model, heads: list[tuple[int, int]]):
        self.by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            self.by_layer.setdefault(int(layer), []).append(int(head))
        self.rows: torch.Tensor | None = None
        self._handles = []
        layers = _decoder_layers(model)
        self._marked = []
        for li, hs in self.by_layer.items():
            self._handles.append(layers[li].self_attn.register_forward_hook(self._hook(hs)))
            setattr(layers[li].self_attn, WEIGHTS_FLAG, True)
            self._marked.append(layers[li].self_attn)

    def _hook(self, heads: list[int]):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                return
            w = weights[0, heads].amax(dim=0).float()  # [rows, keys]
            self.rows = w if self.rows is None else torch.maximum(self.rows, w)

        return hook

    def reset(self) -> None:
        self.rows = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._marked:
            setattr(m, WEIGHTS_FLAG, False)
        self._marked = []


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found for attention capture")
    return layers
