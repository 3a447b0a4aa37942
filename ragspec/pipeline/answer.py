"""What a pipeline returns: the Answer (text, citations, sources, stats) and the events `stream` yields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ragspec.pipeline.attribution import Citation
from ragspec.pipeline.declined import DECLINED, is_declined  # noqa: F401 (re-exported)
from ragspec.pipeline.prompt import SourceText


@dataclass
class AnswerStats:
    retrieval_ms: float = 0.0
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    new_tokens: int = 0
    steps: int = 0
    mean_accepted: float = 0.0  # tokens per verification step, bonus included
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    speedup_estimate: float | None = None  # vs plain decoding, from the measured one-token forward cost
    finish_reason: str = ""
    drafting: str = ""
    dropped_sources: int = 0
    ttft_ms: float = 0.0  # from the call to the first answer text (retrieval and prefill included)
    prefix_reused_tokens: int = 0  # prompt tokens whose KV cache came from an earlier generation
    backend: str = ""  # what ran the model: transformers or llama.cpp (generator.backend auto: measured fastest)
    dtype: str = ""  # float32 / bfloat16 / float16 (transformers), gguf (llama.cpp: the file's own quantization)
    relevance: float | None = None  # the relevance gate's score of the sources (None: the gate did not apply)
    source_budget: int | None = None  # prompt.source_tokens applied (None: sources sent whole)
    source_tokens: int = 0  # prompt tokens of source text (what the source budget bounds)
    cache_reused_tokens: int = 0  # source cache: prompt tokens whose KV came from the store, re-positioned
    cache_stored_tokens: int = 0  # source cache: prompt tokens this ask computed into the store, then placed
    cache_computed_tokens: int = 0  # source cache: prompt tokens computed in place, in full (0: cache off)
    cache_note: str = ""  # source cache: why it did not apply to this ask ("" when it did or was off)

    def as_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def source_json(s: SourceText) -> dict:
    return {"source": s.number, "path": s.path, "start": s.start, "end": s.end, "score": round(s.score, 6),
            "key": s.key, "title": s.title, "chunk_id": s.chunk_id, "document_id": s.document_id, "lines": list(s.lines) if s.lines else None,
            "text": s.text, "pieces": [list(p) for p in s.pieces] or [[s.start, s.end]],
            "locations": [{"path": loc.path, "key": loc.key, "start": loc.start, "end": loc.end, "document_id": loc.document_id,
                           "kind": loc.kind} for loc in s.locations]}


@dataclass
class Answer:
    question: str
    text: str
    citations: list[Citation]
    sources: list[SourceText]
    stats: AnswerStats
    warnings: list[str] = field(default_factory=list)
    declined: bool | None = None  # the answer is DECLINED (None: decide from the text)

    def __post_init__(self):
        if self.declined is None:
            self.declined = is_declined(self.text)

    def as_json(self) -> dict:
        return {
            "question": self.question,
            "text": self.text,
            "declined": self.declined,
            "citations": [c.as_json() for c in self.citations],
            "sources": [source_json(s) for s in self.sources],
            "stats": self.stats.as_json(),
            "warnings": list(self.warnings),
        }

    def to_markdown(self) -> str:
        """The answer with a [n] marker after each copied span, then the numbered sources."""
        text = self.text
        for c in sorted(self.citations, key=lambda c: c.answer_end, reverse=True):
            text = text[: c.answer_end] + f" [{c.source}]" + text[c.answer_end :]
        lines = [text.strip(), "", "Sources:"]
        cited = {c.source for c in self.citations}
        for s in self.sources:
            mark = "" if s.number in cited else " (not quoted)"
            where = f"{s.path}" + (f" #{s.key}" if s.key else "")
            span = f"lines {s.lines[0]}–{s.lines[1]}" if s.lines else f"chars {s.start}–{s.end}"
            lines.append(f"[{s.number}] {where} {span}{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text


# -- stream events -------------------------------------------------------------------------------------------
@dataclass
class SourcesEvent:
    """First event: the sources the answer is built on (and any warning, e.g. sources dropped to fit)."""

    sources: list[SourceText]
    warnings: list[str]
    retrieval_ms: float
    type: str = "sources"


@dataclass
class TextEvent:
    text: str
    tokens: list[int]
    copied: list[bool]  # per token: accepted from a draft copied out of the context
    type: str = "text"


@dataclass
class CitationEvent:
    citation: Citation
    type: str = "citation"


@dataclass
class DoneEvent:
    answer: Answer
    type: str = "done"


Event = SourcesEvent | TextEvent | CitationEvent | DoneEvent
