"""A text's two-sentence windows: what the relevance gate scores and the source budget cuts by.

Why here: the index pools every chunk's window vectors when it embeds the chunk (`index.windows`) and an ask
reads them back (`retrieve.windows`); both must split a text the same way, so the one definition sits below
both layers. A change to the split or to how a window's vector is made changes every stored window: bump
`WINDOWS_VERSION` with it, and an index built before is read as one without stored windows (ask-time pooling)
until it is built again.
"""

from __future__ import annotations

import re

WINDOWS_VERSION = 2  # the definition below; stored with an index's window vectors (2: pooled from the text's
#                     own forward, no titled copies; 1: each window embedded alone and after the title)

SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|\n+")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, stripped: `SENTENCE_END.split(text)`'s non-blank parts."""
    spans, pos = [], 0
    for m in [*SENTENCE_END.finditer(text), None]:
        end = m.start() if m else len(text)
        part = text[pos:end]
        if part.strip():
            lead = len(part) - len(part.lstrip())
            spans.append((pos + lead, pos + len(part.rstrip())))
        if m:
            pos = m.end()
    return spans


def window_runs(n_sentences: int) -> list[tuple[int, int]]:
    """The (first, last) sentence of each window: runs of two consecutive sentences (one when there is one)."""
    return [(i, min(i + 1, n_sentences - 1)) for i in range(max(n_sentences - 1, 1))] if n_sentences else []


def window_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) in `text` of each window: from its first sentence's start to its last one's end."""
    spans = sentence_spans(text)
    return [(spans[i][0], spans[j][1]) for i, j in window_runs(len(spans))]


def window_texts(text: str) -> list[str]:
    """Each window's sentences joined by one space: how a window is named (stored windows are matched by it)."""
    spans = sentence_spans(text)
    return [" ".join(text[a:b] for a, b in spans[i:j + 1]) for i, j in window_runs(len(spans))]
