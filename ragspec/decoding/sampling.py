"""Sampling settings and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSettings:
    """`temperature == 0` is greedy decoding. Otherwise tokens follow softmax(logits / T) restricted to the
    top-k tokens and to the smallest top-p nucleus, renormalised — the same processing as HF `generate`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def target_probs(logits, s: SamplingSettings):
    """Rows of probabilities (float32) for rows of logits under `s` (not for greedy)."""
    import torch

    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True, dim=-1)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= s.top_p  # keep the smallest set reaching top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.softmax(x, dim=-1)
