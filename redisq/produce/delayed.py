"""Delayed messages, the producer's side (DESIGN §12): the checks, schedule ids, and per-partition
batches of delayed messages. No I/O: the thread driver (delayed_sender.py) and the asyncio
driver (asyncio/delayed_sender.py) share it.

`producer.send(topic, value, delay_ms=...)` (or deliver_at=) is acknowledged once schedule.lua
has stored the message in its partition's schedule; a scheduler appends it when it is due
(redisq.schedule.scheduler). Each message carries a schedule id, fixed when it is queued: the
sender's
identity and a counter (zero-padded, so messages of equal due time go in send order), or its
message id in idempotence="message_id" mode. A batch that gets no answer (a lost connection) is
sent again, the same ids in the same batch, until delivery_timeout_ms: schedule.lua stores an
id once, and refuses it after delivery for as long as the sender may still retry.

One batch per partition is on the wire at a time and a failed one goes again before the next:
due times come from the server's clock when a batch is stored, so messages with the same key
and the same delay keep their send order.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import redis

from redisq.errors import (
    DeliveryTimeout,
    InvalidConfig,
    NotEnoughReplicas,
    ProducerFenced,
    UnknownProducer,
)
from redisq.model.keys import KeySpace
from redisq.model.records import RecordMetadata
from redisq.model.stats import ProducerStats
from redisq.model.topic import TopicConfig
from redisq.produce.encoder import MessageEncoder, ack_failure
from redisq.protocol import Step
from redisq.protocol import schedule as calls
from redisq.protocol.produce import ProducerIdentity, messages_per_call, replicated
from redisq.protocol.rounds import DeadlineReached
from redisq.protocol.schedule import Scheduled, ScheduleResult
from redisq.schedule.core import NETWORK_ERRORS
from redisq.settings import ProducerSettings

# The longest delay of a topic without a retention age: RocketMQ 5's default limit.
MAX_DELAY_MS = 3 * 24 * 3600 * 1000
# After its delivery timeout a sender sends nothing more; a request still on the wire then may
# arrive a little later, so delivered ids are refused this much longer.
RETRY_MARGIN_MS = 5_000

TopicPartition = tuple[str, int]


# -- checks -------------------------------------------------------------------------------------
def check_when_types(delay_ms: object, deliver_at: object) -> None:
    """The checks that need no topic: one of the two, of the right type (TypeError), a
    deliver_at with a time zone (a naive datetime is refused: its meaning depends on the
    machine's zone)."""
    if delay_ms is not None and deliver_at is not None:
        raise InvalidConfig("give delay_ms or deliver_at, not both")
    if delay_ms is not None and (isinstance(delay_ms, bool) or not isinstance(delay_ms, int)):
        raise TypeError(f"delay_ms must be an int (milliseconds), not {type(delay_ms).__name__}")
    if deliver_at is not None:
        if not isinstance(deliver_at, datetime):
            raise TypeError(f"deliver_at must be a datetime, not {type(deliver_at).__name__}")
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise TypeError(
                "deliver_at must carry a time zone (a naive datetime is ambiguous): e.g. "
                "datetime.now(timezone.utc) + timedelta(minutes=5)"
            )


def max_delay_ms(config: TopicConfig) -> int:
    """How far ahead a message of this topic may be scheduled: its retention age, else 3 days."""
    return config.retention_ms or MAX_DELAY_MS


def when(
    config: TopicConfig, delay_ms: int | None, deliver_at: datetime | None
) -> tuple[int | None, int | None]:
    """(delay_ms, deliver_at_ms) of arguments that passed check_when_types, checked against
    the topic's limit (InvalidConfig). A deliver_at in the past is due at once; how far ahead
    it is is measured with this machine's clock, the due time itself is kept as given (from
    1970 on)."""
    limit = config.retention_ms or MAX_DELAY_MS
    if delay_ms is not None:
        if not 1 <= delay_ms <= limit:
            raise InvalidConfig(f"delay_ms={delay_ms} is out of range: 1..{limit} ({_why(config)})")
        return delay_ms, None
    assert deliver_at is not None
    at_ms = int(deliver_at.timestamp() * 1000)
    ahead_ms = at_ms - time.time() * 1000
    if ahead_ms > limit:
        raise InvalidConfig(
            f"deliver_at={deliver_at.isoformat()} is {ahead_ms:.0f} ms ahead, more than "
            f"{limit} ({_why(config)})"
        )
    return None, max(0, at_ms)  # before 1970: due at once (due times are not negative)


def _why(config: TopicConfig) -> str:
    return f"the retention of topic {config.name!r}" if config.retention_ms else "3 days"


class ScheduleIds:
    """Schedule ids of one producer: "s:<producer id>:<epoch>:<counter>" (hex, the counter
    zero-padded: equal due times sort in send order), or "m:<message id>"."""

    def __init__(self, identity: ProducerIdentity) -> None:
        self._prefix = b"s:%x:%012x:" % (identity.producer_id, identity.epoch)
        self._counter = itertools.count()  # next() on it is atomic under the GIL: no lock

    def next_id(self, message_id: bytes | None) -> bytes:
        if message_id is not None:
            return b"m:" + message_id
        return self._prefix + b"%012x" % next(self._counter)


# -- the core -----------------------------------------------------------------------------------
class DelayedBatch:
    """Delayed messages of one partition stored by one schedule.lua call; frozen once sent."""

    __slots__ = (
        "topic",
        "partition",
        "config",
        "messages",
        "opened",
        "deadline",
        "sealed",
        "retry_at",
        "sent",
        "result",
        "error",
        "last_error",
        "waiter",
        "size",
        "nonce",
        "marks",
    )

    def __init__(self, config: TopicConfig, partition: int, now: float, timeout_s: float) -> None:
        self.topic = config.name
        self.partition = partition
        self.config = config
        self.messages: list[Scheduled] = []
        self.opened = now
        self.deadline = now + timeout_s
        self.sealed = False
        self.retry_at = 0.0
        self.sent = False  # went on the wire at least once: a failure's outcome is unknown
        self.result: ScheduleResult | None = None
        self.error: BaseException | None = None
        self.last_error: BaseException | None = None
        self.waiter: Any = None  # the driver's completion signal
        self.size = 0  # bytes of its messages (sealed at max_batch_bytes, as plain batches are)
        self.nonce = os.urandom(8).hex()  # names every copy of it (schedule.lua's ABANDONED)
        self.marks: list[str] = []  # given-up batches' nonces its last copy marked

    def metadata(self, index: int) -> RecordMetadata:
        assert self.result is not None
        flag = self.result.flags[index]
        return RecordMetadata(
            self.topic,
            self.partition,
            None,
            duplicate=flag != "0",
            schedule_id=self.messages[index].schedule_id.decode(errors="backslashreplace"),
            deliver_at_ms=self.result.due_ms[index],
        )


class DelayedCore:
    """The queues of delayed messages per partition and the decisions about them: which batches
    to send now, what a reply means, when to retry or give up. No I/O, no locks (the thread
    driver holds its lock around every call)."""

    def __init__(
        self,
        settings: ProducerSettings,
        on_sealed: Callable[[Any], None],
        stats: ProducerStats | None = None,
    ) -> None:
        self.settings = settings
        self.stats = stats if stats is not None else ProducerStats()  # the producer's counters
        self._on_sealed = on_sealed  # keyless messages move on to the next partition
        # schedule.lua takes 4 arguments per message (id, delay, due time, payload).
        self._max_messages = min(settings.max_batch_messages, messages_per_call(4))
        self._max_bytes = settings.max_batch_bytes
        self._linger_s = settings.linger_ms / 1000
        self._timeout_s = settings.delivery_timeout_ms / 1000
        self._queues: dict[TopicPartition, deque[DelayedBatch]] = {}
        self._in_flight: set[TopicPartition] = set()
        # UNKNOWN_PRODUCER (a named sender whose epoch the partition does not carry): nothing is
        # sent there until the driver proved the epoch and stored it (partition_fenced()).
        self.fences_needed: set[TopicPartition] = set()
        # Nonces of batches given up on after they went on the wire (a copy may still land):
        # the next batch sent to the partition marks them refused before it is stored.
        self.given_up: dict[TopicPartition, list[str]] = {}
        self.buffered = 0
        self.flush_requested = False
        self.finished: list[DelayedBatch] = []  # for the driver to signal, outside its lock

    def append(
        self, config: TopicConfig, partition: int, message: Scheduled, now: float
    ) -> tuple[DelayedBatch, int, bool]:
        """Queue a message; (its batch, its index there, whether the batch was opened now)."""
        queue = self._queues.setdefault((config.name, partition), deque())
        size = len(message.body) + len(message.schedule_id)
        if queue and not queue[-1].sealed and queue[-1].size + size > self._max_bytes:
            self.seal(queue[-1])  # full by bytes: this message opens the next batch
        opened = not queue or queue[-1].sealed
        if opened:
            queue.append(DelayedBatch(config, partition, now, self._timeout_s))
        batch = queue[-1]
        batch.messages.append(message)
        batch.size += size
        self.buffered += 1
        self.stats.sent += 1
        if len(batch.messages) >= self._max_messages:
            self.seal(batch)
        return batch, len(batch.messages) - 1, opened

    def seal(self, batch: DelayedBatch) -> None:
        """No more messages join this batch (full, or send() wants it out now)."""
        if not batch.sealed:
            batch.sealed = True
            self._on_sealed(batch)

    def pick(self, now: float) -> list[DelayedBatch]:
        """The head batch of each partition with none on the wire, once it is full, lingered,
        asked for (send(), flush()) or due for a retry."""
        picked = []
        for key, queue in self._queues.items():
            if key in self._in_flight or key in self.fences_needed or not queue:
                continue
            head = queue[0]
            ready = head.sealed or self.flush_requested or now - head.opened >= self._linger_s
            if ready and head.retry_at <= now:
                self.seal(head)
                self._in_flight.add(key)
                picked.append(head)
        return picked

    def next_deadline(self) -> float | None:
        """When pick() or expire() has something to do next (monotonic seconds)."""
        times = []
        for key, queue in self._queues.items():
            if queue and key not in self._in_flight:
                head = queue[0]
                times.append(min(head.deadline, max(head.retry_at, head.opened + self._linger_s)))
        return min(times, default=None)

    def steps(
        self, keys: KeySpace, batches: list[DelayedBatch], identity: ProducerIdentity
    ) -> list[Step]:
        """The calls of one round: a schedule.lua call per batch (under the producer's current
        epoch: a fenced instance is refused), then WAIT / WAITAOF for acks="replicas" /
        "fsync" on the same connection."""
        horizon = self.settings.delivery_timeout_ms + RETRY_MARGIN_MS
        fenced = self.settings.idempotence is not None
        out: list[Step] = []
        for b in batches:
            b.marks = list(self.given_up.get((b.topic, b.partition), ()))
            out.append(
                calls.schedule(
                    keys,
                    b.topic,
                    b.partition,
                    b.messages,
                    identity=identity,
                    fenced=fenced,
                    retry_horizon_ms=horizon,
                    nonce=b.nonce,
                    given_up=b.marks,
                )
            )
        s = self.settings
        if s.acks != "leader":
            # A barrier write per batch on its node's connection before WAIT / WAITAOF: a retry
            # answered as already scheduled writes nothing (see lua/ack_barrier.lua).
            anchors = [keys.log(b.topic, b.partition) for b in batches]
            out += replicated(anchors, s.acks, s.min_replicas, s.ack_timeout_ms)
        for batch in batches:
            batch.sent = True
        return out

    def settle(self, batches: list[DelayedBatch], results: list[Any], now: float) -> None:
        """The replies of a round (steps()), in order: the batches', then (acks "replicas" /
        "fsync") each batch's barrier and the WAIT / WAITAOF after them, which answers for the
        barriers of its own node ({step index: reply}), or one exception for all (no answer)."""
        n = len(batches)
        leader = self.settings.acks == "leader"
        acked = {} if leader else results[2 * n]
        for i, (batch, result) in enumerate(zip(batches, results, strict=False)):
            durable: BaseException | None = None
            if not leader:
                barrier = results[n + i]
                reply = acked if isinstance(acked, BaseException) else acked.get(n + i)
                if isinstance(barrier, BaseException):
                    durable = barrier
                elif reply is None:  # not asked on its node: never taken as acknowledged
                    durable = NotEnoughReplicas(f"acks={self.settings.acks}: no answer")
                else:
                    durable = ack_failure(reply, self.settings)
            if isinstance(result, ScheduleResult) and durable is None:
                self._complete(batch, result)
            elif isinstance(result, ScheduleResult):
                self.failed(batch, durable, now)  # stored, maybe not on a replica: again
            else:
                self.failed(batch, result, now)

    def _complete(self, batch: DelayedBatch, result: ScheduleResult) -> None:
        batch.result = result
        key = (batch.topic, batch.partition)
        if batch.marks and key in self.given_up:  # marked now: not sent again
            left = [n for n in self.given_up[key] if n not in batch.marks]
            if left:
                self.given_up[key] = left
            else:
                del self.given_up[key]
        self._done(batch)

    def failed(self, batch: DelayedBatch, error: BaseException | None, now: float) -> None:
        """A batch without an answer (or a retriable refusal) goes again after a backoff, the
        same messages with the same ids, until its deadline; other refusals end it."""
        self._in_flight.discard((batch.topic, batch.partition))
        if isinstance(error, UnknownProducer) and now < batch.deadline:
            self.fences_needed.add((batch.topic, batch.partition))  # nothing was stored
        retriable = isinstance(error, (*NETWORK_ERRORS, redis.ResponseError)) or bool(
            getattr(error, "retriable", False)
        )
        if retriable and now < batch.deadline:
            self.stats.retries += 1
            batch.last_error = error
            backoff_ms = self.settings.retry_backoff_ms * (0.5 + random.random())
            batch.retry_at = now + min(1.0, backoff_ms / 1000)
            return
        if isinstance(error, DeadlineReached) and batch.last_error is not None:
            error = batch.last_error  # says more than the read that ran into the deadline
        batch.error = error if not retriable else self._timeout(batch, error)
        self._done(batch)

    def _timeout(self, batch: DelayedBatch, error: BaseException | None) -> DeliveryTimeout:
        outcome = "may have been stored" if batch.sent else "were not stored"
        return DeliveryTimeout(
            f"{len(batch.messages)} delayed messages for {batch.topic}/{batch.partition} not "
            f"acknowledged within delivery_timeout_ms={self.settings.delivery_timeout_ms} "
            f"(they {outcome}); last error: {error!r}"
        )

    def fences_to_prove(self) -> list[TopicPartition]:
        """The partitions that wait for the driver to prove the epoch (and have batches)."""
        self.fences_needed = {key for key in self.fences_needed if self._queues.get(key)}
        return sorted(self.fences_needed)

    def partition_fenced(self, key: TopicPartition) -> None:
        """The driver proved the epoch and stored it on this partition: its batches go again."""
        self.fences_needed.discard(key)

    def fence_failed(self, keys: list[TopicPartition], error: BaseException) -> None:
        """Proving the epoch was refused (ProducerFenced): the batches of those partitions fail."""
        for key in keys:
            self.fences_needed.discard(key)
            for batch in list(self._queues.get(key, ())):
                if key not in self._in_flight or batch is not self._queues[key][0]:
                    batch.error = error
                    self._done(batch)

    def expire(self, now: float) -> None:
        """Fail the head batches (not on the wire) whose delivery timeout has passed."""
        for key, queue in list(self._queues.items()):
            while queue and key not in self._in_flight and queue[0].deadline <= now:
                head = queue[0]
                head.error = self._timeout(head, head.last_error)
                self._done(head)

    def fail_all(self, error: BaseException, in_flight: bool = False) -> None:
        """Close without sending what is queued (its callers learn it); with in_flight, the
        sender has stopped: the batches it had sent and not heard back of fail too (stored
        or not, unknown)."""
        for key, queue in list(self._queues.items()):
            sending = key in self._in_flight and not in_flight
            for batch in [b for b in queue if not sending or b is not queue[0]]:
                batch.error = error
                self._done(batch)

    def _done(self, batch: DelayedBatch) -> None:
        key = (batch.topic, batch.partition)
        self._in_flight.discard(key)
        queue = self._queues[key]
        queue.remove(batch)
        if not queue:
            del self._queues[key]
        self.buffered -= len(batch.messages)
        count, stats = len(batch.messages), self.stats
        if batch.error is None:
            stats.acknowledged += count
            if batch.result is not None:
                stats.duplicates += count - batch.result.flags.count("0")
        else:
            stats.failed += count
            if isinstance(batch.error, ProducerFenced):
                stats.fenced += count
            if batch.sent:  # a copy may still land: refused once the next batch there is stored
                self.given_up.setdefault(key, []).append(batch.nonce)
        self.finished.append(batch)


def encode_delayed(
    encoder: MessageEncoder,
    mode: str | None,
    ids: ScheduleIds,
    identity: ProducerIdentity,
    config: TopicConfig,
    when_: tuple[int | None, int | None],
    value: bytes | str,
    key: bytes | str | None,
    headers: Mapping[str, str | bytes] | None,
    message_id: bytes | str | int | None,
    partition: int | None,
) -> tuple[int, Scheduled]:
    """Check, route and encode one delayed message (MessageEncoder: the same rules as any
    message); (its partition, the message as schedule.lua takes it)."""
    encoded = encoder.encode(config, value, key, headers, message_id, partition)
    # In message_id mode the id (given or generated) names the message in the schedule too.
    by_id = mode == "message_id" and encoded.layout.endswith("m")
    schedule_id = ids.next_id(encoded.parts[-2] if by_id else None)
    body = b"".join(encoded.parts)
    delay_ms, at_ms = when_
    scheduled = Scheduled(schedule_id, delay_ms, at_ms, identity.producer_id, encoded.layout, body)
    return encoded.partition, scheduled
