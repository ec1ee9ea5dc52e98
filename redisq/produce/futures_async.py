"""The asyncio producer's futures (hand-written per runtime: redisq.produce.futures has the
thread API's): one asyncio.Future per message, settled when its batch finishes.

`AsyncBatchFutures` is what the generated-from-asyncio producer code calls; the thread twin,
`redisq.produce.futures.BatchFutures`, has the same methods.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redisq.model.records import RecordMetadata

T = TypeVar("T")


class AsyncBatchFutures:
    """The futures of one producer's messages: created when a message is queued (new, or
    attach for one created before its batch existed), settled when its batch finishes. A
    batch's waiter is the list of its messages' futures, in index order (every message queued
    gets one, in the order it joins the batch)."""

    def __init__(self, ran: Callable[[], None]) -> None:
        self._ran = ran  # called once a batch's futures are settled (flush() waits on it)
        self._loop: asyncio.AbstractEventLoop | None = None  # the producer's, once it runs

    def create(self) -> asyncio.Future[RecordMetadata]:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.create_future()

    def new(self, batch: Any, index: int) -> asyncio.Future[RecordMetadata]:
        future = self.create()
        self.attach(batch, index, future)
        return future

    @staticmethod
    def attach(batch: Any, index: int, future: asyncio.Future[RecordMetadata]) -> None:
        waiter = batch.waiter
        if waiter is None:
            waiter = batch.waiter = []
        assert len(waiter) == index, "a batch's futures come in index order"
        waiter.append(future)

    def finished(self, batch: Any) -> None:
        """The batch is done (acknowledged or failed): its futures get their results (their
        callbacks run from the event loop, so nothing runs here)."""
        futures = batch.waiter or ()
        error = batch.error
        if error is not None:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
        else:
            every = getattr(batch, "metadata_all", None)  # in one pass where the batch can
            results = every() if every is not None else map(batch.metadata, range(len(futures)))
            for future, result in zip(futures, results, strict=False):
                if not future.done():
                    future.set_result(result)
        self._ran()

    def run(self) -> None:
        """Nothing to run: the event loop runs the futures' callbacks."""

    def pending(self) -> bool:
        return False

    @staticmethod
    async def result(future: asyncio.Future[T], timeout: float | None) -> T:
        """A send's acknowledgement, waited for at most timeout seconds (a checked one, or
        None): TimeoutError as redisq.SendFuture.result raises it; the message is not given
        up (a cancelled wait does not cancel the send)."""
        if timeout is None:
            return await asyncio.shield(future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if future.done():  # it came as the wait ended
                return future.result()
            raise TimeoutError(f"no acknowledgement within {timeout} s") from None

    @staticmethod
    async def exception(future: asyncio.Future[Any], timeout: float | None) -> BaseException | None:
        """The send's error (None: acknowledged), waited for as result() waits."""
        try:
            await AsyncBatchFutures.result(future, timeout)
        except TimeoutError:
            if not future.done():
                raise
        except Exception:
            pass
        return future.exception()


class AsyncDeferred:
    """Sends queued before their topic's metadata is loaded, in send order (asyncio only:
    send_async() cannot wait for the read on the event loop, so it queues the message and its
    future here; the thread API reads the metadata in send_async() itself). A task drains
    them: each waits for its topic's metadata, then enqueue(config, args, future) queues it as
    send_async() would have; an error (TopicNotFound, ...) fails its future instead."""

    def __init__(
        self,
        load: Callable[[str], Awaitable[Any]],
        enqueue: Callable[[Any, tuple[Any, ...], asyncio.Future[RecordMetadata]], Any],
        progress: Callable[[], None],
    ) -> None:
        self._load = load
        self._enqueue = enqueue
        self._progress = progress
        self._queue: deque[tuple[str, tuple[Any, ...], asyncio.Future[RecordMetadata]]] = deque()
        self._drainer: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def queue(self) -> deque[tuple[str, tuple[Any, ...], asyncio.Future[RecordMetadata]]]:
        """The messages waiting (the hot path tests its truth: no __len__ call)."""
        return self._queue

    def defer(self, topic: str, args: tuple[Any, ...]) -> asyncio.Future[RecordMetadata]:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((topic, args, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())
        return future

    async def _drain(self) -> None:
        while self._queue:
            topic, args, future = self._queue[0]
            try:
                config = await self._load(topic)
                self._enqueue(config, args, future)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            self._queue.popleft()
        self._progress()
