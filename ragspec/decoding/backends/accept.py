"""Acceptance on logits rows, shared by every backend: row 0 is the root's, row i + 1 node i's.

One walk for both modes: at each node choose the model's token for the next position, and go down to the child
that drafted it; where no child holds it, that token is the bonus. Greedy chooses the argmax. Sampling draws it
from the row's distribution (`sampling.target_probs`, HF's temperature/top-k/top-p) by one uniform of the
request's seeded generator per position (inverse CDF). For deterministic drafts this accepts a child with the
probability multi-candidate rejection (SpecInfer; Lookahead decoding Algorithm 4) gives it, the sum of the
drafted tokens' p, and keeps the model's distribution exactly (each token *is* a draw from it); and since every
emitted token takes exactly one uniform, the answer does not depend on what was drafted: a seed gives the same
tokens with any drafter, tree size or batch, as plain sampling does.

Rows are torch tensors: llama.cpp's rows come in zero-copy through `torch.from_numpy`. Only backends import this
module — drafters and the budget never do.
"""

from __future__ import annotations

from ragspec.decoding.sampling import SamplingSettings, target_probs
from ragspec.decoding.tree import DraftTree


def walk(tree: DraftTree, choose) -> tuple[list[int], int]:
    """The accepted path and bonus token; `choose(r)`: the model's token after row r (its argmax, or a draw).
    Only rows on the walk are asked for (a backend that reads rows one by one reads at most depth + 1)."""
    path, row, node = [], 0, -1
    while True:
        tok = int(choose(row))
        nxt = tree.child(node, tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        node, row = nxt, nxt + 1


def accept_greedy(tree: DraftTree, logits) -> tuple[list[int], int]:
    """Greedy acceptance on [1 + n, vocab] logits (torch)."""
    return walk(tree, logits.argmax(dim=-1).tolist().__getitem__)


def accept_sampled(tree: DraftTree, logits, sampling: SamplingSettings, gen) -> tuple[list[int], int]:
    """Lossless sampled acceptance; `logits`: [1 + n, vocab] (torch) or a function giving row r (torch, 1-D);
    `gen`: a torch.Generator, one uniform taken per emitted token. Only rows on the walk become probabilities."""
    row = logits if callable(logits) else logits.__getitem__
    return walk(tree, lambda r: draw(target_probs(row(r)[None], sampling)[0], gen))


def draw(p, gen) -> int:
    """One token from probabilities `p` (1-D, any scale) by one uniform of `gen`: the first token whose
    cumulative probability passes it, in float64 (a token of probability 0 is never the first to pass)."""
    import torch

    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    cdf = p.detach().to("cpu", torch.float64).cumsum(0)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, x, right=True)), len(cdf) - 1)


def new_generator(sampling: SamplingSettings):
    """The seeded torch.Generator a sampling backend draws from (None for greedy)."""
    import torch

    if sampling.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if sampling.seed is not None:
        gen.manual_seed(sampling.seed)
    else:
        gen.seed()
    return gen
