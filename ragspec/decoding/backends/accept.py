"""Acceptance on logits rows, shared by every backend: row 0 is the root's, row i + 1 node i's.

Greedy: follow the root's argmax down the tree while a child carries it; the argmax where the walk stops is
the bonus token. Sampling: multi-candidate rejection for deterministic drafts (SpecInfer; Lookahead decoding
Algorithm 4): at each node try its children in order, accept child c with probability p(c), else zero p(c)
and renormalise; if no child is accepted, sample the residual distribution.

Rows are torch tensors: the sampler (`sampling.target_probs`, HF's temperature/top-k/top-p) and its seeded
random stream are torch's, so both backends sample the same way; llama.cpp's rows come in zero-copy through
`torch.from_numpy`. Only backends import this module — drafters and the budget never do.
"""

from __future__ import annotations

from ragspec.decoding.sampling import SamplingSettings, target_probs
from ragspec.decoding.tree import DraftTree


def walk_greedy(tree: DraftTree, best) -> tuple[list[int], int]:
    """The accepted path and bonus token; `best(r)`: row r's argmax. Only rows on the walk are asked for (a
    backend that reads rows one by one reads at most depth + 1 of them)."""
    path, row, node = [], 0, -1
    while True:
        tok = int(best(row))
        nxt = tree.child(node, tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        node, row = nxt, nxt + 1


def accept_greedy(tree: DraftTree, logits) -> tuple[list[int], int]:
    """Greedy acceptance on [1 + n, vocab] logits (torch)."""
    return walk_greedy(tree, logits.argmax(dim=-1).tolist().__getitem__)


def accept_sampled(tree: DraftTree, logits, sampling: SamplingSettings, gen) -> tuple[list[int], int]:
    """Lossless sampled acceptance; `logits`: [1 + n, vocab] (torch) or a function giving row r (torch, 1-D);
    `gen`: a torch.Generator. Only rows on the walk are turned into probabilities."""
    import torch

    row = logits if callable(logits) else logits.__getitem__
    path, node = [], -1
    while True:
        p = target_probs(row(node + 1)[None], sampling)[0].cpu()
        moved = False
        for c in tree.children(node):
            tok = tree.tokens[c]
            total = float(p.sum())
            if total <= 0:
                break
            if float(torch.rand((), generator=gen)) < float(p[tok]) / total:
                path.append(c)
                node = c
                moved = True
                break
            p[tok] = 0.0  # rejected: the residual of a one-hot draft is p without that token
        if not moved:
            bonus = int(torch.multinomial(p / p.sum(), 1, generator=gen))
            return path, bonus


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
