"""Cross-request memory: earlier answers a drafter may copy from, bounded and least-recently-used first out.

Each entry is the end of an ask's prompt (so the same question finds it) followed by the answer's tokens;
entries are joined with negative separators into one token sequence whose suffix automaton the `suffix`
drafter matches its sequence against. A repeated or similar question then drafts the earlier answer, with
provenance "earlier answer" (never a source position), so citations are still decided by the text alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ragspec.decoding.drafters.suffix_automaton import SuffixAutomaton


class AnswerMemory:
    def __init__(self, max_answers: int = 64, prompt_tail: int = 64):
        if max_answers < 1:
            raise ValueError("an answer memory holds at least one answer")
        self.max_answers = max_answers
        self.prompt_tail = prompt_tail
        self._entries: OrderedDict[tuple, None] = OrderedDict()
        self._sam: SuffixAutomaton | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt_ids, answer_ids) -> None:
        """Remember an answer (most recent last; the least recently used beyond `max_answers` is dropped)."""
        if not answer_ids:
            return
        entry = tuple(int(t) for t in list(prompt_ids)[-self.prompt_tail :]) + tuple(int(t) for t in answer_ids)
        with self._lock:
            self._entries.pop(entry, None)
            self._entries[entry] = None
            while len(self._entries) > self.max_answers:
                self._entries.popitem(last=False)
            self._sam = None

    def automaton(self) -> SuffixAutomaton:
        """The suffix automaton of all entries, separated by distinct negative tokens (no match crosses two)."""
        with self._lock:
            if self._sam is None:
                sam = SuffixAutomaton()
                for i, entry in enumerate(self._entries):
                    sam.extend(entry)
                    sam.append(-1 - i)
                self._sam = sam
            return self._sam

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sam = None
