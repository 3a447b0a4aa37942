"""The growing KV cache layer (runtime/growing_cache.py) holds what transformers' DynamicLayer holds
after any sequence of what the backends do to a layer: appends, trims, in-place row moves, reordered copies,
clones, shallow and deep copies."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer

from ragspec.runtime.growing_cache import GrowingLayer


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)


def same(a, b):
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_growing_layer_follows_dynamic_layer():
    grow, plain = GrowingLayer(), DynamicLayer()
    assert grow.get_seq_length() == 0
    for seed, n in enumerate([300, 1, 5, 1, 17, 400]):  # past the first buffer's room: it doubles
        k, v = rows(n, seed)
        out_g, out_p = grow.update(k, v), plain.update(k, v)
        assert torch.equal(out_g[0], out_p[0]) and torch.equal(out_g[1], out_p[1])
        same(grow, plain)
        end = grow.get_seq_length() - (seed % 3)  # a trim: a prefix view assigned back
        for layer in (grow, plain):
            layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
        same(grow, plain)
        dst, src = torch.tensor([end - 2]), torch.tensor([end - 1])  # an in-place move through the views
        for layer in (grow, plain):
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]
        same(grow, plain)
    order = torch.randperm(grow.get_seq_length())  # a reordered copy becomes the new buffer
    for layer in (grow, plain):
        layer.keys, layer.values = layer.keys[:, :, order], layer.values[:, :, order]
    same(grow, plain)
    k, v = rows(3, 99)
    grow.update(k, v)
    plain.update(k, v)
    same(grow, plain)


def test_copies_do_not_share_what_they_change():
    base = GrowingLayer()
    base.update(*rows(10, 1))
    kept = base.keys.clone()
    twin = copy.copy(base)  # the prefix cache's restore: a shallow copy given its own (cloned) tensors
    twin.keys, twin.values = base.keys[:, :, :6].clone(), base.values[:, :, :6].clone()
    twin.update(*rows(4, 2))
    assert torch.equal(base.keys, kept) and twin.get_seq_length() == 10
    deep = copy.deepcopy(base)  # a fork: its own buffer
    deep.keys = deep.keys[:, :, :3]
    deep.update(*rows(5, 3))
    assert torch.equal(base.keys, kept) and deep.get_seq_length() == 8
