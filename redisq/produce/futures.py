"""The thread API's futures (hand-written per runtime: redisq.produce.futures_async has the
asyncio API's): a batch's completion signal (Waiter), one message's result (SendFuture), shared
by plain and delayed sends, and `BatchFutures`, what the generated producer code calls.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from redisq.model.records import RecordMetadata
from redisq.model.timeouts import check_timeout

log = logging.getLogger("redisq.producer")

# One lock for every batch's callback list: registering a callback is rare, and a lock per batch
# would cost every batch an allocation. Held only to add to a list or to take it.
_callbacks_lock = threading.Lock()


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
    run_callbacks(batch, mark_finished(batch))


def mark_finished(batch: FutureBatch) -> list[tuple[int, Callable[[SendFuture], None]]] | None:
    """Wake the batch's waiters and take its callbacks (to be run by run_callbacks(), with no
    lock of the producer held: a callback may send again)."""
    waiter: Waiter = batch.waiter
    waiter.event.set()
    # Taken under the lock after the event is set: add_done_callback() either appended before
    # (its callback is in the list) or sees the event set (and calls its callback itself).
    with _callbacks_lock:
        callbacks, waiter.callbacks = waiter.callbacks, None
    return callbacks


def run_callbacks(
    batch: FutureBatch, callbacks: list[tuple[int, Callable[[SendFuture], None]]] | None
) -> None:
    if callbacks:
        for index, callback in callbacks:
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
        """True once the message is acknowledged or failed."""
        return bool(self._batch.waiter.event.is_set())

    def result(self, timeout: float | None = None) -> RecordMetadata:
        """The message's RecordMetadata once acknowledged, or its error raised; TimeoutError
        after timeout seconds (the message is not given up)."""
        timeout = check_timeout(timeout)
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        if self._batch.error is not None:
            raise self._batch.error
        return self._batch.metadata(self._index)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The message's error, or None once it is acknowledged; TimeoutError as result()."""
        timeout = check_timeout(timeout)
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        return self._batch.error

    def add_done_callback(self, callback: Callable[[SendFuture], None]) -> None:
        """Call callback(future) once the message is acknowledged or failed: in the sender's
        thread, or at once in this one when it already is."""
        waiter: Waiter = self._batch.waiter
        with _callbacks_lock:  # see finished(): the check and the append are one step
            if not waiter.event.is_set():
                if waiter.callbacks is None:
                    waiter.callbacks = []
                waiter.callbacks.append((self._index, callback))
                return
        callback(self)


class CallbackQueue:
    """The callbacks of finished batches, run after the producer's lock is released: finished()
    (the core's hook, lock held) wakes the batch's waiters and queues its callbacks; run() runs
    them in the order the batches finished, one thread at a time (a callback may send again,
    which takes the lock); pending() tells flush() whether some are still to run."""

    def __init__(self, ran: Callable[[], None]) -> None:
        self._queue: deque[tuple[FutureBatch, list[Any]]] = deque()
        self._running = threading.Lock()
        self._thread: int | None = None
        self._ran = ran  # called (no lock held) after run() ran some

    def finished(self, batch: FutureBatch) -> None:
        callbacks = mark_finished(batch)
        if callbacks:
            self._queue.append((batch, callbacks))

    def run(self) -> None:
        ran = False
        while self._queue:
            if not self._running.acquire(blocking=False):
                return  # another thread runs them (it runs these too)
            try:
                self._thread = threading.get_ident()
                while self._queue:
                    run_callbacks(*self._queue.popleft())
                    ran = True
            finally:
                self._thread = None
                self._running.release()
        if ran:
            self._ran()

    def pending(self) -> bool:
        """Callbacks not run yet, other than the caller's own (a callback that flushes must
        not wait for itself)."""
        if self._thread == threading.get_ident():
            return False
        return bool(self._queue) or self._running.locked()


class BatchFutures:
    """The futures of one producer's messages (the twin of AsyncBatchFutures): a SendFuture per
    message over its batch's Waiter; the batch's callbacks run by run(), from the sender, with
    no lock held (finished() is called under the producer's guard, and a callback may send)."""

    def __init__(self, ran: Callable[[], None]) -> None:
        self._callbacks = CallbackQueue(ran)

    @staticmethod
    def new(batch: FutureBatch, index: int) -> SendFuture:
        if batch.waiter is None:
            batch.waiter = Waiter()
        return SendFuture(batch, index)

    @staticmethod
    def attach(batch: FutureBatch, index: int, future: SendFuture) -> None:
        raise AssertionError("the thread API creates a send's future with its batch")

    def finished(self, batch: FutureBatch) -> None:
        self._callbacks.finished(batch)

    def run(self) -> None:
        self._callbacks.run()

    def pending(self) -> bool:
        return self._callbacks.pending()

    @staticmethod
    def result(future: SendFuture, timeout: float | None) -> RecordMetadata:
        return future.result(timeout)

    @staticmethod
    def exception(future: SendFuture, timeout: float | None) -> BaseException | None:
        return future.exception(timeout)


class Deferred:
    """The twin of AsyncDeferred: the thread API never defers a send (send_async() reads a
    topic's metadata itself), so nothing is ever queued here."""

    def __init__(self, *_: Any) -> None:
        pass

    def __len__(self) -> int:
        return 0

    @property
    def queue(self) -> tuple[()]:
        return ()

    def defer(self, topic: str, args: tuple[Any, ...]) -> SendFuture:
        raise AssertionError("the thread API reads the metadata in send_async()")
