"""The draft-and-verify loop: prefill once, then per step draft a tree, verify it in one forward, append
the accepted tokens (each with its provenance) and stream text deltas, until eos, a stop string or
max_new_tokens — never emitting past any of them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from ragspec.decoding.backends import make_backend
from ragspec.decoding.budget import AdaptiveBudget, settle
from ragspec.decoding.drafters.base import Drafter, DraftState, NoDraft, Segment
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.stream import IncrementalDecoder
from ragspec.decoding.tree import DraftTree
from ragspec.errors import check_cancel
from ragspec.runtime.prompt_mode import reads_by_role


@dataclass
class Delta:
    """A piece of streamed answer text and the tokens that made it.

    `sources[i]` is the context position token `tokens[i]` was copied from (-1: made by the model itself).
    `text` may be empty when a token completes no character yet.
    """

    text: str
    tokens: list[int]
    sources: list[int]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    accepted_draft_tokens: int = 0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_ms: float = 0.0
    tree_nodes: int = 0
    step_ms: dict = field(default_factory=dict)  # verify time by part: inputs (ids, positions, mask), forward, accept, trim
    accepted_lengths: list[int] = field(default_factory=list)  # tokens per step, bonus included
    finish_reason: str = ""

    @property
    def mean_accepted(self) -> float:
        """Tokens per verification step, the bonus token included (the papers' 'acceptance length')."""
        return self.new_tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted"] = round(self.mean_accepted, 4)
        d["decode_tokens_per_s"] = round(self.new_tokens / (self.decode_ms / 1000), 3) if self.decode_ms else 0.0
        return d


class SpeculativeGenerator:
    """Runs one generation at a time for a model + drafter. Not thread-safe: one per thread or a lock."""

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, sampling: SamplingSettings | None = None,
                 max_new_tokens: int = 128, stop_strings: tuple[str, ...] = (), eos_token_ids=None,
                 budget: int | AdaptiveBudget = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDraft()
        self.sampling = sampling or SamplingSettings()
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.eos = set(_eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids)
        self.budget = budget
        self.stats = GenerationStats()
        self.tokens: list[int] = []
        self._batcher = None  # the StepBatcher this generation's steps go through, if any
        self._reader = None  # this generation's key among the prompt tree's readers while it reads its prompt
        self._waits = False  # it waits for a request ahead reading more of its prompt (`stream` decides)

    def generate(self, prompt_ids: list[int], segments: list[Segment] | None = None) -> str:
        return "".join(d.text for d in self.stream(prompt_ids, segments))

    def stream(self, prompt_ids: list[int], segments: list[Segment] | None = None, prefix=None, cancel=None,
               on_progress=None, sources=None, batcher=None) -> Iterator[Delta]:
        """`batcher`: a `step_batcher.StepBatcher` of this model: the steps share forwards with other
        generations running on other threads, the prompt is read in turns with their steps (a backend that
        cannot batch takes the model for the whole generation instead).
        `prefix`: a `prefix_cache.PrefixStore` or `PromptTree` to prefill from and to leave this generation's
        cache in.
        `sources`: a `source_cache.SourcePlan`: assemble the prompt's cache from cached source pieces.
        `cancel`: a threading.Event; once set, the generation raises `Cancelled` between prefill chunks or
        decode steps. `on_progress(done, total)`: called after each prefill chunk."""
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.tokens = []
        heads = tuple(getattr(self.drafter, "attention_heads", ()) or ())
        verifier = make_backend(self.model, self.sampling, hidden_layer=self.drafter.hidden_layer,
                                attention_heads=heads,
                                predictions=bool(getattr(self.drafter, "wants_predictions", False)), batcher=batcher)
        if not getattr(verifier, "supports_prefix", True):
            prefix = None  # a prefix store holds transformers caches
        self._batcher = batcher if getattr(verifier, "batcher", None) is not None else None
        holds_model = batcher is not None and self._batcher is None
        whole = batcher.exclusive() if holds_model else contextlib.nullcontext()
        # a request ahead reading more of this prompt: read that part from the tree once it is stored (not while
        # this generation holds the model, which that request's reading needs)
        self._waits = prefix is not None and prefix.copies and not holds_model \
            and self.drafter.hidden_layer is None and not heads
        try:
            with whole:  # a backend that cannot batch has the model to itself
                yield from self._loop(verifier, prompt_ids, segments, stats, heads, prefix, cancel, on_progress,
                                      sources)
            if prefix is not None:
                prefix.save(list(prompt_ids) + self.tokens, verifier.cache, self._kept(verifier, prompt_ids))
        finally:
            self._done_reading(prefix)  # cancelled or failed before its prompt was stored: nobody waits for it
            verifier.close()

    def _done_reading(self, prefix) -> None:
        """This generation no longer reads a prompt that others wait for (stored, cancelled or failed)."""
        if self._reader is not None:
            prefix.done_reading(self._reader)
            self._reader = None

    def _kept(self, verifier, prompt_ids) -> int:
        """Positions of the verifier's cache a prefix store may keep. A model that reads prompts by role read the
        positions from the prompt's last token on as steps, where a later prompt holding them reads them as
        prompt: only those before it are kept."""
        return min(verifier.cached, len(prompt_ids) - 1) if reads_by_role(self.model) else verifier.cached

    def _loop(self, verifier, prompt_ids, segments, stats, heads, prefix=None, cancel=None,
              on_progress=None, sources=None) -> Iterator[Delta]:
        kw = {"sources": sources} if sources is not None else {}
        if self._waits:
            with self._batcher.aside() if self._batcher is not None else contextlib.nullcontext():
                self._reader = prefix.wait_for_readers(prompt_ids, len(prompt_ids) - 1, cancel)
        stats.prefill_ms = verifier.prefill(list(prompt_ids), prefix, on_progress=on_progress, cancel=cancel, **kw)
        if prefix is not None and prefix.copies:
            # the prompt is stored as soon as it is read (a store that copies): a request arriving while this one
            # answers reads the prefix they share from here instead of reading it again
            prefix.save(list(prompt_ids), verifier.cache, self._kept(verifier, prompt_ids))
            self._done_reading(prefix)
        state = DraftState(tokens=list(prompt_ids), prompt_len=len(prompt_ids), segments=segments or [])
        t0 = time.perf_counter()
        self.drafter.prepare(state)
        stats.draft_ms += (time.perf_counter() - t0) * 1000
        out = _Emitter(self.tokenizer, self.eos, self.stop_strings)
        t_decode = time.perf_counter()
        # greedy, with the root's logits kept by the prefill: the first answer token is known before any step
        known = verifier.known_next()
        batcher = self._batcher
        with batcher.decoding_phase() if batcher is not None else contextlib.nullcontext():
            yield from self._steps(verifier, state, stats, heads, out, known, batcher, cancel)
        stats.decode_ms = (time.perf_counter() - t_decode) * 1000

    def _steps(self, verifier, state, stats, heads, out, known, batcher, cancel) -> Iterator[Delta]:
        pending: list[tuple[DraftTree, int]] = []  # proposals whose outcome is not yet known
        while True:
            remaining = self.max_new_tokens - stats.new_tokens
            if remaining <= 0:
                stats.finish_reason = "length"
                break
            check_cancel(cancel)
            t = time.perf_counter()
            if self.drafter.hidden_layer is not None:
                state.hidden = verifier.hidden_states()
            if heads:
                state.attention = verifier.attention_row()
            adaptive = isinstance(self.budget, AdaptiveBudget)
            cap = self.budget.max_nodes if adaptive else int(self.budget)
            sharers = batcher.sharers() if batcher is not None else 1  # generations whose steps share a forward
            if not adaptive and sharers > 1:  # a fixed budget's rows are split between them
                cap = max(0, (cap + 1) // sharers - 1)
            # the adaptive budget learns from the whole proposal, not just the part verified now: how deep it
            # would have been accepted is read off the tokens that follow (else a small cap could never grow)
            full = self.drafter.propose(state, max(0, min(cap, remaining - 1)))
            first, known = known, None
            early = first is not None and first not in self.eos
            tree = self.budget.select(full, sharers) if adaptive else full.truncated(max(0, cap))
            stats.draft_ms += (time.perf_counter() - t) * 1000
            if early:  # stream it now, before the step's forward: the wait for the first token is the prefill's
                node = tree.child(-1, first)
                deltas, stopped = out.push([first], [tree.sources[node] if node is not None else -1])
                yield from deltas
                if stopped:
                    stats.new_tokens += 1
                    self.tokens.append(first)
                    stats.finish_reason = "stop"
                    break
            res = verifier.step(tree)
            if adaptive:
                pending.append((full, len(self.tokens)))
            stats.verify_ms += res.verify_ms
            for part, ms in res.timings.items():
                stats.step_ms[part] = stats.step_ms.get(part, 0.0) + ms
            stats.steps += 1
            stats.tree_nodes += res.tree_size
            toks, srcs = res.tokens[:remaining], res.sources[:remaining]
            finish = ""
            for i, tok in enumerate(toks):
                if tok in self.eos:
                    toks, srcs, finish = toks[: i + 1], srcs[: i + 1], "eos"
                    break
            if early and toks[0] != first:
                raise RuntimeError(f"the {verifier.name} backend's first step disagrees with its prefill's logits")
            stats.accepted_lengths.append(len(toks))
            stats.accepted_draft_tokens += min(res.accepted, len(toks))
            stats.new_tokens += len(toks)
            self.tokens.extend(toks)
            state.tokens.extend(toks)
            if adaptive:
                pending = settle(self.budget, pending, self.tokens, final=False)
            state.tree, state.predictions = tree, res.predictions
            t = time.perf_counter()
            self.drafter.update(state, toks)
            stats.draft_ms += (time.perf_counter() - t) * 1000
            deltas, stopped = out.push(toks[1:] if early else toks, srcs[1:] if early else srcs)
            yield from deltas
            if stopped:
                stats.finish_reason = "stop"
                break
            if finish:
                stats.finish_reason = finish
                break
        if isinstance(self.budget, AdaptiveBudget):
            settle(self.budget, pending, self.tokens, final=True)
        if stats.finish_reason != "stop":
            tail, stopped = out.finish()
            if stopped:
                stats.finish_reason = "stop"
            if tail is not None:
                yield tail


class _Emitter:
    """Accepted tokens to text deltas: text that could start a stop string is held back, and nothing past a
    stop string is ever emitted."""

    def __init__(self, tokenizer, eos: set, stop_strings: tuple[str, ...]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.eos, self.stops = eos, stop_strings
        self.held = ""  # text withheld because it could be the start of a stop string
        self.tokens: list[int] = []
        self.sources: list[int] = []

    def push(self, toks: list[int], srcs: list[int]) -> tuple[list[Delta], bool]:
        """The deltas `toks` complete, and whether a stop string ended the answer."""
        self.held += self.decoder.push([tk for tk in toks if tk not in self.eos])
        self.tokens += toks
        self.sources += srcs
        if self.stops:
            cut = _find_stop(self.held, self.stops)
            if cut is not None:
                out = [Delta(self.held[:cut], self.tokens, self.sources)] if self.held[:cut] else []
                self.held = ""
                return out, True
            keep = _stop_prefix_len(self.held, self.stops)
            emit, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        else:
            emit, self.held = self.held, ""
        if emit or (not self.held and self.tokens):
            out = [Delta(emit, self.tokens, self.sources)]
            self.tokens, self.sources = [], []
            return out, False
        return [], False

    def finish(self) -> tuple[Delta | None, bool]:
        """The last delta (held text, the decoder's rest), if any, and whether a stop string cut it."""
        tail, stopped = self.held + self.decoder.flush(), False
        if self.stops:
            cut = _find_stop(tail, self.stops)
            if cut is not None:
                tail, stopped = tail[:cut], True
        self.held = ""
        return (Delta(tail, self.tokens, self.sources) if tail or self.tokens else None), stopped


def _find_stop(text: str, stops) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
