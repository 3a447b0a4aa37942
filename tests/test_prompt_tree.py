"""The tree of earlier prompts (decoding.prefix_cache.PromptTree) over a real transformers cache: a lookup
hands back exactly the keys and values saved for the longest stored prefix, shared runs are stored once, the
memory bound holds, and what a lookup hands out can grow without touching what is stored."""

import torch
from transformers import DynamicCache

from ragspec.decoding.prefix_cache import PromptTree
from ragspec.runtime.growing_cache import growing

LAYERS, HEADS, DIM = 3, 2, 8


def filled(n: int, seed: int):
    """A growing cache of n positions, each position's keys and values its own random numbers."""
    g = torch.Generator().manual_seed(seed)
    cache = growing(DynamicCache())
    for layer in range(LAYERS):
        cache.update(torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g), layer)
    return cache


def test_a_lookup_returns_the_saved_rows_of_the_longest_shared_prefix():
    tree = PromptTree(64)
    a, b = list(range(10)), list(range(6)) + [50, 51, 52]
    ca, cb = filled(10, 0), filled(9, 1)
    tree.save(a, ca, 10)
    tree.save(b, cb, 9)  # splits a's run after 6 tokens: the first 6 now come from a (the same ids)
    assert tree.tokens() == 13  # 6 shared + 4 + 3
    cache, n = tree.lookup(b + [7, 8], 100)
    assert n == 9 and tree.last_reused == 9
    for i in range(LAYERS):
        want = torch.cat([ca.layers[i].keys[:, :, :6], cb.layers[i].keys[:, :, 6:9]], dim=2)
        assert torch.equal(cache.layers[i].keys, want)
        assert torch.equal(cache.layers[i].values[:, :, 6:], cb.layers[i].values[:, :, 6:9])
    assert tree.lookup(a, 4)[1] == 4  # a limit cuts it
    assert tree.lookup([99, 1, 2], 10) == (None, 0) and tree.last_reused == 0


def test_what_a_lookup_hands_out_grows_without_changing_the_store():
    tree = PromptTree(64)
    ca = filled(8, 0)
    tree.save(list(range(8)), ca, 8)
    cache, _ = tree.lookup(list(range(8)) + [9], 8)
    cache.update(torch.ones(1, HEADS, 3, DIM), torch.ones(1, HEADS, 3, DIM), 0)
    cache.layers[0].keys[:, :, 0] = 7.0  # written through the view into the handed-out buffer only
    again, _ = tree.lookup(list(range(8)), 8)
    assert cache.layers[0].keys.shape[2] == 11 and torch.equal(again.layers[0].keys, ca.layers[0].keys)


def test_the_memory_bound_drops_the_least_recently_used_run():
    per_token = LAYERS * 2 * HEADS * DIM * 4
    tree = PromptTree(25 * per_token / 2 ** 20)  # room for 25 tokens
    tree.save(list(range(10)), filled(10, 0), 10)
    tree.save([100 + i for i in range(10)], filled(10, 1), 10)
    tree.lookup(list(range(10)), 10)  # the first is used again: the second is now the older
    tree.save([200 + i for i in range(10)], filled(10, 2), 10)
    assert tree.nbytes <= tree.budget and tree.tokens() == 20
    assert tree.lookup(list(range(10)), 10)[1] == 10
    assert tree.lookup([100 + i for i in range(10)], 10)[1] == 0
    assert PromptTree(0).lookup([1], 1) == (None, 0)
