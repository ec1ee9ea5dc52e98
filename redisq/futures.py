"""The thread API's futures: a batch's completion signal (Waiter), and one message's result
(SendFuture), shared by plain and delayed sends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from redisq.records import RecordMetadata

log = logging.getLogger("redisq.producer")


class FutureBatch(Protocol):
    """What a SendFuture needs of its batch (plain or delayed)."""

    waiter: Any
    error: BaseException | None

    def metadata(self, index: int) -> RecordMetadata: ...


class Waiter:
    """The thread driver's completion signal of one batch."""

    __slots__ = ("event", "callbacks")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.callbacks: list[tuple[int, Callable[[SendFuture], None]]] | None = None


def finished(batch: FutureBatch) -> None:
    """The batch is done (acknowledged or failed): wake its waiters, run its callbacks."""
    waiter: Waiter = batch.waiter
    waiter.event.set()
    if waiter.callbacks:
        for index, callback in waiter.callbacks:
            try:
                callback(SendFuture(batch, index))
            except Exception:  # a user's callback must not stop the sender
                log.exception("send callback raised")


class SendFuture:
    """The result of send_async(): result() blocks until the message is acknowledged."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: FutureBatch, index: int) -> None:
        self._batch = batch
        self._index = index

    def done(self) -> bool:
        return bool(self._batch.waiter.event.is_set())

    def result(self, timeout: float | None = None) -> RecordMetadata:
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        if self._batch.error is not None:
            raise self._batch.error
        return self._batch.metadata(self._index)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        return self._batch.error

    def add_done_callback(self, callback: Callable[[SendFuture], None]) -> None:
        waiter: Waiter = self._batch.waiter
        if waiter.event.is_set():
            callback(self)
            return
        if waiter.callbacks is None:
            waiter.callbacks = []
        waiter.callbacks.append((self._index, callback))
