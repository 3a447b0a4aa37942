"""The pipeline's source KV cache: whether it is on for the generator, its store, how a prompt is assembled
from it, and filling it ahead of asks (`ragspec index --kv-cache`). A part of `Pipeline`, kept apart so that
`pipeline.py` holds the ask's path; the cache itself is `decoding/source_cache.py`."""

from __future__ import annotations

from ragspec.errors import RagspecError
from ragspec.pipeline.prompt import NO_DECLINE, BuiltPrompt, SourceText


class SourceCacheMixin:
    """`Pipeline`'s source-cache methods (they read its spec, model, locks, retriever and prompt builder)."""

    def source_cache_on(self, value: str | None = None) -> bool:
        """`generator.source_cache` (or `value`) resolved: auto is on where the generator's registry entry says
        the cache was measured to hold answer quality (`source_cache`), else off."""
        value = self.spec.generator.source_cache if value is None else value
        if value not in ("on", "off", "auto"):
            raise RagspecError(f"source_cache must be on, off or auto, not {value!r}")
        if value == "auto":
            from ragspec.models.registry import generator_entry

            entry = generator_entry(self.spec.generator.model)
            return bool(entry.extra.get("source_cache")) if entry else False
        return value == "on"

    def store_directory(self):
        """Where the source cache keeps entries on disk (None: memory only)."""
        from ragspec.paths import ragspec_home

        return ragspec_home() / "kv" if self.spec.generator.source_cache_disk_mb > 0 else None

    @property
    def source_store(self):
        """The pipeline's source cache (one per pipeline: the server shares it across requests)."""
        with self._load_lock:
            if self._source_store is None:
                from ragspec.decoding.source_cache import SourceKVStore

                g = self.spec.generator
                self._source_store = SourceKVStore(
                    memory_bytes=g.source_cache_memory_mb << 20,
                    directory=self.store_directory(),
                    disk_bytes=g.source_cache_disk_mb << 20)
            return self._source_store

    def source_plan(self, built: BuiltPrompt, value: str | None = None):
        """How `built` is assembled from the source cache, or None (cache off, or a prompt without sources)."""
        if not self.source_cache_on(value) or built.head <= 0 or not built.pieces:
            return None
        from ragspec.decoding.source_cache import SourcePlan

        g = self.spec.generator
        return SourcePlan(self.source_store, built.head, list(built.pieces), g.source_cache_recompute,
                          g.source_cache_blend, g.source_cache_select, g.source_cache_temperature)

    def fill_source_cache(self, texts: list[str] | None = None, on_progress=None, cancel=None) -> int:
        """Compute the source cache's entries ahead of asks: each text (default: every chunk of the index) as a
        whole source under the head an ask past the relevance gate has. Returns the entries computed (those
        already stored are skipped). A merged or budget-cut source is a new piece, filled by the ask that sends
        it. `on_progress(done, total)` after each text."""
        self.load()
        if self.choice is not None and self.choice.backend == "llama.cpp":
            from ragspec.decoding.backends.source_kv_llama import fill, unsupported
        else:
            from ragspec.decoding.backends.source_kv import fill, unsupported
        why = unsupported(self.model)
        if why:
            raise RagspecError(f"the source cache cannot move this model's keys: {why}")
        if texts is None:
            texts = self.retriever.index.store.all_chunk_texts()
        builder = self.prompt_builder(self.spec.generator.max_new_tokens,
                                      NO_DECLINE if self.relevance_gate is not None else None)
        made = 0
        for i, text in enumerate(texts):
            if text.strip():
                built = builder.build("?", [SourceText(1, text)])
                head = built.ids[: built.head]
                with self._gen_lock:
                    made += fill(self.model, self.source_store, head, [built.ids[a:b] for a, b in built.pieces],
                                 cancel, self.spec.generator.source_cache_recompute)
            if on_progress is not None:
                on_progress(i + 1, len(texts))
        return made
