"""`Pipeline`: retrieve → the steps after retrieval (relevance gate, source budget) → build the prompt →
draft-and-verify generation → citations, streamed.

Models and the index load once per pipeline (a generator once per process, shared by the pipelines that
name it) and are reused by every call. Calls from several threads are safe: retrieval runs concurrently,
prompt building and generation queue on the model's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ragspec import activity
from ragspec.decoding.drafters import check_params, make_drafter
from ragspec.decoding.sampling import SamplingSettings
from ragspec.errors import RagspecError
from ragspec.pipeline.aio import iterate_in_thread
from ragspec.pipeline.answer import (
    Answer,
    AnswerStats,
    CitationEvent,
    DoneEvent,
    Event,
    SourcesEvent,
    TextEvent,
)
from ragspec.pipeline.attribution import CopyMatcher
from ragspec.pipeline.declined import is_declined
from ragspec.pipeline.loading import GeneratorLoading
from ragspec.pipeline.prompt import (
    NO_DECLINE,
    BuiltPrompt,
    PromptBuilder,
    SourceText,
    as_sources,
    prompt_as_source,
)
from ragspec.pipeline.source_cache import SourceCacheMixin
from ragspec.retrieve.relevance import is_task_on_sources
from ragspec.retrieve.steps import Query, run_steps
from ragspec.runtime.options import runtime_options
from ragspec.spec import PipelineSpec, load_spec


@dataclass
class Prepared:
    """An ask up to generation (`Pipeline.prepare`): the prompt, the sources it holds, the retrieval time, the
    relevance gate's score (None where it did not apply) and whether the gate declined."""

    built: BuiltPrompt
    sources: list[SourceText]
    retrieval_ms: float
    relevance: float | None
    declined: bool


class Pipeline(GeneratorLoading, SourceCacheMixin):
    def __init__(self, spec: PipelineSpec | dict | str | Path | None = None, index=None, *, model=None,
                 tokenizer=None):
        """`index`: a path to a built index, an opened `Index` or a `Retriever` (default: `retriever.index`
        of the spec). `model`/`tokenizer`: an already loaded generator to use instead of `generator.model`."""
        self.spec = load_spec(spec)
        try:
            check_params(self.spec.drafting.method, self.spec.drafting.params)
        except ValueError as exc:
            raise RagspecError(f"drafting.params: {exc}") from None
        self._index_arg = index if index is not None else self.spec.retriever.index
        self._retriever = None
        self._model, self._tokenizer = model, tokenizer
        self._cost = None
        self._rates: list[float] | None = None  # per-rank draft acceptance learned over this pipeline's answers
        self._calibration = None  # scored drafts' acceptance by confidence, learned likewise
        self._memory = None  # earlier answers the suffix drafter may copy (drafting.memory)
        self._gate = False  # the relevance gate (prompt.relevance_floor), resolved on first use; None: off
        self._scorer = None  # retrieve.windows.WindowScorer: the gate's and the budget's window cosines
        self.prefix_cache = None  # a decoding.prefix_cache.PrefixStore: follow-ups reuse the KV of shared prefixes
        self._prompts = None  # decoding.prefix_cache.PromptTree: earlier prompts' KV, reused where that is exact
        self._source_store = None  # decoding.source_cache.SourceKVStore (generator.source_cache), made on first use
        self.choice = None  # models.machine.Choice: the backend and dtype `load` took, and why
        self._guess_checked = time.monotonic()  # when a guessed choice last looked for the measured table
        self._load_lock = threading.RLock()
        # the runtime's options: the spec's generator.runtime, the environment's overrides over it (built once)
        self.runtime_options = runtime_options(self.spec.generator.runtime.model_dump())
        self._settled = None  # the model whose prompt copies were made after its load (`loading.py`)

    @classmethod
    def from_spec(cls, spec: PipelineSpec | dict | str | Path | None = None, index=None, **kwargs) -> Pipeline:
        return cls(spec, index, **kwargs)

    # -- parts, loaded once ----------------------------------------------------------------------------------
    @property
    def decline(self) -> str:
        """The decline phrasing: `prompt.decline`, or with `auto` the generator's measured best (registry)."""
        d = self.spec.prompt.decline
        if d != "auto":
            return d
        from ragspec.models.registry import generator_entry

        entry = generator_entry(self.spec.generator.model)
        return (entry.extra.get("decline") if entry else None) or "last_resort"

    @property
    def device(self) -> str:
        d = self.spec.generator.device
        if d == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return d

    @property
    def retriever(self):
        with self._load_lock:
            if self._retriever is None:
                from ragspec.index.reader import Index
                from ragspec.retrieve.retriever import Retriever

                arg = self._index_arg
                if arg is None:
                    raise RagspecError("this pipeline has no index: pass index=PATH or set retriever.index in the spec")
                if isinstance(arg, Retriever):
                    self._retriever = arg
                else:
                    idx = arg if isinstance(arg, Index) else Index(arg, device=self.spec.index.device)
                    self._retriever = Retriever(idx, self.spec.retriever, device=self.spec.index.device)
            return self._retriever

    @property
    def model(self):
        return self.load()._model

    @property
    def _gen_lock(self) -> threading.Lock:
        """Generation queues on the model: pipelines sharing one model share this lock."""
        from ragspec.models.generator import model_lock

        return model_lock(self.model)

    @property
    def step_batcher(self):
        """The model's `StepBatcher` where generations may run together (`generator.parallel` > 1 and a backend
        that batches steps), else None."""
        if self.spec.generator.parallel <= 1:
            return None
        from ragspec.decoding.backends import step_batcher

        return step_batcher(self.model, self._gen_lock)

    @property
    def tokenizer(self):
        return self.load()._tokenizer

    def prompt_builder(self, max_new_tokens: int, decline: str | None = None) -> PromptBuilder:
        """`decline`: the decline phrasing (default `self.decline`; NO_DECLINE when the relevance gate passed)."""
        p = self.spec.prompt
        budget = p.max_context_tokens
        if budget is None:
            window = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
            budget = window - max_new_tokens if window else None
            if budget is not None and budget < 64:  # else: "the question alone takes 105 tokens, more than -67231"
                raise RagspecError(f"max_new_tokens {max_new_tokens} leaves {max(budget, 0)} tokens of the model's "
                                   f"{window}-token window for the prompt: ask for fewer new tokens")
        return PromptBuilder(self.tokenizer, p.style, p.system, budget, decline=decline or self.decline)

    @property
    def window_scorer(self):
        """What measures the question against the sources' windows for the gate and the budget
        (`retrieve.windows`): the index's embedder and the window vectors it stores, or without an index the
        default embedder (float32)."""
        with self._load_lock:
            if self._scorer is None:
                from ragspec.retrieve.windows import WindowScorer

                if self._index_arg is not None:
                    self._scorer = WindowScorer(lambda: self.retriever.embedder, lambda: self.retriever.index)
                else:
                    from ragspec.models.embedder import load_embedder
                    from ragspec.models.registry import DEFAULT_EMBEDDER

                    self._scorer = WindowScorer(lambda: load_embedder(DEFAULT_EMBEDDER, "cpu", "float32"))
            return self._scorer

    @property
    def relevance_gate(self):
        """The relevance gate of `prompt.relevance_floor` (`retrieve.relevance`), or None when it is off. It
        measures with `window_scorer`; its measured band is the loaded generator's (and its prompt copy's)."""
        with self._load_lock:
            if self._gate is False:
                from ragspec.models.registry import DEFAULT_EMBEDDER
                from ragspec.retrieve.relevance import resolve_gate
                from ragspec.runtime.prompt_mode import prompt_copy

                scorer = self.window_scorer
                name = (self.retriever.index.manifest["embedder"]["requested"] if self._index_arg is not None
                        else DEFAULT_EMBEDDER)
                self._gate = resolve_gate(self.spec.prompt.relevance_floor, lambda: scorer.embedder, name,
                                          self.spec.prompt.relevance_doubt, self.spec.generator.model, scorer,
                                          prompt_copy(self.model))
            return self._gate

    def source_steps(self, budget: int | None) -> list:
        """The steps after retrieval, in order: the relevance gate (when on), then the source budget (`budget`
        tokens; None: sources whole)."""
        steps = [] if self.relevance_gate is None else [self.relevance_gate]
        if budget is not None:
            from ragspec.retrieve.trim import SourceBudget

            tok = self.tokenizer

            def count(texts: list[str]) -> list[int]:
                return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]

            steps.append(SourceBudget(budget, count, self.spec.prompt.source_floor))
        return steps

    # -- retrieval -------------------------------------------------------------------------------------------
    def retrieve(self, question: str, filter=None) -> tuple[list[SourceText], float]:
        """The top-n distinct sources as numbered sources, and the retrieval time in ms. `filter`: a metadata
        filter for this question (default: `retriever.filter` of the spec)."""
        t = time.perf_counter()
        with activity.busy("a search"):
            hits = self.retriever.search(question, filter=filter)
        ms = (time.perf_counter() - t) * 1000
        store = self.retriever.index.store
        out = []
        for h in hits:
            doc = store.document_text(h.document_id)
            first = doc.count("\n", 0, h.start) + 1
            lines = (first, first + doc.count("\n", h.start, max(h.start, h.end - 1)))
            out.append(SourceText(h.rank, h.text, h.path, h.start, h.end, h.title, h.key, h.score, h.chunk_id,
                                  h.document_id, lines, list(h.locations)))
        return out, ms

    # -- answering -------------------------------------------------------------------------------------------
    def enable_prefix_cache(self, capacity: int = 4) -> Pipeline:
        """Keep the KV caches of the last `capacity` generations; a prompt that starts with one of them (a
        follow-up turn over the same sources) prefills only the rest. Greedy output stays the same."""
        from ragspec.decoding.prefix_cache import PrefixStore

        self.prefix_cache = PrefixStore(capacity) if capacity > 0 else None
        return self

    def forget(self) -> None:
        """Drop what earlier asks left for later ones (the tree of earlier prompts, the prefix caches, the answer
        memory): the next ask starts as the first did (benchmarks of distinct questions)."""
        for store in (self._prompts or None, self.prefix_cache, self._memory):
            if store is not None:
                store.clear()

    @property
    def prompt_cache_bytes(self) -> int:
        """Bytes of keys and values the tree of earlier prompts holds now (0 where it is off)."""
        return self._prompts.nbytes if self._prompts else 0

    def _prompt_store(self, model):
        """The tree of earlier prompts (`generator.prompt_cache_mb`), where the model reads a prompt behind a
        reused prefix as the same bits as whole (models.exact_attention.rows_independent: dtypes gguf, int8 and
        bf16 on a CPU); else None."""
        if self._prompts is None:
            from ragspec.decoding.prefix_cache import PromptTree
            from ragspec.runtime.exact_attention import rows_independent

            mb = self.spec.generator.prompt_cache_mb
            self._prompts = PromptTree(mb) if mb > 0 and rows_independent(model) else False
        return self._prompts or None

    def stream(self, question: str, *, documents: Iterable[str | SourceText] | None = None,
               max_new_tokens: int | None = None, stop: Iterable[str] | None = None,
               temperature: float | None = None, seed: int | None = None, history: list[dict] | None = None,
               instructions: str | None = None, filter=None, cancel=None,
               on_progress=None, source_tokens: int | str | None = None,
               source_cache: str | None = None) -> Iterator[Event]:
        """Events: SourcesEvent, then TextEvent and CitationEvent as they happen, then DoneEvent(answer).

        `documents` replaces retrieval with the given passages (strings or SourceText). `history`: earlier turns
        of a conversation ({"role": "user"|"assistant", "content"}, first a user turn); the sources go in the
        first user turn. `instructions` are appended to the system instruction. `filter`: a metadata filter for
        the retrieval (see `Retriever.search`). `cancel`: a threading.Event; once set, the answer stops between
        prefill chunks or decode steps with `Cancelled`. `on_progress(done, total)`: prompt tokens prefilled, after
        each prefill chunk (a long prompt takes seconds). `source_tokens`: this call's source budget (a number,
        "off" or "auto"; default `prompt.source_tokens`). `source_cache`: "on", "off" or "auto" for this call
        (default `generator.source_cache`). `seed`: this call's sampling seed (default `generator.seed`)."""
        t_start = time.perf_counter()
        with activity.busy("an ask"):  # a calibration job stops while it runs
            p = self.prepare(question, documents=documents, history=history, instructions=instructions,
                             filter=filter, max_new_tokens=max_new_tokens, source_tokens=source_tokens)
            max_new = self._max_new(max_new_tokens)
            if p.declined:
                yield from self._declined(question, p.sources, p.retrieval_ms, p.relevance, t_start)
                return
            yield from self._generate(p.built, question, p.retrieval_ms, max_new, stop, temperature, t_start, cancel,
                                      on_progress, p.relevance, self.source_plan(p.built, source_cache), seed)

    def prepare(self, question: str, *, documents: Iterable[str | SourceText] | None = None,
                history: list[dict] | None = None, instructions: str | None = None, filter=None,
                max_new_tokens: int | None = None, source_tokens: int | str | None = None) -> Prepared:
        """Everything before generation, as `stream` does it: the sources (retrieved or given), the relevance
        gate's verdict, the sources cut to the source budget, and the prompt built. The arguments are
        `stream`'s."""
        if not question or not question.strip():
            raise RagspecError("the question is empty")
        if documents is None:
            self.retriever  # noqa: B018 - no index, or a bad path, is one line before the model's seconds
        max_new = self._max_new(max_new_tokens)
        limit = self.spec.prompt.max_question_tokens
        n_question = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        if n_question > limit:
            raise RagspecError(f"the question is {n_question} tokens, over prompt.max_question_tokens ({limit}); "
                               "shorten it or raise the limit")
        batcher = self.step_batcher
        # generations running on this model: the retrieval's embedder takes a turn with their forwards (on a CPU
        # each would slow the other's every core)
        turn = batcher.exclusive if batcher is not None and batcher.generations else contextlib.nullcontext
        with turn():
            if documents is None:
                sources, retrieval_ms = self.retrieve(question, filter)
            else:
                sources, retrieval_ms = as_sources(documents), 0.0
        # the steps judge a conversation's first question; a follow-up keeps that turn's instruction and sources, so
        # its prompt starts with the first turn's (the prefix cache reuses it)
        first = str(history[0].get("content", "")) if history and isinstance(history[0], dict) else question
        on_sources = bool(sources) and not is_task_on_sources(first)
        budget = self.resolve_source_budget(source_tokens, retrieved=documents is None) if on_sources else None
        steps = self.source_steps(budget) if on_sources else []
        query = Query(first, self.window_scorer if steps else None, follow_up=bool(history))
        with turn():
            sources, found = run_steps(steps, query, sources)
        gate, cut = found.get("gate"), found.get("budget")
        declined = gate is not None and gate.declined
        # past the gate a source is about the question: the model is asked to answer, not offered to decline,
        # unless the score is in the gate's unsure band
        decline = NO_DECLINE if gate is not None and not gate.unsure else None
        with self._gen_lock:  # built first: a prompt over the budget is an error, gated or not
            built = self.prompt_builder(max_new, decline).build(question, sources, history, instructions)
        built.source_budget, built.dropped = budget, built.dropped + (cut.dropped if cut else 0)
        relevance = gate.score if gate is not None and not history else None  # a follow-up: judged on the first turn
        return Prepared(built, sources, retrieval_ms, relevance, declined)

    @property
    def source_budget(self) -> int | None:
        """`prompt.source_tokens` resolved: a token count, or None when sources are sent whole."""
        return self.resolve_source_budget()

    def resolve_source_budget(self, value: int | str | None = None, retrieved: bool = True) -> int | None:
        """A source budget (default `prompt.source_tokens`) as a token count, or None when sources are sent
        whole. `auto` takes the budget measured for the generator (registry `source_tokens`; for sources the
        pipeline `retrieved`, `retrieved_source_tokens` where only that was measured to hold), else none."""
        from ragspec.settings import parse_source_tokens

        value = parse_source_tokens(self.spec.prompt.source_tokens if value is None else value)
        if value == "off":
            return None
        if value == "auto":
            from ragspec.models.registry import generator_entry

            entry = generator_entry(self.spec.generator.model)
            extra = entry.extra if entry else {}
            value = extra.get("source_tokens", extra.get("retrieved_source_tokens") if retrieved else None)
        return int(value) if value is not None else None

    def _declined(self, question: str, sources: list[SourceText], retrieval_ms: float, relevance: float,
                  t_start: float) -> Iterator[Event]:
        """The answer when no source reaches the relevance floor: DECLINED, without running the model."""
        from ragspec.pipeline.declined import DECLINED

        yield SourcesEvent(list(sources), [], retrieval_ms)
        ttft = (time.perf_counter() - t_start) * 1000
        yield TextEvent(DECLINED, [], [])
        stats = AnswerStats(retrieval_ms=retrieval_ms, finish_reason="declined", ttft_ms=ttft, relevance=relevance,
                            backend=self.choice.backend if self.choice else "",
                            dtype=self.choice.dtype if self.choice else "")
        yield DoneEvent(Answer(question, DECLINED, [], list(sources), stats, [], declined=True))

    def ask(self, question: str, **kwargs) -> Answer:
        for event in self.stream(question, **kwargs):
            if isinstance(event, DoneEvent):
                return event.answer
        raise RuntimeError("the stream ended without an answer")  # pragma: no cover

    def ask_many(self, questions: Iterable[str], **kwargs) -> list[Answer]:
        """The answers, in order. Where generations run together (`generator.parallel`), up to that many are
        asked at once, their steps sharing forwards; each answer is the one `ask` gives alone."""
        questions = list(questions)
        workers = min(len(questions), self.spec.generator.parallel)
        if workers <= 1 or self.step_batcher is None:
            return [self.ask(q, **kwargs) for q in questions]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers, thread_name_prefix="ragspec-ask") as pool:
            return list(pool.map(lambda q: self.ask(q, **kwargs), questions))

    async def aask(self, question: str, **kwargs) -> Answer:
        return await asyncio.to_thread(self.ask, question, **kwargs)

    async def astream(self, question: str, **kwargs) -> AsyncIterator[Event]:
        """`stream` on a worker thread; events are handed over as they come. Leaving the loop early (or a
        cancelled task) stops the generation at its next prefill chunk or decode step."""
        cancel = kwargs.pop("cancel", None) or threading.Event()
        async with contextlib.aclosing(iterate_in_thread(lambda: self.stream(question, cancel=cancel, **kwargs),
                                                         cancel)) as events:
            async for ev in events:
                yield ev

    def stream_prompt(self, prompt: str | list[dict], *, max_new_tokens: int | None = None,
                      stop: Iterable[str] | None = None, temperature: float | None = None, cancel=None,
                      on_progress=None) -> Iterator[Event]:
        """Generate for a prompt that already holds its documents (a text, sent as one user turn, or chat
        messages); drafts and citations come from the prompt itself (source 1, path '<prompt>')."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        max_new = self._max_new(max_new_tokens)
        with activity.busy("a generation"):
            with self._gen_lock:
                built = prompt_as_source(self.tokenizer, messages)
            yield from self._generate(built, messages[-1]["content"] if messages else "", 0.0, max_new, stop,
                                      temperature, None, cancel, on_progress)

    def _max_new(self, max_new_tokens: int | None) -> int:
        """The answer budget of one call; 0 or less is an error, never silently the default."""
        if max_new_tokens is None:
            return self.spec.generator.max_new_tokens
        if max_new_tokens < 1:
            raise RagspecError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        return int(max_new_tokens)

    def _generate(self, built: BuiltPrompt, question: str, retrieval_ms: float, max_new: int, stop,
                  temperature: float | None, t_start: float | None = None, cancel=None,
                  on_progress=None, relevance: float | None = None, plan=None, seed: int | None = None,
                  ) -> Iterator[Event]:
        from ragspec.decoding.budget import AdaptiveBudget
        from ragspec.decoding.generate import SpeculativeGenerator

        g, d, a = self.spec.generator, self.spec.drafting, self.spec.attribution
        yield SourcesEvent(built.sources, list(built.warnings), retrieval_ms)
        model, tok = self.model, self.tokenizer
        sampling = SamplingSettings(temperature=g.temperature if temperature is None else temperature,
                                    top_k=g.top_k, top_p=g.top_p, seed=g.seed if seed is None else seed)
        params = dict(d.params)
        if d.method in ("suffix", "auto") and d.memory:
            if self._memory is None:
                from ragspec.decoding.memory import AnswerMemory

                self._memory = AnswerMemory(d.memory)
            params["memory"] = self._memory
        with self._gen_lock:  # a drafter may run the model once (PLD+ (a)'s induction heads)
            drafter = make_drafter(d.method, model, tok, **params)
        # the adaptive budget starts from the acceptance learned on earlier answers (short answers end before
        # a fresh estimate settles); it changes speed only, never the output
        if d.budget == "auto" and self._cost:
            from ragspec.decoding.budget import ScoreCalibration

            self._calibration = self._calibration or ScoreCalibration()
            budget = AdaptiveBudget(self._cost, rates=list(self._rates or []), calibration=self._calibration)
        else:
            budget = 64 if d.budget == "auto" else int(d.budget)
        stops = tuple(g.stop) + tuple(stop or ())
        gen = SpeculativeGenerator(model, tok, drafter, sampling, max_new, stops, budget=budget)
        matcher = CopyMatcher(built.sources, a.min_words, a.min_chars, a.disambiguation, a.chars_one_word,
                              question if a.skip_question else None) if a.enabled else None
        parts: list[str] = []
        t_start = time.perf_counter() if t_start is None else t_start
        ttft_ms, reused = 0.0, 0
        batcher = self.step_batcher
        # with a step batcher, generations run together (their steps share forwards, their prompt chunks take
        # turns); without one (llama.cpp, generator.parallel 1) one holds the model at a time
        with batcher.generation(g.parallel) if batcher is not None else self._gen_lock:
            # assembled from the source cache, a prompt's KV is not a whole prefill's: the tree keeps only exact KV
            store = (self._prompt_store(model) if plan is None else None) or self.prefix_cache
            if store is not None:
                store.last_reused = 0
            for delta in gen.stream(built.ids, built.segments, prefix=store, cancel=cancel, on_progress=on_progress,
                                    sources=plan, batcher=batcher):
                if not parts and store is not None:  # the first delta comes right after the prefill
                    reused = store.reused_here
                if not ttft_ms and delta.text:
                    ttft_ms = (time.perf_counter() - t_start) * 1000
                if matcher is not None:
                    for pos in delta.sources:
                        loc = built.locate(pos) if pos >= 0 else None
                        if loc:
                            matcher.hint(*loc)
                parts.append(delta.text)
                yield TextEvent(delta.text, list(delta.tokens), [s >= 0 for s in delta.sources])
                if matcher is not None and delta.text:
                    for c in matcher.feed(delta.text):
                        yield CitationEvent(c)
        if matcher is not None:
            for c in matcher.finish():
                yield CitationEvent(c)
        if isinstance(budget, AdaptiveBudget):
            self._rates = list(budget.rates)
        if self._memory is not None and gen.stats.finish_reason != "stop":
            self._memory.add(built.ids, gen.tokens)
        s = gen.stats
        stats = AnswerStats(
            retrieval_ms=retrieval_ms, prompt_tokens=s.prompt_tokens, prefill_ms=s.prefill_ms, decode_ms=s.decode_ms,
            new_tokens=s.new_tokens, steps=s.steps, mean_accepted=s.mean_accepted, draft_ms=s.draft_ms,
            verify_ms=s.verify_ms, finish_reason=s.finish_reason, drafting=drafter.name,
            decode_tokens_per_s=s.new_tokens / (s.decode_ms / 1000) if s.decode_ms else 0.0,
            speedup_estimate=(s.new_tokens * self._cost.time(1) / s.decode_ms) if self._cost and s.decode_ms else None,
            dropped_sources=built.dropped, ttft_ms=ttft_ms, prefix_reused_tokens=reused,
            backend=self.choice.backend if self.choice else "", dtype=self.choice.dtype if self.choice else "",
            relevance=relevance, source_budget=built.source_budget,
            source_tokens=sum(1 for n in built.token_source if n),
            cache_reused_tokens=plan.reused if plan else 0, cache_stored_tokens=plan.stored if plan else 0,
            cache_computed_tokens=plan.computed if plan else 0,
            cache_note=(plan.fallback or plan.note) if plan else "",
        )
        text = "".join(parts)
        answer = Answer(question, text, list(matcher.citations) if matcher else [], built.sources, stats,
                        list(built.warnings), declined=is_declined(text))
        yield DoneEvent(answer)
