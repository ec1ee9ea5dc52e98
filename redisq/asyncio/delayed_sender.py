"""The asyncio driver of delayed sends: the same core as the thread driver (redisq.delayed,
where the guarantees are described), run by a sender task.

send_async() with a delay never blocks the event loop: with the topic's metadata cached it
checks, encodes and queues the message at once (bad input raises there); otherwise the message
waits, in order, for the metadata, and errors about the topic come through its future.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from redisq import errors
from redisq import identity as identity_ops
from redisq.asyncio.client import run_operation, stop_task, wait_acknowledged
from redisq.asyncio.scheduler import Scheduler
from redisq.asyncio.transport import AsyncTransport
from redisq.delayed import (
    DelayedBatch,
    DelayedCore,
    ScheduleIds,
    check_when_types,
    encode_delayed,
    when,
)
from redisq.errors import ProducerClosed, TopicNotFound
from redisq.futures import remaining
from redisq.protocol.produce import ProducerIdentity
from redisq.records import RecordMetadata
from redisq.scheduler import NETWORK_ERRORS
from redisq.sending import MessageEncoder
from redisq.settings import ProducerSettings
from redisq.stats import ProducerStats
from redisq.topic import TopicConfig

if TYPE_CHECKING:
    from redisq.asyncio.handle import AsyncBrokerHandle

log = logging.getLogger("redisq.asyncio.producer")

_Args = tuple[Any, ...]  # topic, value, key, headers, message_id, partition, delay_ms, deliver_at


class DelayedSender:
    """Delayed sends of one asyncio producer: a sender task and a scheduler task for the topics
    it sent to, both started by the first delayed message."""

    def __init__(
        self,
        broker: AsyncBrokerHandle,
        settings: ProducerSettings,
        encoder: MessageEncoder,
        topic_config: Callable[[str], Awaitable[TopicConfig]],
        cache: dict[str, tuple[float, TopicConfig]],
        identity: Callable[[], ProducerIdentity | None],
        stats: ProducerStats | None = None,
    ) -> None:
        self._broker = broker
        self._settings = settings
        self._encoder = encoder
        self._topic_config = topic_config
        self._cache = cache  # the producer's: topic -> (read at, metadata)
        self._identity = identity
        self._core = DelayedCore(settings, encoder.batch_sealed, stats)
        self._ids: ScheduleIds | None = None
        self._deferred: deque[tuple[_Args, asyncio.Future[RecordMetadata]]] = deque()
        self._drainer: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._scheduler: Scheduler | None = None
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._closing = False
        self._halted = False  # close(): the sender stops at once (see client.stop_task)

    def send_async(self, *args: Any) -> asyncio.Future[RecordMetadata]:
        """Queue a delayed message (see the module doc); its future."""
        self._check(args)
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        cached = self._cache.get(args[0])
        fresh = cached is not None and (
            time.monotonic() - cached[0] < self._settings.metadata_max_age_ms / 1000
        )
        if cached is not None and fresh and not self._deferred and self._identity() is not None:
            self._enqueue(cached[1], args, future)
            return future
        self._encoder.check(*args[1:6])  # types and sizes now; routing once the metadata is in
        self._deferred.append((args, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain_deferred())
        return future

    async def send(self, *args: Any, timeout: float | None = None) -> RecordMetadata:
        """Queue and send at once (no linger); wait until acknowledged (at most timeout s)."""
        self._check(args)
        config = await self._topic_config(args[0])  # TopicNotFound raises here
        while self._deferred:  # keep the order of earlier send_async() calls
            await self._wait_progress()
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        batch = self._enqueue(config, args, future)
        self._core.seal(batch)
        self._wake.set()
        return await wait_acknowledged(future, timeout)

    def _check(self, args: _Args) -> None:
        check_when_types(args[6], args[7])
        if self._closing:
            raise ProducerClosed("send after close()")

    def _enqueue(
        self, config: TopicConfig, args: _Args, future: asyncio.Future[RecordMetadata]
    ) -> DelayedBatch:
        topic, value, key, headers, message_id, partition, delay_ms, deliver_at = args
        if self._core.buffered >= self._settings.max_buffered_messages:
            raise errors.RedisqError(
                f"buffer full ({self._settings.max_buffered_messages} delayed messages): await "
                "send() or flush() to wait for room"
            )
        when_ = when(config, delay_ms, deliver_at)
        identity = self._identity()
        assert identity is not None, "the producer is started before a delayed message is queued"
        if self._ids is None:
            self._ids = ScheduleIds(identity)
        p, scheduled = encode_delayed(
            self._encoder, self._settings.idempotence, self._ids, identity, config, when_,
            value, key, headers, message_id, partition,
        )  # fmt: skip
        batch, index, opened = self._core.append(config, p, scheduled, time.monotonic())
        if batch.waiter is None:
            batch.waiter = []
        batch.waiter.append((index, future))
        if opened or batch.sealed:
            self._wake.set()
        self._start(topic)
        return batch

    async def _drain_deferred(self) -> None:
        """Delayed messages queued before their topic's metadata was loaded, in send order."""
        while self._deferred:
            args, future = self._deferred[0]
            try:
                config = await self._topic_config(args[0])
                self._enqueue(config, args, future)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            self._deferred.popleft()
        self._progress.set()

    def _start(self, topic: str) -> None:
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._run())
        if self._scheduler is None:
            self._scheduler = Scheduler(self._broker)
        if topic not in self._scheduler.topics:
            self._scheduler.add_topic(topic)

    async def _wait_progress(self) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), 0.5)
        except TimeoutError:
            pass

    async def flush(self, timeout: float | None = None) -> None:
        """Send what is queued now; wait until it is acknowledged or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._core.flush_requested = True
        self._wake.set()
        try:
            while self._core.buffered > 0 or self._deferred:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"flush: {self._core.buffered} delayed messages still unacknowledged"
                    )
                await self._wait_progress()
        finally:
            self._core.flush_requested = False

    async def close(self, timeout: float | None = None) -> None:
        """Flush, stop the sender task and the scheduler (its leases are handed back). With a
        timeout, within about that time: what is still unacknowledged then fails with
        ProducerClosed (it may or may not be stored)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._sender is not None or self._deferred:
                await self.flush(timeout)
        finally:
            self._closing = True
            self._core.fail_all(ProducerClosed("the producer was closed"))
            self._signal_finished()
            self._wake.set()
            if self._sender is not None:
                try:
                    grace = 5.0 if deadline is None else remaining(deadline)
                    if not await stop_task(self._sender, grace, self._halt):
                        log.warning("the delayed sender did not stop in time at close(): stopped")
                except asyncio.CancelledError:  # close() itself cancelled: nothing left running
                    self.halt()
                    raise
                self._fail_in_flight()
            if self._scheduler is not None:
                await self._scheduler.close(5.0 if deadline is None else remaining(deadline))

    def halt(self) -> None:
        """The producer's close() was cancelled: stop the sender task and the scheduler now;
        what the sender had sent and not heard back of fails (stored or not, unknown)."""
        self._closing = self._halted = True
        if self._sender is not None:
            self._sender.cancel()
        self._fail_in_flight()
        if self._scheduler is not None:
            self._scheduler.halt()

    def _fail_in_flight(self) -> None:
        self._core.fail_all(
            ProducerClosed("closed before the batch was acknowledged: it may or may not be stored"),
            in_flight=True,
        )
        self._signal_finished()

    def _halt(self) -> None:
        self._halted = True

    def _signal_finished(self) -> None:
        finished, self._core.finished = self._core.finished, []
        for batch in finished:
            if isinstance(batch.error, TopicNotFound):  # deleted: the next send reads it again
                self._cache.pop(batch.topic, None)
            for index, future in batch.waiter:
                if future.done():
                    continue
                if batch.error is not None:
                    future.set_exception(batch.error)
                else:
                    future.set_result(batch.metadata(index))
        if finished:
            self._progress.set()

    async def _fence(self, needed: list[tuple[str, int]]) -> None:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration and store it on
        the partitions before their batches go again (a fenced instance's fail)."""
        identity = self._identity()
        assert identity is not None
        try:
            operation = identity_ops.prove_and_fence(self._broker.keys, identity, needed)
            await run_operation(operation, self._broker.scripts)
        except NETWORK_ERRORS as exc:  # tried again; the batches' deadlines still hold
            log.warning("delayed sends: cannot prove the epoch yet: %s", type(exc).__name__)
            self._core.expire(time.monotonic())
            self._signal_finished()
            await asyncio.sleep(min(1.0, self._settings.retry_backoff_ms / 1000))
            return
        except Exception as exc:  # ProducerFenced: a newer instance has the name
            self._core.fence_failed(needed, exc)
            self._signal_finished()
            return
        for key in needed:
            self._core.partition_fenced(key)

    async def _run(self) -> None:
        # Connections of its own whose reads wait no longer than the round's first delivery
        # deadline (redisq.transport): a silent network fails a batch at its delivery timeout.
        transport = AsyncTransport(self._broker.client, self._settings.delivery_timeout_ms)
        try:
            await self._send_rounds(transport)
        finally:
            await transport.close()

    async def _send_rounds(self, transport: AsyncTransport) -> None:
        core, keys = self._core, self._broker.keys
        while not self._halted:
            needed = core.fences_to_prove()
            if needed:
                await self._fence(needed)
                continue
            now = time.monotonic()
            core.expire(now)
            batches = core.pick(now)
            self._signal_finished()
            if not batches:
                if self._closing and core.buffered == 0:
                    return
                wake = core.next_deadline()
                self._wake.clear()
                try:
                    timeout = 1.0 if wake is None else max(0.0, min(1.0, wake - now))
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            identity = self._identity()
            assert identity is not None
            steps = core.steps(keys, batches, identity)
            deadline = min(batch.deadline for batch in batches)
            try:
                results = await transport.execute(steps, self._broker.scripts, deadline)
            except Exception as exc:  # no answer (connection lost, or none by the deadline):
                await transport.reset()  # every batch of the round goes again, or fails
                if not isinstance(exc, NETWORK_ERRORS):
                    log.exception("delayed send round failed")
                results = [exc] * len(steps)
            core.settle(batches, list(results), time.monotonic())
            self._signal_finished()
