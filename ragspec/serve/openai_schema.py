"""Request and response models of the served API: the OpenAI chat-completions subset ragspec implements, and
ragspec's own /v1/ask and /v1/search bodies.

OpenAI requests ignore fields ragspec does not use (clients send many: `user`, `logprobs`, …); ragspec's own
requests forbid unknown keys. Responses carry ragspec's extras (sources, citations, decoding stats) in a
`ragspec` field, which OpenAI clients keep as an extra attribute.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP, MAX_STOP_CHARS = 4, 200  # OpenAI's own limit on stop sequences; a length no stop phrase needs


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- OpenAI: /v1/chat/completions -------------------------------------------------------------------------
class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type '{part.type}' are not supported (text only)")
            out.append(part.text or "")
        return "".join(out)


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63, description="the sampling seed (with a temperature above 0)")

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        """Every stop sequence is looked for after every step: a few short ones."""
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise ValueError(f"at most {MAX_STOP} stop sequences of up to {MAX_STOP_CHARS} characters each")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [x for x in ([self.stop] if isinstance(self.stop, str) else self.stop) if x]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix cache and source cache), as OpenAI reports


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    ragspec: dict[str, Any] = Field(default_factory=dict, description="sources, citations, stats, warnings")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    ragspec: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ragspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- ragspec's own endpoints -------------------------------------------------------------------------------
class Turn(_Strict):
    role: Literal["user", "assistant"]
    content: str


class AskRequest(_Strict):
    question: str = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    history: list[Turn] = Field(default_factory=list, description="earlier turns, first a user turn")
    filter: dict | list[str] | str | None = None  # metadata filter for retrieval, as in /v1/search


class SearchRequest(_Strict):
    query: str = Field(min_length=1)
    k: int = Field(5, ge=1, le=100)
    filter: dict | list[str] | str | None = None  # metadata filter: LangChain's dict shape or --where strings


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
