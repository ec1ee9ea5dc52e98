# WARNING: generated from delayed_sender_async.py by tools/async_to_sync.py; do not edit.
# Change delayed_sender_async.py and run `python tools/async_to_sync.py`.
"""Delayed sends of one producer (the core and the guarantees: redisq.produce.delayed): a sender
started by the first delayed message, and a scheduler for the topics it sent to, so a producer
alone delivers what it scheduled while it lives. The thread API's twin is generated from this
module (tools/async_to_sync.py).

As with plain sends, the thread API reads a topic's metadata in send_async() itself (bad input,
TopicNotFound raise there); the asyncio API's send_async() never blocks the event loop: with the
topic's metadata cached it checks, encodes and queues the message at once, otherwise the message
waits, in order, for the metadata, and errors about the topic come through its future.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redisq import errors
from redisq.errors import ProducerClosed, TopicNotFound
from redisq.model.records import RecordMetadata
from redisq.model.stats import ProducerStats
from redisq.model.timeouts import remaining
from redisq.model.topic import TopicConfig
from redisq.produce.delayed import (
    DelayedCore,
    ScheduleIds,
    check_when_types,
    encode_delayed,
    when,
)
from redisq.produce.encoder import MessageEncoder
from redisq.produce.futures import BatchFutures, Deferred
from redisq.protocol import identity as identity_ops
from redisq.protocol.produce import ProducerIdentity
from redisq.protocol.rounds import Halted
from redisq.runtime import (
    Event,
    Guard,
    Task,
    alive,
    cancel,
    spawn,
    stop,
)
from redisq.schedule.core import NETWORK_ERRORS
from redisq.schedule.scheduler import Scheduler
from redisq.server.transport import Transport
from redisq.settings import ProducerSettings

if TYPE_CHECKING:
    from redisq.server.handle import BrokerHandle

log = logging.getLogger("redisq.producer")

_Args = tuple[Any, ...]  # topic, value, key, headers, message_id, partition, delay_ms, deliver_at
_CLOSED_UNACKED = "closed before the batch was acknowledged: it may or may not be stored"


class DelayedSender:
    """The delayed sends of one producer. topic_config reads a topic's metadata (the
    producer's, cached in `cache`: topic -> (read at, metadata)); refresh_if_stale(topic,
    read_at) reads it again in the background once it is older than metadata_max_age_ms;
    forget_topic drops it (the topic was deleted)."""

    def __init__(
        self,
        broker: BrokerHandle,
        settings: ProducerSettings,
        encoder: MessageEncoder,
        topic_config: Callable[[str], TopicConfig],
        cache: dict[str, tuple[float, TopicConfig]],
        refresh_if_stale: Callable[[str, float], None],
        identity: Callable[[], ProducerIdentity | None],
        forget_topic: Callable[[str], None],
        stats: ProducerStats | None = None,
    ) -> None:
        self._broker = broker
        self._settings = settings
        self._encoder = encoder
        self._topic_config = topic_config
        self._cache = cache
        self._refresh_if_stale = refresh_if_stale
        self._identity = identity
        self._forget_topic = forget_topic
        self._max_age_s = settings.metadata_max_age_ms / 1000
        self._core = DelayedCore(settings, encoder.batch_sealed, stats)
        self._ids: ScheduleIds | None = None
        self._guard = Guard()
        self._wake = Event()
        self._progress = Event()
        self._futures = BatchFutures(self._progress.set)
        self._deferred = Deferred(topic_config, self._enqueue_deferred, self._progress.set)
        self._sender: Task | None = None
        self._transport: Transport | None = None  # the sender's, which close() can halt
        self._scheduler: Scheduler | None = None
        self._scheduled_topics: set[str] = set()
        self._closing = False
        self._halted = False  # close() ran out of time: the sender stops at once

    # -- queueing --------------------------------------------------------------------------------
    def send_async(self, *args: Any) -> Any:
        """Queue a delayed message (see the module doc); its future."""
        self._check(args)
        cached = self._cache.get(args[0])
        if cached is None:
            config = self._topic_config(args[0])  # the first send to a topic reads it, here
        else:
            config = cached[1]
            self._refresh_if_stale(args[0], cached[0])  # in the background
        return self._enqueue(config, args)[1]

    def send(self, *args: Any, timeout: float | None = None) -> RecordMetadata:
        """Queue and send at once (no linger); wait until acknowledged (at most timeout s)."""
        self._check(args)
        config = self._topic_config(args[0])  # TopicNotFound raises here
        while len(self._deferred):  # after the earlier send_async() calls (asyncio)
            self._progress.wait(0.5)
            self._progress.clear()
        block_until = time.monotonic() + self._settings.max_block_ms / 1000
        while (appended := self._append(config, args, None)) is None:
            self._wait_for_room(block_until)
        batch, future = appended
        with self._guard:
            self._core.seal(batch)
        self._wake.set()
        return self._futures.result(future, timeout)

    def _check(self, args: _Args) -> None:
        check_when_types(args[6], args[7])
        if self._closing:
            raise ProducerClosed("send after close()")

    def _enqueue(self, config: TopicConfig, args: _Args, future: Any = None) -> tuple[Any, Any]:
        """Append now (the thread API waits for room up to max_block_ms; asyncio: buffer full)."""
        block_until = None
        while True:
            appended = self._append(config, args, future)
            if appended is not None:
                return appended
            if block_until is None:
                block_until = time.monotonic() + self._settings.max_block_ms / 1000
            self._wait_for_room(block_until)

    def _enqueue_deferred(self, config: TopicConfig, args: _Args, future: Any) -> None:
        self._enqueue(config, args, future)

    def _append(self, config: TopicConfig, args: _Args, future: Any) -> tuple[Any, Any] | None:
        """The message encoded into its partition's batch, if the buffer has room (None: full)."""
        topic, value, key, headers, message_id, partition, delay_ms, deliver_at = args
        when_ = when(config, delay_ms, deliver_at)
        identity = self._identity()
        assert identity is not None, "the producer is started before a delayed message is queued"
        with self._guard:
            if self._core.buffered >= self._settings.max_buffered_messages:
                return None
            if self._ids is None:
                self._ids = ScheduleIds(identity)
            p, scheduled = encode_delayed(
                self._encoder,
                self._settings.idempotence,
                self._ids,
                identity,
                config,
                when_,
                value,
                key,
                headers,
                message_id,
                partition,
            )
            batch, index, opened = self._core.append(config, p, scheduled, time.monotonic())
            if future is None:
                future = self._futures.new(batch, index)
            else:
                self._futures.attach(batch, index, future)
            start = topic not in self._scheduled_topics
            if start:
                self._scheduled_topics.add(topic)
        if opened or batch.sealed:
            self._wake.set()
        if start:
            self._start(topic)
        return batch, future

    def _wait_for_room(self, until: float) -> None:
        limit = self._settings.max_buffered_messages
        while True:
            self._progress.clear()
            if self._core.buffered < limit:
                return
            left = until - time.monotonic()
            if left <= 0:
                raise errors.RedisqError(
                    f"buffer full ({limit} delayed messages) for "
                    f"max_block_ms={self._settings.max_block_ms}"
                )
            self._progress.wait(min(left, 0.5))

    def _buffer_full(self) -> errors.RedisqError:
        return errors.RedisqError(
            f"buffer full ({self._settings.max_buffered_messages} delayed messages): send() or "
            "flush() to wait for room"
        )

    def _start(self, topic: str) -> None:
        """The sender (once), and the scheduler of this topic."""
        with self._guard:
            if self._sender is None:
                self._transport = Transport(self._broker.client, self._settings.delivery_timeout_ms)
                self._sender = spawn(self._run, name="redisq-delayed")
            if self._scheduler is None:
                self._scheduler = Scheduler(self._broker)
        self._scheduler.add_topic(topic)

    # -- flush and close -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Send what is queued now; wait until it is acknowledged or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._guard:
            self._core.flush_requested = True
        self._wake.set()
        try:
            while True:
                self._progress.clear()
                if not (self._core.buffered > 0 or len(self._deferred) or self._futures.pending()):
                    return
                if self._sender is not None and not alive(self._sender):
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"flush: {self._core.buffered} delayed messages still unacknowledged"
                    )
                self._progress.wait(0.5 if left is None else min(left, 0.5))
        finally:
            with self._guard:
                self._core.flush_requested = False

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the sender and the scheduler (its leases are handed back). With a
        timeout, within about that time: what is still unacknowledged then fails with
        ProducerClosed (it may or may not be stored)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._sender is not None or len(self._deferred):
                self.flush(timeout)
        finally:
            with self._guard:
                self._closing = True
                self._core.fail_all(ProducerClosed("the producer was closed"))
            self._signal_finished()
            self._wake.set()
            sender = self._sender
            if sender is not None:
                grace = 5.0 if deadline is None else remaining(deadline)
                try:
                    stop(sender, grace, self._halt)
                except BaseException:  # close() itself cancelled: nothing left running
                    self.halt()
                    raise
                if alive(sender):  # a thread stuck past its halt: its sends settle later
                    log.warning("the delayed sender did not stop at close(): they settle later")
                else:
                    self._fail_in_flight()
            if self._scheduler is not None:
                self._scheduler.close(5.0 if deadline is None else remaining(deadline))

    def halt(self) -> None:
        """The producer's close() was cancelled: stop the sender and the scheduler now; what the
        sender had sent and not heard back of fails (stored or not, unknown)."""
        self._closing = True
        self._halt()
        if self._sender is not None:
            cancel(self._sender)
        self._fail_in_flight()
        if self._scheduler is not None:
            self._scheduler.halt()

    def _halt(self) -> None:
        self._halted = True
        if self._transport is not None:
            self._transport.halt()

    def _fail_in_flight(self) -> None:
        with self._guard:
            self._core.fail_all(ProducerClosed(_CLOSED_UNACKED), in_flight=True)
        self._signal_finished()

    def _signal_finished(self) -> None:
        with self._guard:
            finished, self._core.finished = self._core.finished, []
            for batch in finished:
                if isinstance(batch.error, TopicNotFound):  # deleted: the next send reads it
                    self._cache.pop(batch.topic, None)
                    self._forget_topic(batch.topic)
                self._futures.finished(batch)
        self._futures.run()
        if finished:
            self._progress.set()

    # -- the sender ------------------------------------------------------------------------------
    def _run(self) -> None:
        # Connections of its own whose reads wait no longer than the round's first delivery
        # deadline (redisq.server.transport): a silent network fails a batch at its delivery
        # timeout.
        transport = self._transport
        assert transport is not None
        try:
            self._send_rounds(transport)
        except Halted:  # close() ran out of time: what is unacknowledged fails now
            self._fail_in_flight()
        finally:
            transport.close()

    def _send_rounds(self, transport: Transport) -> None:
        core, keys = self._core, self._broker.keys
        while not self._halted:
            self._wake.clear()  # before looking: a batch queued from now on wakes the wait
            with self._guard:
                now = time.monotonic()
                core.expire(now)
                batches = core.pick(now)
                busy = bool(batches or core.finished or core.fences_to_prove())
                done = self._closing and core.buffered == 0
                wake = core.next_deadline()
            if not busy:
                if done:
                    return
                self._wake.wait(1.0 if wake is None else max(0.0, min(1.0, wake - now)))
                continue
            self._signal_finished()  # flush() waits for buffered to fall
            with self._guard:
                needed = core.fences_to_prove()
            if needed:  # the batches picked are of other partitions: they go now
                self._fence(transport, needed)
            if not batches:
                continue
            identity = self._identity()
            assert identity is not None
            steps = core.steps(keys, batches, identity)
            deadline = min(batch.deadline for batch in batches)
            try:
                results = transport.execute(steps, self._broker.scripts, deadline)
            except Halted:
                raise
            except Exception as exc:  # no answer (connection lost, or none by the deadline):
                transport.reset()  # every batch of the round goes again, or fails
                if not isinstance(exc, NETWORK_ERRORS):
                    log.exception("delayed send round failed")
                results = [exc] * len(steps)
            with self._guard:
                core.settle(batches, list(results), time.monotonic())
            self._signal_finished()

    def _fence(self, transport: Transport, needed: list[tuple[str, int]]) -> None:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration and store it on
        the partitions before their batches go again (a fenced instance's fail)."""
        identity = self._identity()
        assert identity is not None
        try:
            operation = identity_ops.prove_and_fence(self._broker.keys, identity, needed)
            self._broker.scripts.run_operation(operation)
        except NETWORK_ERRORS as exc:  # tried again; the batches' deadlines still hold
            log.warning("delayed sends: cannot prove the epoch yet: %s", type(exc).__name__)
            with self._guard:
                self._core.expire(time.monotonic())
            self._signal_finished()
            transport.pause(min(1.0, self._settings.retry_backoff_ms / 1000))
            return
        except Exception as exc:  # ProducerFenced: a newer instance has the name
            with self._guard:
                self._core.fence_failed(needed, exc)
            self._signal_finished()
            return
        with self._guard:
            for key in needed:
                self._core.partition_fenced(key)
