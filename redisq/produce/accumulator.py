"""The producer's core: batching, sequencing, in-flight and retry decisions. No I/O.

A driver (the thread driver in producer.py, the asyncio driver in redisq.asyncio) feeds it
events and carries out what it decides:

    append()            a message was queued: into the partition's open batch
    seal_due(now)       linger ran out, or a flush: seal open batches (base sequence, frozen)
    pick_work()         which sealed batches to send now (per partition, up to max_in_flight)
    complete()          the broker answered a batch
    refused()           the broker refused a batch: retry, fence first, or fail
    connection_lost()   replies in flight are lost: their outcome is unknown, send them again
    expire(now)         batches past delivery_timeout fail; the identity must change

Decisions the driver acts on: `fences_needed` (a named producer must prove its epoch on these
partitions before sending there again), `needs_new_identity` with `abandoned` (after batches
of unknown outcome failed: take a new epoch and fence these partitions before sending
anything), `fatal` (fenced by a newer instance: nothing more is sent).

Order per partition holds across every retry path: a partition's batches are sent in sequence
order, a batch after a refused one is refused too (OUT_OF_ORDER) and re-sent after it, and a
batch whose outcome is unknown is never re-sequenced: either it is acknowledged, or it fails and
its epoch is fenced before anything newer is sent to its partition.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from redisq.errors import (
    DeliveryTimeout,
    InvalidConfig,
    OutOfOrderSequence,
    PartitionGone,
    ProducerFenced,
    RedisqError,
    TopicNotFound,
    UnknownProducer,
)
from redisq.model.offsets import MAX_STREAM_ID_PART, offset_at
from redisq.model.records import RecordMetadata, batch_metadata
from redisq.model.stats import ProducerStats
from redisq.model.topic import TopicConfig
from redisq.protocol.produce import BatchResult, messages_per_call

PartitionKey = tuple[str, int]

# Error replies after which the script did not run (or ran with no effect): send again.
RETRIABLE_REPLIES = (
    "NOSCRIPT",
    "OOM",
    "BUSY",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "MOVED",
    "ASK",
)


class Batch:
    """Messages for one partition. Frozen once sent: a retry re-sends exactly these."""

    __slots__ = (
        "config",
        "topic",
        "partition",
        "layout",
        "args",
        "count",
        "nbytes",
        "base_seq",
        "span",
        "created",
        "sealed",
        "finished",
        "first_id",
        "ids",
        "dup_flags",
        "duplicate",
        "error",
        "in_flight",
        "attempts",
        "unknown",
        "body",
        "body_count",
        "waiter",
        "limit",
    )

    def __init__(self, config: TopicConfig, partition: int, layout: str, now: float) -> None:
        self.config = config  # the metadata it was routed with: retention, partition count
        self.topic = config.name
        self.partition = partition
        self.layout = layout
        self.args: list[bytes] = []
        self.count = 0
        self.nbytes = 0
        self.base_seq = -1
        self.span = 0
        self.created = now
        self.sealed = False
        self.finished = False
        self.first_id: str | None = None
        self.ids: tuple[str, ...] = ()
        self.dup_flags: str | None = None
        self.duplicate = False
        self.error: BaseException | None = None
        self.in_flight = False
        self.attempts = 0  # times written to a connection
        self.unknown = False  # a write whose reply never came: it may have been stored
        self.body: bytes | None = None
        self.body_count = 0
        self.waiter: Any = None  # the driver's (an Event and callbacks, or asyncio futures)
        self.limit = 0  # the most messages it may hold (ProducerCore.append sets it)

    def metadata(self, index: int) -> RecordMetadata:
        flags = self.dup_flags
        if flags is not None:  # message_id mode: appended ones are consecutive from first_id
            if flags[index] == "1":
                position = flags.count("1", 0, index)
                original = self.ids[position] if position < len(self.ids) else None
                return RecordMetadata(self.topic, self.partition, original, True)
            appended_before = index - flags.count("1", 0, index)
            offset = offset_at(self.first_id, appended_before) if self.first_id else None
            return RecordMetadata(self.topic, self.partition, offset, False)
        offset = offset_at(self.first_id, index) if self.first_id else None
        return RecordMetadata(self.topic, self.partition, offset, self.duplicate)

    def metadata_all(self) -> list[RecordMetadata]:
        """metadata(i) of every message, in order, made in one pass (sequence and plain batches:
        the offsets are consecutive from first_id)."""
        if self.dup_flags is not None:
            return [self.metadata(i) for i in range(self.count)]
        if not self.first_id:
            return [RecordMetadata(self.topic, self.partition, None, self.duplicate)] * self.count
        ms, _, seq = self.first_id.partition("-")
        first = int(seq)
        if first + self.count > MAX_STREAM_ID_PART:  # the sequence carries into the ms
            return [self.metadata(i) for i in range(self.count)]
        prefix = ms + "-"
        offsets = [prefix + s for s in map(str, range(first, first + self.count))]
        return batch_metadata(self.topic, self.partition, offsets, self.duplicate)


@dataclass
class PartitionState:
    """Sequence bookkeeping of one partition."""

    next_seq: int = 0  # base sequence of the next sealed batch
    acked_next: int = 0  # the sequence after the last acknowledged batch
    open: Batch | None = None
    unacked: deque[Batch] = field(default_factory=deque)


@dataclass(frozen=True, slots=True)
class CoreSettings:
    mode: str | None  # "sequence", "message_id" or None
    max_batch_messages: int
    max_batch_bytes: int
    max_in_flight: int
    linger_s: float
    delivery_timeout_s: float


class ProducerCore:
    """See the module docstring. Not thread-safe: the thread driver calls it under its lock."""

    def __init__(
        self,
        settings: CoreSettings,
        on_finished: Callable[[Batch], None],
        on_sealed: Callable[[Batch], None] | None = None,
    ) -> None:
        self.settings = settings
        self._max_batch_messages = settings.max_batch_messages
        self._max_batch_bytes = settings.max_batch_bytes
        self._on_finished = on_finished
        self._on_sealed = on_sealed
        # Sequence numbers count messages; in message_id mode they count batches.
        self._per_message_seq = settings.mode == "sequence"
        self._limits: dict[str, int] = {}  # batch size limit per layout (_limit_for)
        # Without idempotence the broker detects no gap: one batch in flight per partition keeps
        # the order when a batch fails and a later one would have succeeded.
        self._max_in_flight = settings.max_in_flight if settings.mode else 1
        self.partitions: dict[PartitionKey, PartitionState] = {}
        self.buffered = 0
        self.flush_requested = False
        self.closing = False
        self.fatal: BaseException | None = None
        self.needs_new_identity = False
        self.abandoned: set[PartitionKey] = set()
        self.fences_needed: set[PartitionKey] = set()
        self.reload_scripts = False
        # After a lost connection, one batch in flight per partition until one is acknowledged:
        # rounds that cannot complete between two disconnections would otherwise be re-sent in
        # vain until the delivery timeout.
        self.cautious = False
        self.last_error: BaseException | None = None
        self.stats = ProducerStats()

    # -- queuing ---------------------------------------------------------------------------------
    def state(self, key: PartitionKey) -> PartitionState:
        state = self.partitions.get(key)
        if state is None:
            state = self.partitions[key] = PartitionState()
        return state

    def append(
        self,
        config: TopicConfig,
        partition: int,
        layout: str,
        parts: bytes | list[bytes],
        size: int,
        now: float,
    ) -> tuple[Batch, int, bool]:
        """Add one encoded message to its partition's open batch; returns (batch, index within
        it, whether a new batch was opened: the driver then starts its linger clock). parts: the
        message's RESP pieces (encode_message), or all of them joined in one bytes object.

        Called once per message: kept to plain attribute reads (the limits are copied from the
        settings in __init__)."""
        key = (config.name, partition)
        state = self.partitions.get(key)
        if state is None:
            state = self.partitions[key] = PartitionState()
        batch = state.open
        opened = False
        if batch is not None and (
            batch.layout != layout
            or batch.count >= batch.limit
            or batch.nbytes + size > self._max_batch_bytes
            or batch.config is not config
        ):
            self.seal(state)
            batch = None
        if batch is None:
            batch = state.open = Batch(config, partition, layout, now)
            batch.limit = self._limits.get(layout) or self._limit_for(layout)
            opened = True
        if isinstance(parts, bytes):
            batch.args.append(parts)
        else:
            batch.args += parts
        index = batch.count
        batch.count = index + 1
        batch.nbytes += size
        self.buffered += 1
        self.stats.sent += 1
        if index + 1 >= batch.limit:
            self.seal(state)
        return batch, index, opened

    def _limit_for(self, layout: str) -> int:
        """max_batch_messages, or fewer where that many would not fit one script call: each
        message takes an argument per layout letter, plus its sequence number (sequence mode)."""
        per_message = len(layout) + (1 if self._per_message_seq else 0)
        limit = self._limits[layout] = min(self._max_batch_messages, messages_per_call(per_message))
        return limit

    def seal(self, state: PartitionState) -> None:
        """Freeze the open batch and give it its base sequence."""
        batch = state.open
        if batch is None:
            return
        state.open = None
        batch.sealed = True
        batch.span = batch.count if self._per_message_seq else 1
        batch.base_seq = state.next_seq
        state.next_seq += batch.span
        state.unacked.append(batch)
        if self._on_sealed is not None:
            self._on_sealed(batch)

    def seal_batch(self, batch: Batch) -> None:
        """Seal this batch now if it is still open (send() does not linger)."""
        state = self.partitions.get((batch.topic, batch.partition))
        if state is not None and state.open is batch:
            self.seal(state)

    def seal_due(self, now: float) -> float | None:
        """Seal open batches whose linger ran out (all, on flush or close); the next deadline."""
        next_deadline = None
        linger = self.settings.linger_s
        sealing_all = self.flush_requested or self.closing
        for state in self.partitions.values():
            batch = state.open
            if batch is None:
                continue
            due = batch.created + linger
            if sealing_all or due <= now:
                self.seal(state)
            elif next_deadline is None or due < next_deadline:
                next_deadline = due
        return next_deadline

    # -- sending ---------------------------------------------------------------------------------
    def pick_work(self) -> list[Batch]:
        """The batches to write now: per partition, the unacknowledged batches after the ones
        already in flight, up to max_in_flight. A partition whose in-flight batches follow one
        that must be re-sent waits until they come back (they will be refused as OUT_OF_ORDER
        and re-sent after it, in order). Nothing while the identity or a fence is pending."""
        work: list[Batch] = []
        if self.needs_new_identity or self.fatal is not None:
            return work
        limit = 1 if self.cautious else self._max_in_flight
        fences = self.fences_needed
        for key, state in self.partitions.items():
            if not state.unacked or (fences and key in fences):
                continue
            in_flight = 0
            seen_idle = False
            pending: list[Batch] = []
            for batch in state.unacked:
                if batch.in_flight:
                    if seen_idle:
                        pending = []
                        break
                    in_flight += 1
                else:
                    seen_idle = True
                    if in_flight + len(pending) < limit:
                        pending.append(batch)
                    elif not in_flight:
                        break
            for batch in pending:
                batch.in_flight = True
                batch.attempts += 1
                if batch.attempts > 1:
                    self.stats.retries += 1
            work += pending
        return work

    def acked_next(self, batch: Batch) -> int:
        return self.partitions[(batch.topic, batch.partition)].acked_next

    def oldest_deadline(self) -> float | None:
        """When the oldest unacknowledged batch runs out of delivery time."""
        oldest = None
        for state in self.partitions.values():
            if state.unacked:
                created = state.unacked[0].created
                if oldest is None or created < oldest:
                    oldest = created
        return None if oldest is None else oldest + self.settings.delivery_timeout_s

    # -- answers ---------------------------------------------------------------------------------
    def complete(self, batch: Batch, result: BatchResult) -> None:
        """The broker stored the batch (or answered it as a duplicate)."""
        batch.in_flight = False
        if batch.finished:  # failed meanwhile (delivery timeout, fencing)
            return
        batch.first_id = result.first_id
        batch.duplicate = result.duplicate
        batch.dup_flags = result.flags
        batch.ids = result.duplicate_ids
        self.cautious = False
        self.last_error = None  # what a DeliveryTimeout names: the errors since the last success
        self._retire(self.partitions[(batch.topic, batch.partition)], batch)

    def not_durable(self, batch: Batch, error: BaseException) -> None:
        """Written, but WAIT/WAITAOF did not confirm it in time: send again (the retry is
        answered as a duplicate with its offsets once it is durable)."""
        batch.in_flight = False
        self.last_error = error

    def refused(self, batch: Batch, error: BaseException) -> None:
        """The broker answered the batch with an error (the script ran and wrote nothing, or did
        not run): decide whether it goes again, waits for a fence, or fails."""
        batch.in_flight = False
        if batch.finished:
            return
        self.last_error = error
        text = str(error)
        if isinstance(error, OutOfOrderSequence):
            return  # a batch before it is missing: the whole tail goes again, in order
        if isinstance(error, UnknownProducer):
            self.fences_needed.add((batch.topic, batch.partition))
            return
        if isinstance(error, ProducerFenced):
            self.fail_all(error, fatal=True)
            return
        if isinstance(error, TopicNotFound | InvalidConfig):
            # Checked before any write (a topic deleted, or metadata out of range): nothing of
            # this partition's tail was written, so its sequences can be handed out again. (A
            # batch after this one cannot be written either: its sequence would leave a gap.)
            # Only a batch whose earlier reply was lost may have gone to the deleted topic.
            state = self.partitions[(batch.topic, batch.partition)]
            gone = isinstance(error, TopicNotFound)
            for failed in list(state.unacked):
                failed.error = (
                    PartitionGone(failed.topic, failed.partition, failed.config.partitions)
                    if gone and not failed.unknown
                    else error
                )
                self._retire(state, failed)
            state.next_seq = state.acked_next
            return
        if text.startswith("NOSCRIPT"):
            self.reload_scripts = True
            return
        if text.startswith(RETRIABLE_REPLIES) or getattr(error, "retriable", False):
            return
        # Anything else leaves the outcome unknown: fail what may have been written and take a
        # new epoch, so no later batch can be mistaken for one of these.
        batch.unknown = True
        self.fail_unknown(
            RedisqError(f"write to {batch.topic}[{batch.partition}] failed: {text}"), None
        )

    def redirected(self, batch: Batch) -> None:
        """MOVED/ASK: the command did not run; send again."""
        batch.in_flight = False

    def connection_lost(self, batches: Iterator[Batch] | list[Batch], error: BaseException) -> None:
        """Replies of these batches are lost: each may or may not have been stored. They go
        again (the window answers the stored ones as duplicates, with their offsets)."""
        self.cautious = True
        # A read that ran into the delivery deadline says less than what came before it (the
        # replicas that did not acknowledge, the server that refused): keep that one.
        if self.last_error is None or type(error).__name__ != "DeadlineReached":
            self.last_error = error
        for batch in batches:
            if batch.in_flight:
                batch.in_flight = False
                batch.unknown = True

    def expire(self, now: float) -> bool:
        """Fail everything once the oldest batch is past delivery_timeout (True if it did)."""
        deadline = self.oldest_deadline()
        if deadline is None or now < deadline:
            return False
        error = self.last_error
        detail = f" (last error: {type(error).__name__}: {error})" if error is not None else ""
        self.fail_unknown(
            DeliveryTimeout(
                f"not acknowledged within {self.settings.delivery_timeout_s:g} s{detail}"
            ),
            now,
        )
        return True

    def expire_waiting(self, now: float) -> None:
        """While nothing can be sent (a new epoch or a fence pending): batches whose linger ran
        out are sealed, so that they fail at their delivery timeout too."""
        self.seal_due(now)
        self.expire(now)

    def identity_failed(self, error: BaseException, network: bool) -> None:
        """A new epoch or a fence could not be stored: a network error is kept for the message
        of a DeliveryTimeout (the driver tries again); any other (ProducerFenced: a newer
        instance has the name) fails everything."""
        if network:
            self.last_error = error
        else:
            self.fail_all(error, fatal=True)

    # -- failing ---------------------------------------------------------------------------------
    def fail_unknown(self, error: BaseException, now: float | None) -> None:
        """Fail every batch whose outcome is unknown (written at least once without an answer,
        or in flight now) and every batch past its delivery timeout; keep the others, which were
        never stored, to be sent again under the new epoch. The partitions of failed batches
        that went on the wire are `abandoned`: the new epoch is fenced there before anything
        else is sent, so a late copy of a failed batch can never land after newer messages."""
        timeout = self.settings.delivery_timeout_s
        for key, state in self.partitions.items():
            kept: list[Batch] = []
            for batch in list(state.unacked):
                expired = now is not None and now - batch.created >= timeout
                if batch.unknown or batch.in_flight or expired:
                    if batch.attempts:
                        self.abandoned.add(key)
                    batch.error = error
                    self._retire(state, batch)
                else:
                    kept.append(batch)
            # A new epoch restarts sequences at 0 (as in Kafka): the kept batches, never stored,
            # get new ones.
            state.next_seq = 0
            state.acked_next = 0
            for batch in kept:
                batch.base_seq = state.next_seq
                state.next_seq += batch.span
                batch.body = None  # its sequence numbers are part of the encoded body
                batch.attempts = 0
        self.fences_needed.clear()
        self.needs_new_identity = True

    def fail_all(self, error: BaseException, fatal: bool = False) -> None:
        """Fail every unacknowledged batch (and, when fatal, the open ones: nothing more is
        sent)."""
        for state in self.partitions.values():
            for batch in list(state.unacked):
                batch.error = error
                self._retire(state, batch)
            state.next_seq = 0
            state.acked_next = 0
        if fatal:
            self.fatal = error
            for state in self.partitions.values():
                if state.open is not None:
                    batch = state.open
                    state.open = None
                    batch.error = error
                    self.buffered -= batch.count
                    self._finish(batch)
            return
        self.needs_new_identity = True

    def identity_renewed(self) -> None:
        """The driver took a new epoch and fenced every abandoned partition."""
        self.needs_new_identity = False
        self.abandoned.clear()
        self.cautious = False

    def partition_fenced(self, key: PartitionKey) -> None:
        """The driver stored the epoch on this partition (after UNKNOWN_PRODUCER)."""
        self.fences_needed.discard(key)

    def _retire(self, state: PartitionState, batch: Batch) -> None:
        try:
            state.unacked.remove(batch)
        except ValueError:  # already failed
            return
        if batch.error is None and batch.base_seq + batch.span > state.acked_next:
            state.acked_next = batch.base_seq + batch.span
        self.buffered -= batch.count
        self._finish(batch)

    def _finish(self, batch: Batch) -> None:
        batch.finished = True
        stats = self.stats
        if batch.error is None:
            stats.acknowledged += batch.count
            if batch.dup_flags is not None:
                stats.duplicates += batch.dup_flags.count("1")
            elif batch.duplicate:
                stats.duplicates += batch.count
        else:
            stats.failed += batch.count
            if isinstance(batch.error, ProducerFenced):
                stats.fenced += batch.count
        self._on_finished(batch)


def monotonic() -> float:
    return time.monotonic()
