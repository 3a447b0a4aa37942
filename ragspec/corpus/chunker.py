"""Token-aware chunking that prefers paragraph, then sentence, then line, then word boundaries.

Every chunk keeps `[start, end)` character offsets into its document, and `text == document[start:end]`
always holds: the text is defined as that slice (trimmed of surrounding whitespace by moving the offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

# Boundary strengths between two adjacent tokens; higher is a better place to cut.
MID_WORD, WORD, LINE, SENTENCE, PARAGRAPH = 0, 1, 2, 3, 4
SENTENCE_END = (".", "!", "?", ":", ";", "。", "！", "？")


@dataclass(frozen=True)
class Chunk:
    order: int
    start: int
    end: int
    text: str
    tokens: int


@dataclass(frozen=True)
class ChunkerSettings:
    tokens: int = 256
    overlap: int = 32

    def __post_init__(self):
        if self.tokens < 8:
            raise ValueError(f"chunk size must be at least 8 tokens, got {self.tokens}")
        if not 0 <= self.overlap < self.tokens // 2:
            raise ValueError(f"overlap must be in [0, {self.tokens // 2}) for {self.tokens}-token chunks")


def token_offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character (start, end) of every token of `text`, special tokens excluded, empty spans dropped."""
    backend = _untruncated(tokenizer)
    if backend is not None:
        offsets = backend.encode(text, add_special_tokens=False).offsets
    else:  # a slow tokenizer: fall back to the public API
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [(s, e) for s, e in offsets if e > s]


_BACKENDS: dict[int, object] = {}


def _untruncated(tokenizer):
    """A copy of the fast tokenizer's backend with truncation and padding off (whole documents)."""
    key = id(tokenizer)
    if key not in _BACKENDS:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        _BACKENDS[key] = backend
    return _BACKENDS[key]


def boundary_strength(text: str, prev_end: int, next_start: int) -> int:
    """How good a cut is between a token ending at `prev_end` and one starting at `next_start`."""
    gap = text[prev_end:next_start]
    if not gap:
        return MID_WORD
    if gap.count("\n") >= 2:
        return PARAGRAPH
    if prev_end > 0 and text[prev_end - 1] in SENTENCE_END and gap[0].isspace():
        return SENTENCE
    if "\n" in gap:
        return LINE
    return WORD if gap.isspace() else MID_WORD


def chunk_text(text: str, tokenizer, settings: ChunkerSettings = ChunkerSettings()) -> list[Chunk]:
    """Split `text` into windows of at most `settings.tokens` tokens overlapping by about `settings.overlap`."""
    offs = token_offsets(tokenizer, text)
    n = len(offs)
    if n == 0:
        return []
    size, overlap = settings.tokens, settings.overlap
    # strength[i]: quality of cutting right before token i (i in 1..n-1); the ends are perfect cuts.
    strength = [PARAGRAPH + 1] + [boundary_strength(text, offs[i - 1][1], offs[i][0]) for i in range(1, n)]
    strength.append(PARAGRAPH + 1)
    chunks: list[Chunk] = []
    start = 0
    while start < n:
        hard_end = min(start + size, n)
        end = hard_end
        if hard_end < n:
            # best boundary in the last half of the window; latest among equals (fullest chunk)
            lo = start + max(1, size // 2)
            best = max(range(lo, hard_end + 1), key=lambda i: (strength[i], i))
            end = best if strength[best] > MID_WORD else hard_end
        chunks.append(_make(text, offs, start, end, len(chunks)))
        if end >= n:
            break
        # next window starts ~overlap tokens back, on the best boundary within that stretch
        nxt = max(end - overlap, start + 1)
        if overlap:
            nxt = max(range(nxt, end + 1), key=lambda i: (strength[i], -i))
        start = nxt if nxt > start else end
    return chunks


def _make(text: str, offs: list[tuple[int, int]], a: int, b: int, order: int) -> Chunk:
    s, e = offs[a][0], offs[b - 1][1]
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return Chunk(order=order, start=s, end=e, text=text[s:e], tokens=b - a)
