"""The thread driver of delayed sends (the core and the guarantees: redisq.delayed)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from redisq import errors
from redisq import identity as identity_ops
from redisq.delayed import (
    DelayedBatch,
    DelayedCore,
    ScheduleIds,
    check_when_types,
    encode_delayed,
    when,
)
from redisq.errors import ProducerClosed, TopicNotFound
from redisq.futures import Waiter, remaining
from redisq.futures import finished as signal_finished
from redisq.protocol import run_operation
from redisq.protocol.produce import ProducerIdentity
from redisq.records import RecordMetadata
from redisq.scheduler import NETWORK_ERRORS, Scheduler
from redisq.sending import MessageEncoder
from redisq.settings import ProducerSettings
from redisq.stats import ProducerStats
from redisq.topic import TopicConfig
from redisq.transport import Halted, Transport

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle

log = logging.getLogger("redisq.producer")


class DelayedSender:
    """The thread driver of delayed sends for one producer: a sender thread started by the
    first delayed message, and a scheduler for the topics it sent to (so a producer alone
    delivers what it scheduled while it lives). future_type builds the producer's future of
    one message from (batch, index); forget_topic drops the producer's cached metadata."""

    def __init__(
        self,
        broker: BrokerHandle,
        settings: ProducerSettings,
        encoder: MessageEncoder,
        topic_config: Callable[[str], TopicConfig],
        identity: Callable[[], ProducerIdentity],
        future_type: Callable[[Any, int], Any],
        forget_topic: Callable[[str], None],
        stats: ProducerStats | None = None,
    ) -> None:
        self._broker = broker
        self._settings = settings
        self._encoder = encoder
        self._topic_config = topic_config
        self._identity = identity
        self._future_type = future_type
        self._forget_topic = forget_topic  # the producer's cached metadata of a deleted topic
        self._core = DelayedCore(settings, encoder.batch_sealed, stats)
        self._cond = threading.Condition(threading.Lock())
        self._ids: ScheduleIds | None = None
        self._thread: threading.Thread | None = None
        # The thread's connections, which close() can halt while it waits for replies.
        self._transport = Transport(broker.client, settings.delivery_timeout_ms)
        self._scheduler: Scheduler | None = None
        self._scheduled_topics: set[str] = set()
        self._closing = False
        self._configs: dict[str, tuple[float, TopicConfig]] = {}
        self._refreshing: set[str] = set()

    def send_async(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        delay_ms: int | None,
        deliver_at: datetime | None,
    ) -> Any:
        """Queue a delayed message (bad input raises here, nothing queued); its future."""
        batch, index = self._queue(
            topic, value, key, headers, message_id, partition, delay_ms, deliver_at
        )
        return self._future_type(batch, index)

    def send(self, *args: Any, timeout: float | None = None) -> RecordMetadata:
        """Queue and send at once (no linger); block until acknowledged."""
        batch, index = self._queue(*args)
        with self._cond:
            self._core.seal(batch)
            self._cond.notify_all()
        result: RecordMetadata = self._future_type(batch, index).result(timeout)
        return result

    def _queue(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        delay_ms: int | None,
        deliver_at: datetime | None,
    ) -> tuple[DelayedBatch, int]:
        check_when_types(delay_ms, deliver_at)
        if self._closing:
            raise ProducerClosed("send after close()")
        config = self._config(topic)
        when_ = when(config, delay_ms, deliver_at)
        identity = self._identity()
        if self._ids is None:
            self._ids = ScheduleIds(identity)
        p, scheduled = encode_delayed(
            self._encoder, self._settings.idempotence, self._ids, identity, config, when_,
            value, key, headers, message_id, partition,
        )  # fmt: skip
        with self._cond:
            if self._core.buffered >= self._settings.max_buffered_messages:
                self._wait_for_buffer_space()
            batch, index, opened = self._core.append(config, p, scheduled, time.monotonic())
            if batch.waiter is None:
                batch.waiter = Waiter()
            if opened or batch.sealed:
                self._cond.notify_all()
            if topic not in self._scheduled_topics:
                self._start(topic)
        return batch, index

    def _config(self, topic: str) -> TopicConfig:
        """The topic's metadata: read by the first send to it; then read again in the
        background once older than metadata_max_age_ms (a silent server must not stall send)."""
        cached = self._configs.get(topic)
        if cached is None:
            config = self._topic_config(topic)  # TopicNotFound, ProducerFenced raise here
            self._configs[topic] = (time.monotonic(), config)
            return config
        if time.monotonic() - cached[0] >= self._settings.metadata_max_age_ms / 1000:
            with self._cond:
                start = topic not in self._refreshing
                self._refreshing.add(topic)
            if start:
                threading.Thread(target=self._refresh, args=(topic,), daemon=True).start()
        return cached[1]

    def _refresh(self, topic: str) -> None:
        try:
            self._configs[topic] = (time.monotonic(), self._topic_config(topic))
        except TopicNotFound:  # the next send reads it again, and raises
            self._configs.pop(topic, None)
        except Exception as exc:  # kept: the next send tries again
            log.debug("metadata refresh of %s failed: %s", topic, exc)
        finally:
            with self._cond:
                self._refreshing.discard(topic)

    def _wait_for_buffer_space(self) -> None:
        limit = self._settings.max_buffered_messages
        deadline = time.monotonic() + self._settings.max_block_ms / 1000
        while self._core.buffered >= limit:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.RedisqError(
                    f"buffer full ({limit} delayed messages) for "
                    f"max_block_ms={self._settings.max_block_ms}"
                )
            self._cond.wait(remaining)

    def _start(self, topic: str) -> None:
        """(Lock held.) The sender thread, and the scheduler of this topic."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="redisq-delayed", daemon=True)
            self._thread.start()
        self._scheduled_topics.add(topic)
        if self._scheduler is None:
            self._scheduler = Scheduler(self._broker)
        self._scheduler.add_topic(topic)

    def flush(self, timeout: float | None = None) -> None:
        """Send what is queued now; wait until it is acknowledged or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._core.flush_requested = True
            self._cond.notify_all()
            try:
                while self._core.buffered > 0:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"flush: {self._core.buffered} delayed messages still unacknowledged"
                        )
                    self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))
            finally:
                self._core.flush_requested = False

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the sender thread and the scheduler (its leases are handed back). With a
        timeout, within about that time: what is still unacknowledged then fails with
        ProducerClosed (it may or may not be stored)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._thread is not None:
                self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._core.fail_all(ProducerClosed("the producer was closed"))
                self._cond.notify_all()
            self._signal_finished()
            if self._thread is not None:
                self._stop_thread(self._thread, deadline)
            if self._scheduler is not None:
                self._scheduler.close(5.0 if deadline is None else remaining(deadline))

    def _stop_thread(self, thread: threading.Thread, deadline: float | None) -> None:
        thread.join(5 if deadline is None else remaining(deadline))
        if thread.is_alive():  # waiting for replies that did not come in time
            self._transport.halt()
            thread.join(1)
        if thread.is_alive():
            log.warning("the delayed sender did not stop at close(): its sends settle later")
            return
        self._fail_in_flight()

    def _fail_in_flight(self) -> None:
        with self._cond:
            self._core.fail_all(
                ProducerClosed("closed before the batch was acknowledged: it may or may not be "
                               "stored"), in_flight=True,
            )  # fmt: skip
            self._cond.notify_all()
        self._signal_finished()

    def _signal_finished(self) -> None:
        with self._cond:
            finished, self._core.finished = self._core.finished, []
        for batch in finished:
            if isinstance(batch.error, TopicNotFound):  # deleted: the next send reads it again
                self._configs.pop(batch.topic, None)
                self._forget_topic(batch.topic)
            signal_finished(batch)

    def _run(self) -> None:
        # Connections of its own whose reads wait no longer than the round's first delivery
        # deadline (redisq.transport): a silent network fails a batch at its delivery timeout.
        transport = self._transport
        try:
            self._send_rounds(transport)
        except Halted:  # close() ran out of time: what is unacknowledged fails now
            self._fail_in_flight()
        finally:
            transport.close()

    def _send_rounds(self, transport: Transport) -> None:
        core, keys = self._core, self._broker.keys
        while True:
            with self._cond:
                batches = self._next_batches()
            self._signal_finished()
            if batches is None:
                return
            with self._cond:
                needed = core.fences_to_prove()
            if needed:  # the batches picked are of other partitions: they go now
                self._fence(needed)
            if not batches:
                continue
            steps = core.steps(keys, batches, self._identity())
            deadline = min(batch.deadline for batch in batches)
            try:
                results = transport.execute(steps, self._broker.scripts, deadline)
            except Halted:
                raise
            except Exception as exc:  # no answer (connection lost, or none by the deadline):
                transport.reset()  # every batch of the round goes again, or fails if past it
                if not isinstance(exc, NETWORK_ERRORS):
                    log.exception("delayed send round failed")
                results = [exc] * len(steps)
            with self._cond:
                core.settle(batches, list(results), time.monotonic())
                self._cond.notify_all()
            self._signal_finished()

    def _fence(self, needed: list[tuple[str, int]]) -> None:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration and store it on
        the partitions before their batches go again (a fenced instance's fail)."""
        try:
            operation = identity_ops.prove_and_fence(self._broker.keys, self._identity(), needed)
            run_operation(operation, self._broker.scripts.execute)
        except NETWORK_ERRORS as exc:  # tried again; the batches' deadlines still hold
            log.warning("delayed sends: cannot prove the epoch yet: %s", type(exc).__name__)
            self._transport.pause(min(1.0, self._settings.retry_backoff_ms / 1000))
            return
        except Exception as exc:  # ProducerFenced: a newer instance has the name
            with self._cond:
                self._core.fence_failed(needed, exc)
                self._cond.notify_all()
            self._signal_finished()
            return
        with self._cond:
            for key in needed:
                self._core.partition_fenced(key)
            self._cond.notify_all()

    def _next_batches(self) -> list[DelayedBatch] | None:
        """(Lock held.) Wait for batches to send; None once closed and empty."""
        core = self._core
        while True:
            now = time.monotonic()
            core.expire(now)
            batches = core.pick(now)
            if batches or core.finished or core.fences_to_prove():
                self._cond.notify_all()  # flush() waits for buffered to fall
                return batches
            if self._closing and core.buffered == 0:
                return None
            wake = core.next_deadline()
            self._cond.wait(1.0 if wake is None else max(0.0, min(1.0, wake - now)))
