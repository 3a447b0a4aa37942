"""Async iteration over a blocking iterator: the iterator runs on a worker thread and hands its items over as
they come (model work never blocks the event loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


async def iterate_in_thread(make: Callable[[], Iterator[T]], cancel=None) -> AsyncIterator[T]:
    """Items of `make()` as they come. Leaving early sets `cancel` (a threading.Event the iterator watches, e.g.
    `Pipeline.stream(cancel=...)`) and stops the worker at its next item, so the model is not held for an
    answer nobody reads."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def work():
        it = None
        try:
            it = make()
            for item in it:
                if stopped.is_set():
                    break
                put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)
        finally:
            if it is not None and hasattr(it, "close"):
                it.close()  # GeneratorExit inside the pipeline: the model lock is released now
            put(done)

    def put(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown)
            pass

    stopped = threading.Event()
    worker = loop.run_in_executor(None, work)
    try:
        while (item := await queue.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()
        if cancel is not None:
            cancel.set()
        try:
            await asyncio.shield(worker)
        except BaseException:  # noqa: BLE001 - the consumer's error (or cancellation) is the one that matters
            pass
