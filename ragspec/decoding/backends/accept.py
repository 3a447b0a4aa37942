"""Acceptance on logits rows, shared by every backend: row 0 is the root's, row i + 1 node i's.

One walk for both modes: at each node choose the model's token for the next position, and go down to the child
that drafted it; where no child holds it, that token is the bonus. Greedy chooses the argmax. Sampling draws it
from the row's distribution (`sampling.target_probs`, HF's temperature/top-k/top-p) by an exponential race on
numbers of the request's seeded generator, the same count per position (`draw`). For deterministic drafts this
accepts a child with the probability multi-candidate rejection (SpecInfer; Lookahead decoding Algorithm 4) gives
it, the sum of the drafted tokens' p, and keeps the model's distribution exactly (each token *is* a draw from it);
and since every emitted token takes the same numbers, the answer does not depend on what was drafted: a seed gives
the same tokens with any drafter, tree size or batch, as plain sampling does.

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
    `gen`: a torch.Generator, the same count of numbers taken per emitted token. Only rows on the walk become probabilities."""
    row = logits if callable(logits) else logits.__getitem__
    return walk(tree, lambda r: draw(target_probs(row(r)[None], sampling)[0], gen))


RACE_BLOCK = 1024  # tokens a block: a draw takes ceil(vocab / RACE_BLOCK) + RACE_BLOCK numbers of the generator


def draw(p, gen) -> int:
    """One token from probabilities `p` (1-D, any scale): the argmax of p_i / E_i with E_i ~ Exp(1) from `gen`,
    which is token i with probability p_i. Unlike an inverse CDF (one uniform against the cumulative sum, where
    the tail's tokens lie a rounding apart) a rounding-level change in `p` (another prompt chunking, a reused
    prefix cache) moves the winner only where two ratios tie to that level, so a seed keeps its answer. Raced in
    two rounds for a small cost on a 152k vocabulary: blocks of RACE_BLOCK tokens by their mass, then the winning
    block's tokens; a token of probability 0 never wins."""
    import torch

    p = p.detach().to("cpu", torch.float64)
    blocks = -(-len(p) // RACE_BLOCK)
    padded = torch.nn.functional.pad(p, (0, blocks * RACE_BLOCK - len(p))).view(blocks, RACE_BLOCK)
    b = _race(padded.sum(1), torch.rand(blocks, generator=gen, dtype=torch.float64))
    return b * RACE_BLOCK + _race(padded[b], torch.rand(RACE_BLOCK, generator=gen, dtype=torch.float64))


def _race(weights, u) -> int:
    """The index of the largest weights_i / E_i, E_i = -log(1 - u_i) ~ Exp(1), among positive weights."""
    import torch

    return int(torch.where(weights > 0, weights / -torch.log1p(-u), -1.0).argmax())


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
