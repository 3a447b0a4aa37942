"""n-grammys: learning-free mixed drafts (n-grammys-batched-speculation.txt §4).

- Model-derived bigram (§4.1): for a token t, the model's own top-k next tokens given t alone (`model(x)`, after
  the model's BOS), extended to w tokens (§4.2 "Extensions") either by repeatedly applying the bigram (`extend="chain"`:
  a_i, top1(a_i), top1(top1(a_i)), … — only 1-token forwards, shared between tokens) or by greedy decoding
  from the bigram (`extend="greedy"`: the model continues [t, a_i] for w-1 steps). The table is computed
  lazily by the backend (`model_rows`) for the tokens that occur — the prompt's in `prepare`, generated ones
  in `update` — and cached on disk per model (`bigram_table.py`).
- Context-derived n-grams (§4.2): every earlier occurrence of the last q tokens; the w tokens after each
  are counted, most frequent first, ties to the later occurrence (Appendix B.2).
- Mixed strategy (§4.3): context matches take as many of the k drafts as they fill, the bigram rows of the
  root fill the rest. The paper's k batch rows become branches of one tree sharing the root (the tree mask
  replaces the batch), so rows with a common prefix share nodes. Context-copied nodes keep their context
  position (provenance); bigram nodes get -1. Branches go in in rank order (context by count, then bigram
  by the model's rank), each whole, so the budget's rank truncation keeps the best first.
"""

from __future__ import annotations

from pathlib import Path

from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.drafters.bigram_table import BigramTable, RowsFn
from ragspec.decoding.drafters.ngram_index import NgramIndex
from ragspec.decoding.tree import DraftTree

EXTENDS = ("chain", "greedy")


class NgrammysDrafter:
    name = "ngrammys"
    hidden_layer = None

    def __init__(self, k: int = 5, w: int = 3, q: int = 1, context_w: int | None = None, extend: str = "chain",
                 prefetch: bool = True, max_occurrences: int = 256, model_rows: RowsFn | None = None,
                 cache_path: Path | None = None):
        if k < 1 or w < 1 or q < 1:
            raise ValueError(f"need k, w, q ≥ 1, got k={k}, w={w}, q={q}")
        if extend not in EXTENDS:
            raise ValueError(f"extend must be one of {', '.join(EXTENDS)}, got '{extend}'")
        self.k, self.w, self.q = k, w, q
        self.context_w = w if context_w is None else int(context_w)
        self.extend, self.prefetch, self.max_occurrences = extend, prefetch, max_occurrences
        # chain: a plain bigram table (w = 1), extended at lookup; greedy: the extended rows themselves
        self.table = BigramTable(model_rows, k, w if extend == "greedy" else 1, cache_path)
        self._index = NgramIndex(q)

    # -- the model bigram ----------------------------------------------------------------------------------
    def _ensure(self, tokens) -> None:
        """Rows for `tokens` (and, for chains, for the tokens the chains pass through), batched per level."""
        level = {int(t) for t in tokens}
        seen: set[int] = set()
        depth = 1 if self.extend == "greedy" else self.w
        for d in range(depth):
            self.table.ensure(level)
            seen |= level
            if d == depth - 1:
                break
            nxt = set()
            for t in level:
                rows = self.table.get(t)
                if rows:
                    nxt |= {r[0] for r in rows} if d == 0 else {rows[0][0]}
            level = nxt - seen

    def model_rows(self, token: int) -> list[list[int]]:
        """The k extended bigram rows of `token`, best first ([] when not computed)."""
        rows = self.table.get(token)
        if not rows:
            return []
        if self.extend == "greedy":
            return rows
        out = []
        for r in rows:
            row = [r[0]]
            while len(row) < self.w:
                nxt = self.table.get(row[-1])
                if not nxt:
                    break
                row.append(nxt[0][0])
            out.append(row)
        return out

    # -- the protocol --------------------------------------------------------------------------------------
    def prepare(self, state: DraftState) -> None:
        self._index = NgramIndex(self.q)
        self._index.extend(state.tokens)
        self._ensure(state.tokens if self.prefetch else state.tokens[-1:])

    def update(self, state: DraftState, new_tokens: list[int]) -> None:
        self._index.extend(state.tokens)
        self._ensure(new_tokens if self.prefetch else state.tokens[-1:])

    def context_drafts(self, seq: list[int], prompt_len: int) -> list[tuple[list[int], list[int]]]:
        """Up to k continuations of the last q tokens seen earlier: (tokens, sources), by count, then recency."""
        q = min(self.q, len(seq) - 1)
        if q < 1 or self.context_w < 1:
            return []
        starts = [p for p in self._index.positions(seq[len(seq) - q :]) if p + q < len(seq)]
        count: dict[tuple, int] = {}
        last: dict[tuple, int] = {}
        for p in starts[-self.max_occurrences :]:
            gram = tuple(seq[p + q : p + q + self.context_w])
            count[gram] = count.get(gram, 0) + 1
            last[gram] = p + q  # starts are increasing: the latest occurrence wins
        ranked = sorted(count, key=lambda g: (-count[g], -last[g]))[: self.k]
        out = []
        for g in ranked:
            b = last[g]
            out.append((list(g), [b + j if b + j < prompt_len else -1 for j in range(len(g))]))
        return out

    def propose(self, state: DraftState, budget: int) -> DraftTree:
        tree = DraftTree()
        if budget <= 0 or not state.tokens:
            return tree
        seq = state.tokens
        drafts = self.context_drafts(seq, state.prompt_len)
        for toks, srcs in drafts:
            tree.add_chain(toks, srcs, budget)
        fill = self.k - len(drafts)
        if fill > 0 and len(tree) < budget:
            root = seq[-1]
            self._ensure([root])  # a no-op unless prefetch is off or update was skipped
            for row in self.model_rows(root)[:fill]:
                tree.add_chain(row, None, budget)
        return tree
