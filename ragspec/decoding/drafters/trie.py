"""Context n-gram trie drafts (ngram-trie-speculative-decoding.txt, Algorithm 1 and §3.2).

The paper slides an n-token window over the context, splits each window into a prefix of L_p tokens and a
suffix of n - L_p, and inserts every sub-prefix P[j:L_p] + S into a trie whose nodes count how often they were
reached. Drafting matches the last L_p generated tokens (then L_p-1, … 1) against the trie and takes the
sub-tree under the match, keeping its most frequent nodes (a heap of `num_draft`).

We build exactly that sub-tree on demand instead of materialising the whole trie: an index from every
k-gram (k ≤ L_p) to the positions where it occurs gives the matched windows, and their suffixes, merged
token by token with counts, are the paper's suffix tree τ_s with its frequencies. Memory is a few integers
per context token (the full trie would hold ~3·(n-L_p) nodes per token), and every node knows where in the
context it was copied from. Generated tokens extend the index as they are accepted.
"""

from __future__ import annotations

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.ngram_index import NgramIndex
from ragspec.decoding.tree import DraftTree


class NgramTrieDrafter:
    name = "trie"
    hidden_layer = None

    def __init__(self, n: int = 13, lp: int = 3, num_draft: int = 64, max_occurrences: int = 256):
        if not 1 <= lp < n:
            raise ValueError(f"need 1 ≤ L_p < n, got L_p={lp}, n={n}")
        self.n, self.lp, self.num_draft, self.max_occurrences = n, lp, num_draft, max_occurrences
        self._index = NgramIndex(lp)

    # -- index ---------------------------------------------------------------------------------------------
    def prepare(self, state: DraftState) -> None:
        self._index = NgramIndex(self.lp)
        self._index.extend(state.tokens)

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        self._index.extend(state.tokens)

    # -- drafting ------------------------------------------------------------------------------------------
    def propose(self, state: DraftState, budget: int) -> DraftTree:
        seq = state.tokens
        cap = min(self.num_draft, budget)
        if cap <= 0:
            return DraftTree()
        depth = self.n - self.lp
        for k in range(min(self.lp, len(seq)), 0, -1):
            occ = self._index.positions(seq[len(seq) - k :])
            if not occ:
                continue
            starts = [p for p in occ if p + k < len(seq)][-self.max_occurrences :]  # most recent first below
            if not starts:
                continue
            return self._suffix_tree(seq, starts[::-1], k, depth, cap, state.prompt_len)
        return DraftTree()

    def _suffix_tree(self, seq, starts, k, depth, cap, prompt_len) -> DraftTree:
        # merge the continuations into a counting trie: node key = (parent key, token)
        count: dict[tuple, int] = {}
        first_source: dict[tuple, int] = {}
        order: dict[tuple, int] = {}
        for p in starts:
            key: tuple = ()
            begin = p + k
            for q in range(begin, min(begin + depth, len(seq))):
                key = (key, seq[q])
                if key not in count:
                    count[key] = 0
                    order[key] = len(order)
                    first_source[key] = q if q < prompt_len else -1
                elif first_source[key] < 0 and q < prompt_len:
                    first_source[key] = q
                count[key] += 1
        # the `cap` most frequent nodes; ancestors (count ≥, shallower) always sort before descendants
        depth_of = {}
        for key in order:
            depth_of[key] = 1 if key[0] == () else depth_of[key[0]] + 1
        ranked = sorted(order, key=lambda kk: (-count[kk], depth_of[kk], order[kk]))[:cap]
        tree = DraftTree()
        node_of: dict[tuple, int] = {(): -1}
        for key in ranked:
            parent = node_of.get(key[0])
            if parent is None:  # an ancestor fell outside the cap (equal counts, deeper): skip the node
                continue
            node_of[key] = tree.add(parent, key[1], first_source[key])
        return tree
