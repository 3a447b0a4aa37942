"""Async iteration over a blocking iterator: the iterator runs on a worker thread and hands its items over as
they come (model work never blocks the event loop)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def work():
        try:
            for item in make():
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as exc:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, done)

    worker = loop.run_in_executor(None, work)
    try:
        while (item := await queue.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        await worker
