"""Draft trees: tokens with parent links, turned into position ids and a 4-D tree attention mask.

Node i hangs under `parents[i]` (-1: under the root, which is the last accepted token, not yet in the KV
cache). A node sees the cached context, the root, its ancestors and itself — nothing else — so one forward
pass scores every branch at once (SpecInfer / Medusa tree attention; ngram-trie paper Fig. 2, Eq. 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for children of the root
    sources: list[int] = field(default_factory=list)  # context position the token was copied from, -1 if none
    # optional, for scored drafters: per node the drafter's confidence that it follows its parent (0..1) and a
    # small group id (what the confidence was read from); the budget calibrates acceptance per (group, conf)
    confs: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    # a tree its drafter sized itself (lookahead's window): the adaptive budget verifies it whole or not at all
    fixed: bool = False
    _children: dict[tuple[int, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        return self._children.get((parent, token))

    def children(self, parent: int) -> list[int]:
        """Children of `parent` in insertion order (which drafters make their priority order)."""
        return [i for i, p in enumerate(self.parents) if p == parent]

    def add(self, parent: int, token: int, source: int = -1, conf: float | None = None, group: int = 0) -> int:
        """The node for `token` under `parent`, created if new (same tokens share a node). A scored tree gives
        every node a `conf`."""
        key = (parent, int(token))
        node = self._children.get(key)
        if node is not None:
            return node
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.sources.append(source)
        if conf is not None:
            self.confs.append(float(conf))
            self.groups.append(int(group))
        self._children[key] = node
        return node

    @property
    def scored(self) -> bool:
        return bool(self.tokens) and len(self.confs) == len(self.tokens)

    def add_chain(self, tokens, sources=None, budget: int | None = None) -> int:
        """Insert a chain under the root (sharing existing prefixes); stops when the tree reaches `budget`.

        Returns how many of the chain's tokens are in the tree afterwards.
        """
        node = -1
        for k, tok in enumerate(tokens):
            nxt = self._children.get((node, int(tok)))
            if nxt is None:
                if budget is not None and len(self.tokens) >= budget:
                    return k
                nxt = self.add(node, tok, sources[k] if sources is not None else -1)
            node = nxt
        return len(tokens)

    def follow(self, tokens) -> list[int]:
        """The nodes of the longest root path that spells a prefix of `tokens` (what greedy acceptance keeps
        when `tokens` is the model's output)."""
        out, node = [], -1
        for tok in tokens:
            node = self.child(node, tok)
            if node is None:
                break
            out.append(node)
        return out

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def truncated(self, budget: int) -> DraftTree:
        """The first `budget` nodes (ancestors always precede descendants, so the result is a tree)."""
        if budget >= len(self):
            return self
        return self.subset(range(budget))

    def subset(self, nodes) -> DraftTree:
        """A tree of the given nodes, in the given order (each node's parent must come before it)."""
        t = DraftTree()
        new_index = {-1: -1}
        scored = self.scored
        for i in nodes:
            new_index[i] = t.add(new_index[self.parents[i]], self.tokens[i], self.sources[i],
                                 self.confs[i] if scored else None, self.groups[i] if scored else 0)
        return t

    def max_depth(self) -> int:
        return max(self.depths, default=0)

    # -- model inputs -------------------------------------------------------------------------------------
    def position_ids(self, root_position: int) -> list[int]:
        """Positions of [root, node 0, node 1, …]: a node's position is the root's plus its depth."""
        return [root_position] + [root_position + d for d in self.depths]

    def visibility(self) -> list[list[int]]:
        """For each input row (root first), the rows it may attend to among [root, nodes]."""
        rows = [[0]]
        for i in range(len(self)):
            rows.append([0] + [j + 1 for j in self.path(i)])
        return rows

    def attention_mask(self, cached: int, dtype, device=None, window: int | None = None):
        """Float 4-D mask [1, 1, 1+n, cached+1+n]: 0 where visible, the dtype's minimum elsewhere.

        `window`: a sliding-window layer's span — a row at position q also hides cached keys k with
        q - k >= window (the convention of HF's sliding-window masks)."""
        import torch

        n = len(self)
        lo = torch.finfo(dtype).min
        mask = torch.full((1 + n, cached + 1 + n), lo, dtype=dtype, device=device)
        mask[:, :cached] = 0
        mask[:, cached:].masked_fill_(self.ancestry(device), 0)
        if window is not None:
            for r, q in enumerate(self.position_ids(cached)):
                oldest = q - window + 1  # the first key position still inside the window
                if oldest > 0:
                    mask[r, : min(oldest, cached)] = lo
        return mask[None, None]

    def ancestry(self, device=None):
        """Bool [1+n, 1+n]: row r sees row c (root, ancestors, itself) — built row by row from the parent's
        row (a parent always precedes its children), so a chain of 64 costs 64 row copies, not 64 path walks."""
        import numpy as np
        import torch

        n = len(self)
        seen = np.zeros((1 + n, 1 + n), dtype=bool)
        seen[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i + 1] = seen[p + 1]
            seen[i + 1, i + 1] = True
        out = torch.from_numpy(seen)
        return out.to(device) if device is not None else out
