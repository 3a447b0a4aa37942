"""The prompt: numbered sources and the question inside the model's chat template, plus a map from every
prompt token back to its source and character offset (what the drafters' segments and attribution use).

The whole rendered prompt is tokenized in one go (so the model sees its natural tokenization) with the fast
tokenizer's offset mapping; a token belongs to source n when its first character lies inside source n's
text. Sources that do not fit the budget are dropped from the lowest-ranked up, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ragspec.decoding.drafters.base import Segment
from ragspec.errors import RagspecError
from ragspec.pipeline.declined import DECLINED
from ragspec.retrieve.trim import ELISION

# How the instruction to decline is phrased. The wording that works depends on the model (measured on held-out
# NQ-open and CLAP NQ records, docs/evaluation.md "Declining"):
# - last_resort: "reply exactly … and nothing else" made Qwen2.5-0.5B decline most answerable questions (5 of 6
#   in a probe); this wording declined 2 of 9, and is the 0.5B's best (answer contains 0.60 vs 0.50 for
#   `expected` on 40 held-out NQ records);
# - expected: Qwen2.5-1.5B declines 60 % of answerable NQ questions under last_resort; told that the sources
#   were retrieved for the question and usually hold the answer, 30 %, while still declining 85 % of CLAP NQ's
#   unanswerable ones.
DECLINE = {
    "last_resort": f"(If, and only if, none of the sources answers the question, say: {DECLINED})",
    "expected": "The sources were retrieved for this question and usually hold the answer, often as part of a "
                "longer sentence: answer from them. Only if no source says anything about what the question "
                f"asks, reply exactly: {DECLINED}",
}
DECLINES = tuple(DECLINE)
# after the relevance gate found a source about the question (retrieve.relevance), the model is not offered to
# decline: the 0.5B declined 23 % of answerable NQ questions when it was
NO_DECLINE = "none"

_TASK = {
    "quote": (
        "You answer questions using only the numbered sources you are given. Wherever you can, copy the "
        "sources' exact wording: quote the sentences that answer the question instead of paraphrasing them. "
    ),
    "free": "You answer questions using only the numbered sources you are given. Be concise and accurate. ",
    # the answer first (short, so it is right or wrong at once), then the sentence that supports it, copied
    # verbatim (drafted, and cited)
    "brief": (
        "You answer questions using only the numbered sources you are given. First answer the question in one "
        "short sentence. Then, on a new line, copy the one sentence of the sources that supports your answer, "
        "word for word, in quotation marks. "
    ),
}


def system_instruction(style: str, decline: str = "last_resort") -> str:
    """The built-in system instruction of a prompt style with a decline phrasing."""
    return (_TASK[style] + ("" if decline == NO_DECLINE else DECLINE[decline])).strip()


SYSTEM = {style: system_instruction(style) for style in _TASK}
STYLES = tuple(SYSTEM)


@dataclass
class SourceText:
    """One numbered source in the prompt: a retrieved chunk (or any passage) and where it came from."""

    number: int  # 1-based, as shown to the model
    text: str  # verbatim chunk text; document_text[start:end] == text
    path: str = ""
    start: int = 0  # character offset of `text` in its document
    end: int = 0
    title: str = ""
    key: str = ""
    score: float = 0.0
    chunk_id: int = -1
    document_id: int = -1
    lines: tuple[int, int] | None = None  # 1-based first and last line of the chunk in its document
    # every place this text is found, this one first (retrieve.sources.Location: copies in other documents,
    # chunks mostly contained in it); a citation names each one whose text holds the quote
    locations: list = field(default_factory=list)
    # a source cut by the source budget (retrieve.trim): the document spans sent, in order; `text` is their
    # slices joined by ELISION. [] = the whole span [start, end) was sent
    pieces: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.end:
            self.end = self.start + len(self.text)

    def text_pieces(self) -> list[tuple[int, int, int]]:
        """(start, end) in `text` of each piece sent, and the document offset where it starts."""
        if not self.pieces:
            return [(0, len(self.text), self.start)]
        out, pos = [], 0
        for a, b in self.pieces:
            out.append((pos, pos + b - a, a))
            pos += b - a + len(ELISION)
        return out

    def document_offset(self, c: int) -> int:
        """The document offset of character `c` of `text` (a piece's end maps to that piece's end)."""
        for t0, t1, doc in self.text_pieces():
            if t0 <= c <= t1:
                return doc + c - t0
        raise ValueError(f"offset {c} of source {self.number} lies in an elision mark")

    def cut(self, spans: list[tuple[int, int]]) -> SourceText:
        """This source with only `spans` of its text sent (offsets into `text`, in order, from the whole text)."""
        if self.pieces:
            raise ValueError("a source is cut once, from its whole text")
        if spans == [(0, len(self.text))]:
            return self
        text = ELISION.join(self.text[a:b] for a, b in spans)
        pieces = [(self.start + a, self.start + b) for a, b in spans]
        return replace(self, text=text, start=pieces[0][0], end=pieces[-1][1], pieces=pieces)


@dataclass
class BuiltPrompt:
    ids: list[int]
    sources: list[SourceText]  # the ones that fit, in prompt order
    segments: list[Segment]  # token ranges of each source's text, label = source number
    token_source: list[int]  # per prompt token: its source number, 0 outside any source text
    token_char: list[int]  # per prompt token: offset of its first character in that source's text, else -1
    dropped: int = 0
    warnings: list[str] = field(default_factory=list)
    source_budget: int | None = None  # the source budget the sources were cut to (None: sent whole)
    # for the source cache (decoding/source_cache.py): tokens [0, head) are the fixed head (the system
    # instruction and template up to the sources), `pieces` the token ranges of each piece of source text sent
    head: int = 0
    pieces: list[tuple[int, int]] = field(default_factory=list)

    def locate(self, position: int) -> tuple[int, int] | None:
        """(source number, character offset in that source's text) of a prompt token, None if no source."""
        if 0 <= position < len(self.ids) and self.token_source[position]:
            return self.token_source[position], self.token_char[position]
        return None


def render_messages(style: str, system: str | None, question: str, sources: list[SourceText],
                    history: list[dict] | None = None) -> tuple[list[dict], list[tuple[int, int]]]:
    """Chat messages and, per source, the (start, end) of its text inside the (first) user message.

    `history`: earlier turns of a conversation ({"role": "user"|"assistant", "content"}, starting with a user
    turn). The sources then sit in the first user turn, before its question, and the later turns follow as
    they were: a follow-up over the same sources repeats the whole earlier prompt and answer (whose KV cache a
    prefix store can reuse)."""
    history = list(history or [])
    first = history[0]["content"] if history else question
    parts = ["Sources:\n"]
    spans = []
    pos = len(parts[0])
    for s in sources:
        label = s.path or s.title
        head = f"\n[{s.number}]" + (f" {label}" if label else "") + "\n"
        parts.append(head)
        pos += len(head)
        spans.append((pos, pos + len(s.text)))
        parts.append(s.text + "\n")
        pos += len(s.text) + 1
    parts.append(f"\nQuestion: {first}")
    user = "".join(parts) if sources else f"Question: {first}"
    messages = [{"role": "system", "content": system or SYSTEM[style]}, {"role": "user", "content": user}]
    if history:
        for m in history[1:]:
            content = f"Question: {m['content']}" if m["role"] == "user" else m["content"]
            messages.append({"role": m["role"], "content": content})
        messages.append({"role": "user", "content": f"Question: {question}"})
    return messages, spans


class PromptBuilder:
    """Builds prompts for one tokenizer; `max_tokens` is the prompt budget (the answer's is kept apart)."""

    def __init__(self, tokenizer, style: str = "quote", system: str | None = None, max_tokens: int | None = None,
                 decline: str = "last_resort"):
        if not getattr(tokenizer, "is_fast", False):
            raise RagspecError("the prompt builder needs a fast tokenizer (offset mapping); this model has none")
        self.tokenizer = tokenizer
        self.style = style
        self.system = system
        self.max_tokens = max_tokens
        self.decline = decline

    def render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - templates without a system role: fold the instruction into the user turn
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}] + messages[2:]
            return self.tokenizer.apply_chat_template(merged, add_generation_prompt=True, tokenize=False)

    def build(self, question: str, sources: list[SourceText], history: list[dict] | None = None,
              instructions: str | None = None) -> BuiltPrompt:
        """`history`: earlier conversation turns (see `render_messages`); `instructions`: appended to the
        system instruction."""
        if not question or not question.strip():
            raise RagspecError("the question is empty")
        kept = list(sources)
        while True:
            built = self._build(question, kept, history, instructions)
            if self.max_tokens is None or len(built.ids) <= self.max_tokens:
                break
            if not kept:
                raise RagspecError(f"the question alone takes {len(built.ids)} tokens, more than the prompt budget "
                                   f"of {self.max_tokens}; shorten it or raise prompt.max_context_tokens")
            kept = kept[:-1]
        dropped = len(sources) - len(kept)
        if dropped:
            built.dropped = dropped
            built.warnings.append(
                f"the context did not fit the prompt budget of {self.max_tokens} tokens: dropped the "
                f"{dropped} lowest-ranked source{'s' if dropped > 1 else ''} (kept {len(kept)} of {len(sources)})")
        return built

    def _build(self, question: str, sources: list[SourceText], history=None, instructions=None) -> BuiltPrompt:
        system = self.system or system_instruction(self.style, self.decline)
        if instructions:
            system = system + "\n\n" + instructions
        messages, spans = render_messages(self.style, system, question, sources, history)
        text = self.render(messages)
        user = messages[1]["content"]
        # where each source's text sits in the rendered prompt (templates copy content verbatim)
        base = text.find(user)
        where = []
        cursor = 0
        for s, (a, b) in zip(sources, spans):
            at = base + a if base >= 0 and text[base + a : base + b] == s.text else text.find(s.text, cursor)
            if at < 0:
                raise RagspecError("the chat template changed a source's text; cannot map tokens to sources")
            where.append((at, at + len(s.text), s.number))
            cursor = at + len(s.text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        head, pieces = _cache_units(enc["offset_mapping"], sources, where,
                                    base + len("Sources:\n") if sources and base >= 0 else 0)
        token_source = [0] * len(ids)
        token_char = [-1] * len(ids)
        segments: list[Segment] = []
        j = 0
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            while j < len(where) and a >= where[j][1]:
                j += 1
            if j < len(where) and where[j][0] <= a < where[j][1] and b > a:
                token_source[i] = where[j][2]
                token_char[i] = a - where[j][0]
                if segments and segments[-1].label == where[j][2] and segments[-1].end == i:
                    segments[-1].end = i + 1
                else:
                    segments.append(Segment(i, i + 1, where[j][2]))
        return BuiltPrompt(ids, list(sources), segments, token_source, token_char, head=head, pieces=pieces)


def _cache_units(offsets, sources: list[SourceText], where, head_end: int) -> tuple[int, list[tuple[int, int]]]:
    """(head tokens, token ranges of each piece of source text): the head is every token that ends by
    `head_end` (the character where the sources begin); a piece is every token that starts inside it."""
    import bisect

    starts = [a for a, _ in offsets]
    head = 0
    while head < len(offsets) and offsets[head][1] <= head_end:
        head += 1
    pieces = []
    for s, (at, _, _) in zip(sources, where):
        for t0, t1, _ in s.text_pieces():
            i, j = bisect.bisect_left(starts, at + t0), bisect.bisect_left(starts, at + t1)
            if j > i and i >= head:
                pieces.append((i, j))
    return head, pieces


def as_sources(documents: Iterable[str | SourceText]) -> list[SourceText]:
    """Documents handed to an ask (texts or SourceText) as numbered sources."""
    out = []
    for i, doc in enumerate(documents, 1):
        if isinstance(doc, SourceText):
            out.append(doc)
        elif isinstance(doc, str):
            out.append(SourceText(i, doc, path=f"<document {i}>"))
        else:
            raise RagspecError(f"document {i} is a {type(doc).__name__}, not text")
    return out


def prompt_as_source(tokenizer, messages: list[dict]) -> BuiltPrompt:
    """The chat-templated prompt as one source spanning every token (drafts may copy from any of it)."""
    if not messages:
        raise RagspecError("the prompt is empty")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    src = SourceText(1, text, path="<prompt>")
    chars = [a for a, _ in enc["offset_mapping"]]
    return BuiltPrompt(ids, [src], [Segment(0, len(ids), 1)], [1] * len(ids), chars)
