"""`ragspec index --executor ray`: chunking and embedding as one Ray Data stage on an actor pool.

The driver lists and reads the files, writes the SQLite store, builds FAISS and swaps the version in, exactly
as the local executor does (`ragspec.index.builder`); only the new documents' texts travel to the cluster. Each
actor of the pool holds the embedder (and so its tokenizer): it chunks a batch of documents and embeds their
chunks, so every chunk is tokenized once, on the machine that embeds it. Actors that die are restarted and
their batches retried by Ray Data; a build that still fails leaves the previous index as it was. Unlike the
local executor, copies of one text in different batches are each embedded (nothing is shared across actors).
The relevance gate's window vectors (`index.windows`) are pooled by the actors from each chunk's own forward and
travel back with its vector.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ragspec.cluster import connect, require_ray
from ragspec.console import warn
from ragspec.errors import RagspecError
from ragspec.index.builder import Embedded
from ragspec.settings import IndexSettings

DOCS_PER_BATCH = 8  # documents per actor call: small enough to spread a corpus over actors and retry cheaply


class ChunkEmbed:
    """The Ray Data stage: a batch of documents → one row per chunk (document, order, offsets, text, vector)."""

    config: tuple = ()  # (settings dict, device, dtype): set on a per-build subclass in `RayExecutor._run`

    def __init__(self):
        from ragspec.corpus.chunker import ChunkerSettings
        from ragspec.models.embedder import load_embedder

        settings, device, dtype = self.config
        self.settings = IndexSettings(**settings)
        self.embedder = load_embedder(self.settings.embedder, device, dtype, self.settings.chunk_tokens)
        self.chunker = ChunkerSettings(self.settings.chunk_tokens, self.settings.overlap)

    def __call__(self, batch: dict) -> dict:
        from ragspec.corpus.chunker import chunk_text

        doc, order, start, end, tokens, text = [], [], [], [], [], []
        for d, t in zip(batch["doc"], batch["text"]):
            for c in chunk_text(str(t), self.embedder.tokenizer, self.chunker):
                doc.append(int(d))
                order.append(c.order)
                start.append(c.start)
                end.append(c.end)
                tokens.append(c.tokens)
                text.append(c.text)
        vectors, wins = self.embedder.encode_windows(text, self.settings.embed_batch_size)
        windows = np.empty(len(wins), dtype=object)  # one [k, dim] float16 array per chunk
        for k, w in enumerate(wins):
            windows[k] = w.astype(np.float16)
        return {"doc": np.asarray(doc, dtype=np.int64), "order": np.asarray(order, dtype=np.int64),
                "start": np.asarray(start, dtype=np.int64), "end": np.asarray(end, dtype=np.int64),
                "tokens": np.asarray(tokens, dtype=np.int64),
                "text": np.asarray(text, dtype=object), "vector": vectors.reshape(len(text), self.embedder.dim),
                "windows": windows}


class RayExecutor:
    """Chunk and embed on a Ray cluster: `embed_actors` actors, each with `gpus_per_actor` GPUs (0: CPU)."""

    def __init__(self, address: str | None = None, embed_actors: int = 1, gpus_per_actor: float = 0.0,
                 num_cpus: int | None = None):
        if embed_actors < 1:
            raise RagspecError(f"--embed-actors must be at least 1 (got {embed_actors})")
        if gpus_per_actor < 0:
            raise RagspecError(f"--gpus-per-actor must be 0 or more (got {gpus_per_actor})")
        require_ray()
        self.address, self.embed_actors, self.gpus_per_actor, self.num_cpus = (address, embed_actors,
                                                                              gpus_per_actor, num_cpus)
        self.connect_seconds = 0.0

    def chunk_embed(self, texts: list[str], settings: IndexSettings, show_progress: bool = True) -> Embedded:
        from ragspec.models.registry import lookup

        if not texts:
            return Embedded([], np.zeros((0, 0), dtype=np.float32))
        device = "cuda" if self.gpus_per_actor > 0 else settings.device
        dtype = settings.embed_dtype
        if dtype == "auto":  # decided here, as the local build does, so incremental builds agree on it
            from ragspec.models.embedder import best_cpu_dtype

            dtype = best_cpu_dtype() if device == "cpu" else "float16"
        known = lookup(settings.embedder, "embedder")
        name = known.name if known is not None else settings.embedder
        t0 = time.perf_counter()
        started = connect(self.address, self.num_cpus)
        self.connect_seconds = time.perf_counter() - t0  # cluster start (or join): reported by the benchmark
        try:
            self._check_resources()
            rows = self._run(texts, settings, device, dtype, show_progress)
        finally:
            if started:
                import ray

                ray.shutdown()
        return _assemble(len(texts), rows, name, dtype)

    def _check_resources(self) -> None:
        """Say so when the actors ask more than the cluster has now (Ray waits for them: an autoscaling cluster
        may add them, a fixed one never will)."""
        import ray

        have = ray.cluster_resources()
        cpus, gpus = have.get("CPU", 0.0), have.get("GPU", 0.0)
        if self.embed_actors > cpus:
            warn(f"{self.embed_actors} embedding actors need {self.embed_actors} CPUs; the cluster has {cpus:g} now: "
                 "the build waits until it has them")
        if self.gpus_per_actor and self.gpus_per_actor * self.embed_actors > gpus:
            warn(f"{self.embed_actors} actors × {self.gpus_per_actor:g} GPUs; the cluster has {gpus:g} GPUs now: "
                 "the build waits until it has them")

    def _run(self, texts, settings, device, dtype, show_progress) -> list[dict]:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = show_progress
        ctx.print_on_execution_start = False
        if not show_progress:
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = ray.data.from_items([{"doc": i, "text": t} for i, t in enumerate(texts)],
                                 override_num_blocks=max(1, -(-len(texts) // DOCS_PER_BATCH)))
        # the settings travel inside the class (pickled by value), not as constructor arguments in the object
        # store: a restarted actor then never depends on an object that may be gone
        stage = type("ChunkEmbed", (ChunkEmbed,), {"config": (settings.model_dump(), device, dtype)})
        ds = ds.map_batches(
            stage, batch_size=DOCS_PER_BATCH, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=self.embed_actors), num_gpus=self.gpus_per_actor or None,
        )
        try:
            return list(ds.iter_batches(batch_size=None, batch_format="numpy"))
        except Exception as exc:  # noqa: BLE001 — a task failed past its retries: one line; the previous index stays
            last = str(exc).strip().splitlines()[-1].removeprefix("ragspec.errors.RagspecError: ")
            raise RagspecError(f"the Ray build failed: {last[:300]}") from None


def _assemble(n_docs: int, batches: list[dict], name: str, dtype: str) -> Embedded:
    """The stage's rows (any order) → chunks per document and vectors in the local builder's order."""
    from ragspec.corpus.chunker import Chunk

    rows = []
    windows: list[np.ndarray] = []
    vec_parts = []
    base = 0
    for b in batches:
        if not len(b["doc"]):
            continue  # a batch of documents with no chunks (whitespace only)
        for j in range(len(b["doc"])):
            rows.append((int(b["doc"][j]), int(b["order"][j]), base + j, int(b["start"][j]), int(b["end"][j]),
                         int(b["tokens"][j]), str(b["text"][j])))
            windows.append(np.asarray(b["windows"][j], dtype=np.float32))
        vec_parts.append(np.asarray(b["vector"], dtype=np.float32).reshape(len(b["doc"]), -1))
        base += len(b["doc"])
    rows.sort()
    all_vecs = np.concatenate(vec_parts) if vec_parts else np.zeros((0, 0), np.float32)
    chunks: list[list[Chunk]] = [[] for _ in range(n_docs)]
    for d, order, _, start, end, tokens, text in rows:
        chunks[d].append(Chunk(order=order, start=start, end=end, text=text, tokens=tokens))
    take = np.asarray([r[2] for r in rows], dtype=np.int64)
    return Embedded(chunks, all_vecs[take] if len(take) else all_vecs, name, dtype, [windows[k] for k in take])
