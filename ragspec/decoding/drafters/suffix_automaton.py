"""A suffix automaton over a growing token sequence: the suffix structure behind the `suffix` drafter.

Why an automaton and not a suffix tree: drafting appends a few tokens per step and must never rebuild, and a
suffix automaton grows online in amortised O(1) per token with at most 2n states (Blumer et al. 1985), where
an online suffix tree (Ukkonen) needs active-point bookkeeping and edge labels into a text that keeps
growing. The automaton answers the three questions drafting asks:

- the longest suffix of the sequence that also occurred earlier (`link` of the last state) — the match the
  drafter continues, of any length, never capped at a constant;
- every earlier place it occurred (end positions, from the suffix-link tree) — how often each continuation
  followed it;
- the longest prefix of another sequence that occurs anywhere (a walk from the root) — the oracle's question,
  and, walked token by token, the longest suffix of one text found in another (`Matcher`, for the memory of
  earlier answers).

States are parallel lists (transitions as dicts) so a 4k-token context costs a few MB of Python objects.
"""

from __future__ import annotations


class SuffixAutomaton:
    def __init__(self, tokens=()):
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.firstpos: list[int] = [-1]  # end position of the state's first occurrence
        self.own: list[bool] = [False]  # a state made for a prefix (not a clone) owns that prefix's end position
        self.children: list[dict[int, None]] = [{}]  # suffix-link tree, as ordered sets
        self.last = 0
        self.tokens: list[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    # -- building ------------------------------------------------------------------------------------------
    def _new(self, length: int, firstpos: int, own: bool, nxt: dict | None = None) -> int:
        self.next.append({} if nxt is None else nxt)
        self.link.append(-1)
        self.length.append(length)
        self.firstpos.append(firstpos)
        self.own.append(own)
        self.children.append({})
        return len(self.length) - 1

    def _set_link(self, v: int, target: int) -> None:
        old = self.link[v]
        if old >= 0:
            del self.children[old][v]
        self.link[v] = target
        self.children[target][v] = None

    def append(self, token: int) -> None:
        token = int(token)
        pos = len(self.tokens)
        self.tokens.append(token)
        nxt, length, link = self.next, self.length, self.link
        cur = self._new(length[self.last] + 1, pos, True)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            self._set_link(cur, 0)
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                self._set_link(cur, q)
            else:
                clone = self._new(length[p] + 1, self.firstpos[q], False, dict(nxt[q]))
                self._set_link(clone, link[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                self._set_link(q, clone)
                self._set_link(cur, clone)
        self.last = cur

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    # -- queries -------------------------------------------------------------------------------------------
    def longest_repeat(self) -> int:
        """The state of the longest suffix of the sequence that also ends at an earlier position (0: none)."""
        return self.link[self.last] if self.last else 0

    def end_positions(self, state: int, limit: int | None = None) -> list[int]:
        """End positions of the strings of `state` (all of them, or about `limit`, latest-made states first),
        in decreasing order."""
        out: list[int] = []
        stack = [state]
        while stack:
            v = stack.pop()
            if self.own[v]:
                out.append(self.firstpos[v])
                if limit is not None and len(out) >= limit:
                    break
            stack.extend(self.children[v])  # popped in reverse: the most recently made states first
        out.sort(reverse=True)
        return out

    def longest_prefix(self, tokens) -> tuple[int, int]:
        """(L, state): the longest prefix tokens[:L] occurring in the sequence, and its state."""
        v, n = 0, 0
        for t in tokens:
            nv = self.next[v].get(int(t))
            if nv is None:
                break
            v, n = nv, n + 1
        return n, v


class Matcher:
    """The longest suffix of a text fed token by token that occurs in an automaton's sequence (the classic
    longest-common-substring walk): `state` holds it, `length` its length."""

    def __init__(self, automaton: SuffixAutomaton):
        self.sam = automaton
        self.state = 0
        self.length = 0

    def feed(self, tokens) -> None:
        sam = self.sam
        for t in tokens:
            t = int(t)
            v, n = self.state, self.length
            while v and t not in sam.next[v]:
                v = sam.link[v]
                n = sam.length[v]
            if t in sam.next[v]:
                v, n = sam.next[v][t], n + 1
            else:
                v, n = 0, 0
            self.state, self.length = v, n
