"""Suffix drafting (after SuffixDecoding, arXiv 2411.04975): continue the longest earlier match of what was
just generated, as a tree whose nodes are scored, never cut at a fixed depth.

A suffix automaton over prompt + accepted output (`suffix_automaton.py`, updated as tokens are accepted)
gives the longest suffix of the sequence that occurred before, and where. Shorter suffixes (its suffix links)
add occurrences that matched less. Every occurrence's continuation is merged into a tree, each occurrence
weighted by its match length squared, so one long match outweighs many short ones. A node's confidence is
the weighted share of the occurrences reaching its parent that go on with its token, times a trust in the
match that grows with the length of context matched so far (`trust`). The tree is grown best-first on the
product of confidences along a path, so a long single copy becomes a deep chain and an ambiguous spot a bushy,
shallow tree; the budget then keeps the nodes its calibration expects to pay (budget.AdaptiveBudget.select).

An optional `AnswerMemory` (earlier answers of the same pipeline, with the end of their prompts) is matched the
same way: a repeated question drafts the whole earlier answer. Those nodes carry the source `EARLIER_ANSWER`,
never a context position, so citations stay decided by the text matcher alone.
"""

from __future__ import annotations

import heapq

from ragspec.decoding.drafters.base import EARLIER_ANSWER, DraftState
from ragspec.decoding.drafters.suffix_automaton import Matcher, SuffixAutomaton
from ragspec.decoding.tree import DraftTree

LENGTH_EDGES = (2, 3, 4, 6, 9, 13, 21)  # groups of matched-context length: 1, 2, 3, 4-5, 6-8, 9-12, 13-20, 21+
MEMORY_GROUP = len(LENGTH_EDGES) + 1  # drafted from an earlier answer


def length_group(n: int) -> int:
    for i, edge in enumerate(LENGTH_EDGES):
        if n < edge:
            return i
    return len(LENGTH_EDGES)


def trust(matched: int) -> float:
    """Prior chance that a continuation seen after `matched` tokens of context recurs: a one-token match is a
    weak hint, a twenty-token match is nearly a copy (the budget's calibration corrects it online)."""
    return min(0.95, 0.3 + 0.065 * matched)


class SuffixDrafter:
    name = "suffix"
    hidden_layer = None

    def __init__(self, max_occurrences: int = 64, levels: int = 3, min_prob: float = 0.01, context_weight: float = 4.0,
                 memory=None):
        self.max_occurrences = max_occurrences
        self.context_weight = context_weight  # an occurrence in the prompt (the sources) counts this many times
        self.levels = levels  # how many match lengths (the longest, then its suffix links) give occurrences
        self.min_prob = min_prob  # grow no node whose path confidence is below this
        self.memory = memory
        self._sam = SuffixAutomaton()
        self._mem = None  # (automaton over the memory, matcher of our sequence in it)

    # -- index ---------------------------------------------------------------------------------------------
    def prepare(self, state: DraftState) -> None:
        self._sam = SuffixAutomaton(state.tokens)
        self._mem = None
        if self.memory is not None and len(self.memory):
            sam = self.memory.automaton()
            matcher = Matcher(sam)
            matcher.feed(state.tokens)
            self._mem = (sam, matcher)

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        fresh = state.tokens[len(self._sam) :]
        self._sam.extend(fresh)
        if self._mem is not None:
            self._mem[1].feed(fresh)

    # -- drafting ------------------------------------------------------------------------------------------
    def occurrences(self, state: DraftState) -> list[tuple[int, int, bool]]:
        """(next position, matched length, from memory) for every place a suffix of the sequence occurred."""
        sam, seq_len = self._sam, len(self._sam)
        out: list[tuple[int, int, bool]] = []
        seen: set[int] = set()
        v = sam.longest_repeat()
        for _ in range(self.levels):
            if v <= 0:
                break
            matched = sam.length[v]
            for e in sam.end_positions(v, self.max_occurrences + 1):
                if e + 1 < seq_len and e not in seen:
                    seen.add(e)
                    out.append((e + 1, matched, False))
            if len(out) >= self.max_occurrences:
                break
            v = sam.link[v]
        if self._mem is not None:
            msam, matcher = self._mem
            if matcher.length > 0:
                for e in msam.end_positions(matcher.state, self.max_occurrences):
                    if e + 1 < len(msam) and msam.tokens[e + 1] >= 0:
                        out.append((e + 1, matcher.length, True))
        return out

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        if budget <= 0:
            return tree
        occ = self.occurrences(state)
        if not occ:
            return tree
        # candidates wait in a heap by path confidence; placing one expands its children (best-first growth,
        # so a parent is always placed before its children and the tree is the `budget` most likely nodes)
        heap: list = []
        tick = 0
        cw = self.context_weight
        root = [(p, float(m * m) * (cw if p <= state.prompt_len and not mem else 1.0), m, mem) for p, m, mem in occ]
        for cand in self._children(root, (), 1.0, state.prompt_len):
            heapq.heappush(heap, (-cand[0], 1, tick, -1, (), cand))
            tick += 1
        while heap and len(tree) < budget:
            _, depth, _, parent, drafted, (path, tok, source, conf, group, sub) = heapq.heappop(heap)
            node = tree.add(parent, tok, source, conf, group)
            drafted = drafted + (tok,)
            for cand in self._children(sub, drafted, path, state.prompt_len):
                heapq.heappush(heap, (-cand[0], depth + 1, tick, node, drafted, cand))
                tick += 1
        return tree

    def _children(self, occ, drafted, path, prompt_len):
        """The next tokens after a node reached by the occurrences `occ` (next position, weight, matched
        length, from memory) along the tokens `drafted` so far: (path confidence, token, source, confidence,
        group, their occurrences). A context occurrence that runs into the end of the sequence goes on with
        the draft itself (a repeating stretch drafts its next period too)."""
        seq = self._sam.tokens
        mem_tokens = self._mem[0].tokens if self._mem is not None else ()
        n = len(seq)
        total = sum(o[1] for o in occ)
        depth = len(drafted)
        by_token: dict[int, list] = {}
        for p, w, m, mem in occ:
            if mem:
                tok = mem_tokens[p] if p < len(mem_tokens) else -1  # entries end in a negative separator
            else:
                tok = seq[p] if p < n else drafted[p - n]
            if tok >= 0:
                by_token.setdefault(tok, []).append((p + 1, w, m, mem))
        out = []
        for tok, sub in by_token.items():
            matched = max(o[2] for o in sub) + depth
            conf = sum(o[1] for o in sub) / total * trust(matched)
            if path * conf < self.min_prob:
                continue
            from_context = [p - 1 for p, _, _, mem in sub if not mem]
            if from_context:
                first = min(from_context)
                source, group = (first if first < prompt_len else -1), length_group(matched)
            else:
                source, group = EARLIER_ANSWER, MEMORY_GROUP
            out.append((path * conf, tok, source, conf, group, sub))
        return out
