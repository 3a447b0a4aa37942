"""LangChain integration: ragspec as an LLM (`RagspecLLM`), a chat model (`ChatRagspec`) and a retriever
(`RagspecRetriever`).

Each wraps a `ragspec.Pipeline`; the model and index behind it load once per process and are shared by every
object that names them (LangChain builds these objects freely). With a prompt that already holds the
documents, drafts and citations come from the prompt itself; `RagspecLLM(index=...)` retrieves instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import LLM, BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.retrievers import BaseRetriever
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ragspec.models.registry import DEFAULT_GENERATOR
from ragspec.pipeline import Answer, DoneEvent, Pipeline, TextEvent

_pipelines: dict[str, Pipeline] = {}
_lock = threading.Lock()


def _shared_pipeline(spec: dict, index: str | None) -> Pipeline:
    """One Pipeline per (spec, index) in this process; its generator is shared across specs too."""
    import json

    key = json.dumps([spec, index], sort_keys=True, default=str)
    with _lock:
        if key not in _pipelines:
            _pipelines[key] = Pipeline(spec, index)
        return _pipelines[key]


class _RagspecModelMixin(BaseModel):
    """Fields shared by the LLM and the chat model, and how they become a pipeline spec."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = DEFAULT_GENERATOR
    temperature: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    drafting: str = "suffix"
    budget: int | str = "auto"
    seed: int | None = None
    device: str = "auto"
    index: str | None = None
    pipeline_spec: Any = None
    pipeline: Pipeline | None = Field(default=None, exclude=True)
    timeout: float | None = None
    max_retries: int = 0
    _pipe: Pipeline | None = PrivateAttr(default=None)

    def _spec(self, model: str | None = None) -> dict:
        spec: dict = {
            "generator": {"model": model or self.model, "device": self.device, "max_new_tokens": self.max_tokens or 256,
                          "temperature": self.temperature or 0.0},
            "drafting": {"method": self.drafting, "budget": self.budget},
        }
        if self.seed is not None:
            spec["generator"]["seed"] = self.seed
        if self.pipeline_spec:
            from ragspec.spec import load_spec

            base = load_spec(self.pipeline_spec).model_dump()
            for section, values in spec.items():
                base[section].update(values)
            spec = base
        return spec

    def _pipeline(self, model: str | None = None) -> Pipeline:
        """The pipeline for this object's settings (`model`: a per-call override of the generator)."""
        if model and model != self.model:
            return _shared_pipeline(self._spec(model), self.index)
        if self._pipe is None:
            self._pipe = self.pipeline or _shared_pipeline(self._spec(), self.index)
        return self._pipe

    def _stop(self, stop: list[str] | None) -> list[str]:
        return list(self.stop or []) + list(stop or [])


_FIELDS_DOC = """
    model: embedded name, HF id or folder of the generator (default the quickstart's Qwen2.5-Coder-0.5B).
    temperature: 0 = greedy (identical to plain greedy decoding); > 0 samples the model's distribution exactly
    (None: the pipeline's, 0 by default). max_tokens: answer budget in tokens (None: the pipeline's, 256). stop: stop strings. drafting: none | pld | trie | suffix | pldplus-h.
    index: an index to retrieve from (LLM only); pipeline_spec: a pipeline YAML/dict for everything else.
    timeout / max_retries: accepted for LangChain's standard parameters; a local model has neither.
"""


class RagspecLLM(_RagspecModelMixin, LLM):
    __doc__ = "ragspec as a text-completion LLM." + _FIELDS_DOC


    @property
    def _llm_type(self) -> str:
        return "ragspec"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "drafting": self.drafting, "index": self.index}

    def _events(self, prompt: str, stop: list[str] | None, **kwargs: Any):
        pipe = self._pipeline(kwargs.get("model"))
        args = {"max_new_tokens": kwargs.get("max_tokens") or self.max_tokens, "stop": self._stop(stop),
                "temperature": kwargs.get("temperature", self.temperature), "cancel": kwargs.get("cancel")}
        if self.index or (self.pipeline is not None and self.pipeline._index_arg is not None):
            return pipe.stream(prompt, **args)
        return pipe.stream_prompt(prompt, **args)

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return "".join(chunk.text for chunk in self._stream(prompt, stop, run_manager, **kwargs))

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        """Like `LLM._generate`, keeping each answer's citations and stats in `generation_info`. Several prompts
        (LangChain's `batch`) run at once where the pipeline runs generations together (`generator.parallel`):
        their steps share forwards, each answer the one it gets alone."""

        def one(prompt: str) -> list[Generation]:
            full = None
            for chunk in self._stream(prompt, stop, run_manager, **kwargs):
                full = chunk if full is None else full + chunk
            return [Generation(text=full.text, generation_info=full.generation_info)]

        pipe = self._pipeline(kwargs.get("model"))
        workers = min(len(prompts), pipe.spec.generator.parallel)
        if workers <= 1 or pipe.step_batcher is None:
            return LLMResult(generations=[one(p) for p in prompts])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers, thread_name_prefix="ragspec-batch") as pool:
            return LLMResult(generations=list(pool.map(one, prompts)))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        for ev in self._events(prompt, stop, **kwargs):
            if isinstance(ev, TextEvent) and ev.text:
                chunk = GenerationChunk(text=ev.text)
                if run_manager:
                    run_manager.on_llm_new_token(ev.text, chunk=chunk)
                yield chunk
            elif isinstance(ev, DoneEvent):
                yield GenerationChunk(text="", generation_info=_answer_info(ev.answer))


class ChatRagspec(_RagspecModelMixin, BaseChatModel):
    __doc__ = ("ragspec as a chat model: messages rendered with the model's chat template; drafts and citations "
               "come from the messages (put the retrieved documents in them)." + _FIELDS_DOC)

    streaming: bool = False

    @property
    def _llm_type(self) -> str:
        return "ragspec-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "drafting": self.drafting}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="ragspec", ls_model_name=kwargs.get("model") or self.model,
                                 ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature or 0.0))
        if self.max_tokens:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = self._stop(stop)
        return params

    def _events(self, messages: list[BaseMessage], stop: list[str] | None, **kwargs: Any):
        return self._pipeline(kwargs.get("model")).stream_prompt(
            [_to_chat(m) for m in messages], max_new_tokens=kwargs.get("max_tokens") or self.max_tokens,
            stop=self._stop(stop), temperature=kwargs.get("temperature", self.temperature),
            cancel=kwargs.get("cancel"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        answer = None
        for ev in self._events(messages, stop, **kwargs):
            if isinstance(ev, TextEvent) and ev.text and run_manager:
                run_manager.on_llm_new_token(ev.text)
            elif isinstance(ev, DoneEvent):
                answer = ev.answer
        msg = AIMessage(content=answer.text, response_metadata=self._metadata(answer, kwargs.get("model")),
                        usage_metadata=_usage(answer))
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for ev in self._events(messages, stop, **kwargs):
            if isinstance(ev, TextEvent) and ev.text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=ev.text))
                if run_manager:
                    run_manager.on_llm_new_token(ev.text, chunk=chunk)
                yield chunk
            elif isinstance(ev, DoneEvent):
                yield ChatGenerationChunk(message=AIMessageChunk(
                    content="", response_metadata=self._metadata(ev.answer, kwargs.get("model")),
                    usage_metadata=_usage(ev.answer),
                    chunk_position="last"))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        from ragspec.pipeline.aio import iterate_in_thread

        cancel = threading.Event()  # set when the consumer stops reading: the generation stops too
        chunks = iterate_in_thread(lambda: self._stream(messages, stop, None, cancel=cancel, **kwargs), cancel)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _metadata(self, answer: Answer, model: str | None = None) -> dict:
        return {"model_name": model or self.model, "finish_reason": answer.stats.finish_reason,
                "citations": [c.as_json() for c in answer.citations], "stats": answer.stats.as_json()}


class RagspecRetriever(BaseRetriever):
    """Search a ragspec index: `k` chunks as Documents (metadata: source path, chunk id, char start/end, score).

    `k` is a constructor argument and a per-call override: `retriever.invoke(query, k=3)`. So is a metadata
    filter, in LangChain's usual shape: `search_kwargs={"k": 3, "filter": {"path": "tutorial/*", "year":
    {"$gte": 2020}}}` or `invoke(query, filter=...)`; it is applied inside the search, not after it.
    `search_kwargs={"diversity": 0.5}` (or `search_type="mmr"`, diversity 0.5 unless given) turns on MMR."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    index: str
    k: int = 5
    mode: str = "hybrid"
    search_type: str = "similarity"
    search_kwargs: dict = Field(default_factory=dict)
    _retriever: Any = PrivateAttr(default=None)

    def _backend(self):
        if self._retriever is None:
            self._retriever = _shared_retriever(self.index, self.mode)
        return self._retriever

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, filter: Any = None) -> list[Document]:
        kw = self.search_kwargs
        unknown = set(kw) - {"k", "filter", "diversity", "fetch_k", "lambda_mult"}
        if unknown:
            raise ValueError(f"unknown search_kwargs key '{sorted(unknown)[0]}' (k, filter, diversity)")
        diversity = kw.get("diversity")
        if diversity is None and "lambda_mult" in kw:
            diversity = 1.0 - float(kw["lambda_mult"])  # LangChain's MMR weight of relevance
        if diversity is None and self.search_type == "mmr":
            diversity = 0.5
        hits = self._backend().search(query, top_n=k or kw.get("k") or self.k,
                                      filter=filter if filter is not None else kw.get("filter"), diversity=diversity)
        return [Document(page_content=h.text, id=str(h.chunk_id),
                         metadata={"source": h.path, "chunk_id": h.chunk_id, "start": h.start, "end": h.end,
                                   "score": h.score, "rank": h.rank, "title": h.title, "key": h.key,
                                   "locations": [{"source": loc.path, "key": loc.key, "start": loc.start, "end": loc.end}
                                                 for loc in h.locations]})
                for h in hits]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None, filter: Any = None) -> list[Document]:
        import asyncio

        return await asyncio.to_thread(self._get_relevant_documents, query, run_manager=run_manager, k=k,
                                       filter=filter)


_retrievers: dict[tuple[str, str], Any] = {}


def _shared_retriever(index: str, mode: str):
    from ragspec.retrieve.retriever import Retriever
    from ragspec.settings import RetrieverSettings

    with _lock:
        key = (str(index), mode)
        if key not in _retrievers:
            _retrievers[key] = Retriever(str(index), RetrieverSettings(mode=mode))
        return _retrievers[key]


# -- helpers ---------------------------------------------------------------------------------------------------
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}


def _to_chat(m: BaseMessage) -> dict:
    role = m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, "user")
    return {"role": role, "content": m.text if not isinstance(m.content, str) else m.content}


def _usage(answer: Answer) -> UsageMetadata:
    s = answer.stats
    return UsageMetadata(input_tokens=s.prompt_tokens, output_tokens=s.new_tokens,
                         total_tokens=s.prompt_tokens + s.new_tokens)


def _answer_info(answer: Answer) -> dict:
    return {"citations": [c.as_json() for c in answer.citations], "stats": answer.stats.as_json(),
            "sources": [{"source": s.number, "path": s.path, "start": s.start, "end": s.end, "score": s.score}
                        for s in answer.sources]}
