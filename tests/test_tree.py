"""Draft-tree structure, position ids and the 4-D tree attention mask."""

import torch

from ragspec.decoding.tree import DraftTree


def test_chains_share_prefixes_and_budget_stops_growth():
    t = DraftTree()
    assert t.add_chain([5, 6, 7], [10, 11, 12]) == 3
    assert t.add_chain([5, 6, 8]) == 3
    assert t.add_chain([9]) == 1
    assert t.tokens == [5, 6, 7, 8, 9]
    assert t.parents == [-1, 0, 1, 1, -1]
    assert t.depths == [1, 2, 3, 3, 1]
    assert t.sources == [10, 11, 12, -1, -1]
    assert t.add_chain([9, 1, 2], budget=6) == 2
    assert len(t) == 6
    assert t.path(3) == [0, 1, 3]
    assert t.children(1) == [2, 3]
    small = t.truncated(3)
    assert small.tokens == [5, 6, 7] and small.parents == [-1, 0, 1]


def test_position_ids_follow_depth():
    t = DraftTree()
    t.add_chain([5, 6, 7])
    t.add_chain([5, 9])
    assert t.position_ids(100) == [100, 101, 102, 103, 102]


def test_mask_sees_cache_root_ancestors_only():
    t = DraftTree()
    t.add_chain([5, 6, 7])  # nodes 0,1,2
    t.add_chain([5, 9])  # node 3 under node 0
    t.add_chain([4])  # node 4 under root
    m = t.attention_mask(cached=3, dtype=torch.float32)
    assert m.shape == (1, 1, 6, 9)
    visible = (m[0, 0] == 0).int().tolist()
    #            cache    root n0 n1 n2 n3 n4
    assert visible[0] == [1, 1, 1, 1, 0, 0, 0, 0, 0]  # root
    assert visible[1] == [1, 1, 1, 1, 1, 0, 0, 0, 0]  # n0
    assert visible[3] == [1, 1, 1, 1, 1, 1, 1, 0, 0]  # n2: root, n0, n1, itself
    assert visible[4] == [1, 1, 1, 1, 1, 0, 0, 1, 0]  # n3: root, n0, itself (not n1/n2)
    assert visible[5] == [1, 1, 1, 1, 0, 0, 0, 0, 1]  # n4: root and itself
    assert m.min() == torch.finfo(torch.float32).min


def test_empty_tree():
    t = DraftTree()
    assert t.position_ids(7) == [7]
    assert t.attention_mask(2, torch.float32).shape == (1, 1, 1, 3)
