"""`ragspec index --kv-cache --executor ray`: the source cache filled on Ray actors.

Each actor loads the pipeline's generator once and computes the entries of a batch of chunks
(`Pipeline.fill_source_cache`) into a store that only records them; the payloads travel back and the driver
writes them into its own store on disk, so the asks on this machine find them. Entries the driver already holds
are named to the actors and skipped.
"""

from __future__ import annotations

import logging

import numpy as np

from ragspec.cluster import connect, require_ray
from ragspec.decoding.source_cache import SourceKVStore
from ragspec.errors import RagspecError

CHUNKS_PER_BATCH = 8


class RecordingStore(SourceKVStore):
    """A memory store that also keeps each new entry's payload, and counts `known` keys as held."""

    def __init__(self, known: set[str]):
        super().__init__(memory_bytes=1 << 30, directory=None)
        self.known = set(known)
        self.recorded: list[tuple[str, bytes]] = []

    def put(self, key, value, nbytes, dump=None):
        super().put(key, value, nbytes)
        if dump is not None and key not in self.known:
            self.recorded.append((key, dump(value)))
            self.known.add(key)

    def __contains__(self, key: str) -> bool:
        return key in self.known or super().__contains__(key)


class PieceFill:
    """The Ray Data stage: a batch of chunk texts → the (key, payload) of each entry computed for them."""

    config: tuple = ()  # (spec dict, index path, known keys): set on a per-run subclass

    def __init__(self):
        from ragspec.pipeline import Pipeline

        spec, index, known = self.config
        self.pipe = Pipeline(spec, index)
        self.pipe._source_store = RecordingStore(known)

    def __call__(self, batch: dict) -> dict:
        store = self.pipe._source_store
        store.recorded = []
        self.pipe.fill_source_cache([str(t) for t in batch["text"]])
        return {"key": np.asarray([k for k, _ in store.recorded], dtype=object),
                "payload": np.asarray([p for _, p in store.recorded], dtype=object)}


def fill_on_ray(spec: dict, index: str, texts: list[str], store: SourceKVStore, address: str | None = None,
                actors: int = 1, num_cpus: int | None = None, on_progress=None) -> int:
    """Compute the entries of `texts` on `actors` Ray actors and write them into `store`; returns how many."""
    require_ray()
    import ray.data

    started = connect(address, num_cpus)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = ray.data.from_items([{"text": t} for t in texts],
                                 override_num_blocks=max(1, -(-len(texts) // CHUNKS_PER_BATCH)))
        stage = type("PieceFill", (PieceFill,), {"config": (spec, index, store.keys())})
        ds = ds.map_batches(stage, batch_size=CHUNKS_PER_BATCH, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=actors))
        made, done = 0, 0
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for key, payload in zip(batch["key"], batch["payload"]):
                    if key not in store:
                        store.put_payload(str(key), bytes(payload))
                        made += 1
                done += CHUNKS_PER_BATCH
                if on_progress is not None:
                    on_progress(min(done, len(texts)), len(texts))
        except Exception as exc:  # noqa: BLE001 — a task failed past its retries: one line
            last = str(exc).strip().splitlines()[-1].removeprefix("ragspec.errors.RagspecError: ")
            raise RagspecError(f"the Ray fill failed: {last[:300]}") from None
        return made
    finally:
        if started:
            import ray

            ray.shutdown()
