"""Loading a pipeline's generator: the backend and dtype chosen for this machine (and followed when a guess gives
way to the measured table), the model loaded under the spec's runtime options, its t(n) measured once.

Why apart from `pipeline.py`: what is loaded, when, and in what order (the index's embedder before the
generator, the int8 prompt copies after the one-time t(n) measurement) is one concern, with its own memory
figures (docs/models.md), beside the asking that `Pipeline` does.
"""

from __future__ import annotations

import time

from ragspec import activity
from ragspec.errors import RagspecError, loading
from ragspec.runtime.options import options_in_effect

GUESS_RECHECK_S = 10.0  # a pipeline on a guessed backend looks this often (between asks) for the measured table


class GeneratorLoading:
    """`Pipeline`'s loading (a mixin: it reads the pipeline's spec, index and caches)."""

    def load(self, progress=None) -> GeneratorLoading:
        """Load the index's embedder and the generator (and measure its forward cost once, when the draft budget is
        'auto'). With `generator.backend` / `dtype` auto on a CPU, the backend and dtype are the fastest measured
        on this machine for this pipeline's ask shape (measured once per machine). `progress(line)` hears about
        the choice and about the one-time measurement of the forward cost. A failure is a LoadError."""
        with loading():
            return self._load(progress)

    def _load(self, progress=None) -> GeneratorLoading:
        with self._load_lock, activity.busy("loading a generator"):
            if self._model is not None and self.choice is not None and self.choice.guessed:
                self._follow_measurement(progress)
            if self._model is None:
                from ragspec.models.registry import check_generator

                check_generator(self.spec.generator.model)  # before the embedder's seconds
                if self._index_arg is not None:
                    # the index's embedder first: its load's passing float32 weights then come before the
                    # generator's are resident, not on top of them (the 0.5B's first ask peaked 0.1 GB higher)
                    _ = self.retriever.embedder
                from ragspec.machine.table import resolve
                from ragspec.models.generator import shared_generator

                g, method = self.spec.generator, self.spec.drafting.method
                choosing = None if progress is None else (lambda line: progress(f"choosing a backend: {line}"))
                with options_in_effect(self.runtime_options):  # the machine table's key names them
                    self.choice = resolve(g, self.device, self.expected_prompt_tokens(),
                                          self.expected_answer_tokens(), method, progress=choosing,
                                          source_cache=self.source_cache_on())
                from ragspec.machine.table import needs_transformers

                if self.choice.backend == "llama.cpp" and needs_transformers(method):
                    raise RagspecError(f"drafting {method} needs hidden states, attention rows, every tree row's "
                                       "prediction or the model's bigram, which the llama.cpp backend does not "
                                       "give: use pld, trie, suffix or none")
                self._model, self._tokenizer = shared_generator(g.model, self.device, self.choice.dtype,
                                                                self.choice.backend, self.runtime_options)
            elif self.choice is None:
                self.choice = given_choice(self._model)
            if self._tokenizer is None:
                raise RagspecError("a model was given without its tokenizer")
            if self._cost is None and self.spec.drafting.budget == "auto" and self.spec.drafting.method != "none":
                from ragspec.decoding.backends import calibrate

                self._cost = calibrate(self._model, progress=progress)
            if self._settled is not self._model:  # once per model, not at each ask's load()
                from ragspec.runtime.prepare import after_measuring

                after_measuring(self._model)
                self._settled = self._model
        return self

    def _follow_measurement(self, progress=None) -> None:
        """Between asks, a pipeline running on a flag-based guess looks (every `GUESS_RECHECK_S`) for this
        machine's measured table; where it prefers another backend or dtype, that one is loaded for the next
        ask and whatever was tied to the old model (its t(n), learned acceptance, cached KV) is dropped."""
        from ragspec.machine.table import resolve

        now = time.monotonic()
        if now - self._guess_checked < GUESS_RECHECK_S:
            return
        self._guess_checked = now
        with options_in_effect(self.runtime_options):
            choice = resolve(self.spec.generator, self.device, self.expected_prompt_tokens(),
                             self.expected_answer_tokens(), self.spec.drafting.method,
                             source_cache=self.source_cache_on())
        if choice.guessed:
            return
        if choice[:2] == self.choice[:2]:
            self.choice = choice
            return
        say = progress or (lambda line: None)
        say(f"this machine is measured now: {choice.backend}/{choice.dtype} instead of the guessed "
            f"{self.choice.backend}/{self.choice.dtype} ({choice.reason}); loading it")
        self._model = self._tokenizer = None
        self._cost, self._rates, self._calibration, self._source_store = None, None, None, None
        self._prompts, self._gate = None, False  # the gate's band may belong to the old model's prompt copy
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def expected_prompt_tokens(self) -> int:
        """The prompt length an ask will likely have, for choosing a backend: top_n sources of a chunk each
        (less the overlap merged away) plus ~150 tokens of instruction, numbering and question."""
        ix = self.spec.index
        return self.spec.retriever.top_n * (ix.chunk_tokens - ix.overlap) + 150

    def expected_answer_tokens(self) -> int:
        """The answer length a backend is chosen for: max_new_tokens is a cap, and measured answers run far
        shorter (`machine.EXPECTED_ANSWER_TOKENS`)."""
        from ragspec.machine.table import EXPECTED_ANSWER_TOKENS

        return min(self.spec.generator.max_new_tokens, EXPECTED_ANSWER_TOKENS)


def given_choice(model):
    """What runs a model handed to the pipeline (nothing was chosen)."""
    from ragspec.decoding.backends import is_llama
    from ragspec.machine.table import Choice

    if is_llama(model):
        return Choice("llama.cpp", "gguf", "a loaded model was given")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if hasattr(model, "parameters") else ""
    return Choice("transformers", dtype, "a loaded model was given")
