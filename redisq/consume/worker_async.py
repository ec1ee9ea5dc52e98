"""run(): the task (a thread in the thread API, generated from this module by
tools/async_to_sync.py) that handles one partition: reading like a log under the lease, handling
each message under the failure policy, committing; or competing in concurrent mode.

The decisions are the cores' (dispatch.OrderlyPartition for where to read and what to commit,
chunks.py for how a read is taken, policies.handle_under_policy for what a failure leads to);
the Redis calls are PartitionIO's. In the asyncio API a plain handler function runs in a worker
thread (a slow one does not stall the event loop); a coroutine function is awaited.

A little over 500 lines: the orderly and concurrent loops share one handling path (the plain run,
then a message's attempts under the policy, dead letters, malformed entries).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from itertools import chain
from typing import TYPE_CHECKING, Any

import redis

from redisq.consume.chunks import admitted_chunks, lanes, lanes_end
from redisq.consume.coordinator_async import mark_own
from redisq.consume.dispatch import OrderlyPartition
from redisq.consume.ownership import TopicPartition
from redisq.consume.policies import (
    CallHandler,
    DeadLetter,
    GaveUp,
    MarkBlocked,
    handle_under_policy,
)
from redisq.errors import LeaseLost, log_text
from redisq.model.records import DECODE_CHUNK, MalformedMessage, Message
from redisq.model.topic import TopicConfig
from redisq.produce.transactions import RETRIABLE_ERRORS
from redisq.protocol.group import Commit, Lease
from redisq.runtime import APool, acall_user, asleep, is_async

if TYPE_CHECKING:
    from redisq.consume.coordinator_async import Coordinator

log = logging.getLogger("redisq.consumer")

# Connection errors and a cluster's redirections the reads met after following them for a while
# (a slot migrating): the partition is read or committed again later, and kept.
_NETWORK_ERRORS = RETRIABLE_ERRORS


class _Stop(Exception):
    """The partition must stop being handled (revoked, lease lost or near its deadline, close)."""


class _Retry(Exception):
    """A malformed entry blocks, or a seek came while a message was retried: the worker reads
    the partition again from its position."""


class _Paused(Exception):
    """pause(): the read is handled up to `offset` (not included); the rest is read again."""

    def __init__(self, offset: str) -> None:
        super().__init__(offset)
        self.offset = offset


class Worker:
    """run(): one partition's handler loop, one message at a time in offset order (or in
    key_concurrency lanes), stopping when the partition is revoked, its lease is lost or near
    its deadline, or the consumer closes."""

    def __init__(
        self, consumer: Coordinator, tp: TopicPartition, reader: OrderlyPartition | None
    ) -> None:
        self.consumer = consumer
        self.tp = tp
        self.reader = reader
        self.io = consumer.io
        self.policy = consumer.policy
        self.settings = consumer.settings
        self._lanes: APool | None = None
        self._pending_acks: list[str] = []
        # concurrent: a pause stopped a read part way; its rest is pending on this member
        self._own_pending = False

    async def _counts(self, config: TopicConfig) -> list[Any] | None:
        """A batch topic's partition counters (m messages in e entries, DESIGN §14.6), for the
        size of its first read; None when they cannot be read (the first read is then cut)."""
        if config.entry_format != "batch":
            return None
        broker = self.consumer.broker
        try:
            return list(await broker.client.hmget(broker.keys.counts(*self.tp), ["m", "e"]))
        except redis.RedisError:
            return None

    async def run(self) -> None:
        consumer = self.consumer
        mark_own(consumer)
        try:
            config = await consumer.broker.topic_config(self.tp[0])
            self.io.sizes.expect(self.tp, config.entry_format, await self._counts(config))
            if self.reader is not None:
                await self._orderly(self.reader)
            else:
                await self._concurrent()
        except _Stop:
            pass
        except LeaseLost:
            log.warning("%s: %s/%d: lease lost; stopping", consumer.name, *self.tp)
            with consumer._guard:
                if consumer.ownership.lost(self.tp):
                    consumer.stats.leases_lost += 1
        except Exception:
            log.exception("%s: %s/%d worker failed", consumer.name, *self.tp)
        finally:
            if self._lanes is not None:
                self._lanes.shutdown()
            if self.reader is None:
                await self._flush_group_acks()
            await consumer.worker_done(self.tp)

    # -- ownership -------------------------------------------------------------------------------
    def _may_handle(self) -> bool:
        consumer = self.consumer
        with consumer._guard:
            if self.reader is None:
                return not consumer._stopping.is_set() and self.tp in consumer.ownership.owned
            return consumer.ownership.may_handle(self.tp, time.monotonic())

    def _check(self) -> None:
        if not self._may_handle():
            raise _Stop

    def _paused(self) -> bool:
        with self.consumer._guard:
            owned = self.consumer.ownership.owned.get(self.tp)
            return owned is not None and owned.paused

    async def _sleep_while_owned(self, delay: float) -> None:
        end = time.monotonic() + delay
        while True:
            self._check()
            left = end - time.monotonic()
            if left <= 0:
                return
            await asleep(min(left, 0.05))

    # -- orderly ---------------------------------------------------------------------------------
    async def _orderly(self, reader: OrderlyPartition) -> None:
        consumer = self.consumer
        guard = consumer._guard
        batch = self.settings.batch_size
        lanes_of = self.settings.key_concurrency
        interval = consumer._ack_interval_s
        caught_up = False
        while self._may_handle():
            if self._paused():
                await self._commit_if_due(reader, interval)
                await asleep(0.05)
                continue
            if reader.parked_check_due(time.monotonic()):
                parked_now = await self.io.parked_now(self.tp)
                with guard:
                    free = reader.released(parked_now)
                if free:
                    try:
                        for message in await self.io.fetch_offsets(self.tp, free):
                            if self._paused():  # no further message starts; the rest stay
                                with guard:  # held, released again after resume()
                                    reader.next_parked_check = 0.0
                                break
                            await self._handle_one(reader, message, lane=False)
                    except _Retry:  # a seek while one of them was retried
                        pass
                    except redis.RedisError as exc:  # they stay held, and go first
                        log.warning(
                            "%s: %s/%d: reading released messages: %s", consumer.name, *self.tp, exc
                        )
                        with guard:
                            reader.next_parked_check = 0.0
                        await self._sleep_while_owned(0.2)
                    continue
            # Caught up (the last read was not a full batch): commit what was handled, then
            # wait for entries and read them in one round trip, no longer than the lease allows.
            # (Not inside an entry: a waiting read passes the rest of it over, DESIGN §14.7.)
            block_ms = self._block_ms(reader) if caught_up and reader.at_boundary else 0
            moves = reader.moves  # taken before the read starts: a seek after it drops the read
            # about batch_size messages: fewer entries when they are batch entries
            asked = self.io.sizes.entries_to_run(self.tp, batch)
            try:
                if block_ms > 0:
                    read = await self._commit_and_wait(reader, asked, block_ms)
                else:
                    read = await self.io.read_range(reader, asked)
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: %s; reading again", consumer.name, *self.tp, exc)
                await asleep(0.2)
                continue
            self.io.sizes.note_entries(self.tp, read)
            caught_up = len(read) < asked
            try:
                chunks = admitted_chunks(reader, read, DECODE_CHUNK, guard, moves)
                if lanes_of > 1:
                    for messages in chunks:
                        if self._paused():  # lanes stop between chunks of DECODE_CHUNK
                            raise _Paused(messages[0].offset)
                        await self._handle_batch(reader, messages)
                        await self._commit_if_due(reader, interval)
                else:
                    await self._handle_plain(reader, chain.from_iterable(chunks))
            except _Retry:
                caught_up = False
                continue
            except _Paused as paused:
                with guard:
                    reader.stopped_before(paused.offset, moves)
                caught_up = False
                continue
            await self._commit_if_due(reader, interval)

    async def _commit_and_wait(
        self, reader: OrderlyPartition, count: int, block_ms: int
    ) -> list[Any]:
        """Caught up: commit what was handled and wait for what comes next, in one round trip
        (the coordinator's commit bookkeeping, the commit sent ahead of the waiting read)."""
        replies: list[Any] = []

        async def send(lease: Lease, commit: Commit) -> bool:
            applied, read = await self.io.commit_then_wait(reader, commit, count, block_ms)
            replies.extend(read)
            return applied

        if not await self.consumer._commit(self.tp, send):  # nothing to commit
            return await self.io.read_waiting(reader, count, block_ms)
        return self.io.waited(reader.lease, replies)

    def _block_ms(self, reader: OrderlyPartition) -> int:
        """How long a caught-up read may wait for entries (0: do not wait): block_ms, no later
        than the partition's handling limit (the lease)."""
        if not reader.read_from:
            return 0
        limit = self.consumer.ownership.handling_limit(self.tp)
        return min(self.settings.block_ms, int((limit - time.monotonic()) * 1000))

    async def _commit_if_due(self, reader: OrderlyPartition, interval: float) -> None:
        if reader.commit_due(time.monotonic(), interval):
            try:
                await self.consumer._commit(self.tp)
            except _NETWORK_ERRORS as exc:
                log.warning(
                    "%s: %s/%d: commit failed (%s); again later", self.consumer.name, *self.tp, exc
                )

    async def _handle_batch(self, reader: OrderlyPartition, messages: list[Message]) -> None:
        if self.settings.key_concurrency > 1 and len(messages) > 1:
            # Lanes up to a malformed entry the policy blocks at, then it (and the rest) in order.
            end = lanes_end(messages, not isinstance(self.policy.malformed(), DeadLetter))
            if end:
                await self._handle_in_lanes(reader, messages[:end])
            messages = messages[end:]
        await self._handle_plain(reader, messages)

    async def _handle_plain(
        self, reader: OrderlyPartition | None, messages: Iterable[Message]
    ) -> None:
        """Messages in order, the common case in a few steps each: a well-formed message, no
        parked keys, a handler that succeeds at its first attempt. Anything else takes
        _handle_one's path (a failure goes on from its first attempt there), with the same
        checks in the same order.

        Orderly, the position moves over a run of such messages once, under the consumer's
        guard, when the run ends (before anything else is handled, and however the batch ends):
        taking the lock per message made the partitions' threads queue on it. The worker
        commits between batches, so it commits all it handled, as before; a commit() from
        another thread in the middle of a batch commits up to the last run. Only the run's
        last offset and length are kept: a handled Message is not held here."""
        consumer = self.consumer
        ownership = consumer.ownership
        stopping = consumer._stopping
        stats = consumer.stats
        handler = consumer.handler_for_workers()
        if is_async():
            coroutine = consumer._handler_coroutine  # else: run in a worker thread
        plain = consumer._key_decoder is None and consumer._value_decoder is None
        tp = self.tp
        monotonic = time.monotonic
        pending_acks = self._pending_acks
        run_last = ""  # orderly: the run handled, the position not moved over it yet
        run = 0
        owned = ownership.owned.get(tp)
        margin = ownership.margin_s
        limited = consumer._budget is not None  # run(max_messages=N): counted
        interval = consumer._ack_interval_s
        commit_at = monotonic() + interval  # orderly: a long read commits as it goes
        try:
            for message in messages:
                if owned is not None and owned.paused:  # pause(): no further message starts
                    raise _Paused(message.offset)
                if message.__class__ is not Message or (
                    reader is not None
                    and (reader.parked or (reader.held and message.offset in reader.held))
                ):
                    if run and reader is not None:
                        self._advance(reader, run_last, run)
                        run = 0
                    await self._handle_one(reader, message, lane=False)
                    continue
                # Read without the guard: the coordinator replaces the ownership's fields whole,
                # so this sees the state just before or just after a change (the lock adds
                # nothing to a check that can be outdated the moment it returns); the lease
                # deadline is what bounds it, and a lost lease fences the commit anyway.
                # OwnershipCore.may_handle, inlined on this grant's Owned (a partition handed
                # over is marked finished before it is forgotten).
                if reader is not None:
                    if (
                        owned is None
                        or owned.revoked
                        or owned.lost
                        or owned.finished
                        or ownership.stopping
                        or monotonic() >= owned.deadline - margin
                    ):
                        raise _Stop
                elif stopping.is_set() or tp not in ownership.owned:
                    raise _Stop
                if limited and not consumer.take_message():  # run(max_messages=N)
                    raise _Stop
                stats.consumed += 1
                given = message if plain else consumer._deserialize(message)
                try:
                    if is_async():
                        await acall_user(handler, coroutine, given)
                    else:
                        handler(given)
                except _Stop:
                    raise
                except Exception as error:
                    if run and reader is not None:
                        self._advance(reader, run_last, run)
                        run = 0
                    self._failed(message, error)
                    await self._attempts(reader, message, lane=False, failure=error)
                    continue
                now = monotonic()
                stats.handled += 1  # consumer.note_handled(1), inlined
                consumer._last_handled = now
                if reader is not None:
                    run_last = message.offset
                    run += 1
                    if now >= commit_at:  # a read of many messages (a large batch entry)
                        self._advance(reader, run_last, run)
                        run = 0
                        await self._commit_if_due(reader, interval)
                        commit_at = now + interval
                    continue
                pending_acks.append(message.offset)  # concurrent: XACK with the next read
        finally:
            if run and reader is not None:
                self._advance(reader, run_last, run)

    def _advance(self, reader: OrderlyPartition, last: str, count: int) -> None:
        """The position moves over a run of `count` handled messages ending at `last`."""
        with self.consumer._guard:
            reader.handled_through(last, count, time.monotonic())

    async def _handle_in_lanes(self, reader: OrderlyPartition, messages: list[Message]) -> None:
        """Each lane takes its keys in order; the position moves once the whole batch is
        handled (a lane that stops leaves it where it was: handled again, at-least-once)."""
        if self._lanes is None:
            self._lanes = APool(
                self.settings.key_concurrency, "redisq-lane", mark_own, self.consumer
            )

        async def run_lane(lane: list[Message]) -> None:
            for message in lane:
                await self._handle_one(reader, message, lane=True)

        errors = await self._lanes.run_each(
            run_lane, lanes(messages, self.settings.key_concurrency)
        )
        for error in errors:
            if error is not None:
                raise error
        with self.consumer._guard:
            reader.handled_through(messages[-1].offset, len(messages), time.monotonic())

    async def _handle_one(
        self, reader: OrderlyPartition | None, message: Message, *, lane: bool
    ) -> None:
        """Handler, retries and the failure policy for one message; then it counts as handled
        (orderly: the position may pass it; concurrent: XACK with the next read)."""
        consumer = self.consumer
        self._check()
        if reader is not None and reader.parked:
            with consumer._guard:
                if reader.hold_if_parked(message, time.monotonic(), advance=not lane):
                    return
        if message.__class__ is MalformedMessage:
            await self._on_malformed(reader, message, lane)
            return
        if not consumer.take_message():  # run(max_messages=N): N taken
            raise _Stop
        consumer.stats.consumed += 1
        await self._attempts(reader, message, lane=lane)

    def _failed(self, message: Message, error: Exception) -> None:
        self.consumer.stats.failures += 1
        log.warning(
            "%s: %s/%d@%s attempt %d failed (%s: %s)",
            self.consumer.name,
            *self.tp,
            message.offset,
            message.attempt,
            type(error).__name__,
            log_text(error),
        )

    async def _attempts(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        *,
        lane: bool,
        failure: Exception | None = None,
    ) -> None:
        """The handler under the failure policy (handle_under_policy's steps); `failure`: the
        first attempt was made already and failed with it."""
        consumer = self.consumer
        handler = consumer.handler_for_workers()
        coroutine = consumer._handler_coroutine
        steps = handle_under_policy(message, self.policy)
        moves = reader.moves if reader is not None else 0
        try:
            step = next(steps)
            if failure is not None:
                step = steps.send(failure)
            while True:
                if isinstance(step, CallHandler):
                    current: Message = step.message  # type: ignore[assignment]
                    failure = None
                    try:
                        await acall_user(handler, coroutine, consumer._deserialize(current))
                    except _Stop:
                        raise
                    except Exception as error:
                        failure = error
                        self._failed(current, error)
                    step = steps.send(failure)
                elif isinstance(step, MarkBlocked):
                    if reader is not None:
                        reader.blocked = message.offset
                    await self.io.mark_blocked(self.tp, message, step.error, step.attempts)
                    step = next(steps)
                else:
                    await self._sleep_while_owned(step.delay_s)
                    if reader is not None and reader.moves != moves:
                        raise _Retry  # sought away (or past it): read from where it jumped to
                    if (
                        reader is not None
                        and reader.blocked == message.offset
                        and await self._gone(message)
                    ):  # a blocked message deleted (XDEL, retention): passed over
                        self._handled(reader, message, lane, unblock=True)
                        return
                    consumer.stats.retries += 1
                    step = next(steps)
        except StopIteration as done:
            outcome = done.value
        if isinstance(outcome, GaveUp):
            await self._dead_letter(
                reader, message, outcome.error, outcome.attempts, outcome.park_key, lane
            )
            return
        consumer.note_handled(1)
        self._handled(reader, message, lane, unblock=outcome.was_blocked)

    async def _gone(self, message: Message) -> bool:
        """The message is no longer in the partition (deleted or trimmed while blocked)."""
        try:
            return not await self.io.fetch_offsets(self.tp, [message.offset])
        except redis.RedisError:
            return False

    def _handled(
        self, reader: OrderlyPartition | None, message: Message, lane: bool, *, unblock: bool
    ) -> None:
        if reader is None:
            self._pending_acks.append(message.offset)
            return
        with self.consumer._guard:
            if unblock:
                reader.unblocked(time.monotonic())
            if not lane or message.offset in reader.held:
                reader.handled(message, time.monotonic())

    async def _dead_letter(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        error: BaseException,
        attempts: int,
        park: bool,
        lane: bool,
    ) -> None:
        await self.io.dead_letter(reader, message, error, attempts, park=park)
        self.consumer.stats.dead_letters += 1
        if not isinstance(message, MalformedMessage):  # those are logged at a bounded rate
            log.error(
                "%s: %s/%d@%s dead-lettered after %d attempts%s: %s",
                self.consumer.name,
                *self.tp,
                message.offset,
                attempts,
                " (key parked)" if park else "",
                log_text(error),
            )
        if reader is not None:
            malformed = isinstance(message, MalformedMessage)
            with self.consumer._guard:
                if lane:  # the batch's end moves the position; count and park now
                    reader.dead_lettered_in_lane(message, park=park, malformed=malformed)
                else:
                    now = time.monotonic()
                    reader.dead_lettered(message, park=park, malformed=malformed, now=now)

    async def _on_malformed(
        self, reader: OrderlyPartition | None, message: Message, lane: bool
    ) -> None:
        action = self.policy.malformed()
        error = message.error()  # type: ignore[attr-defined]
        if isinstance(action, DeadLetter):
            self.consumer.stats.malformed += 1
            await self._dead_letter(reader, message, error, 0, action.park_key, lane)
            return
        if reader is None:  # concurrent: it stays pending and is retried when reclaimed
            self.consumer.stats.malformed += 1
            self.io.note_malformed(message, "left pending (policy block)")
            return
        with self.consumer._guard:  # read again from it: an XDEL (or retention) ends it
            first = reader.block_on(message.offset)
        if first:  # once per entry, however long it blocks
            self.consumer.stats.malformed += 1
            self.io.note_malformed(message, "blocking (policy block)")
            await self.io.mark_blocked(self.tp, message, error, 0)
        await self._sleep_while_owned(self.policy.backoff.delay(1))
        raise _Retry

    # -- concurrent ------------------------------------------------------------------------------
    async def _concurrent(self) -> None:
        consumer = self.consumer
        batch = self.settings.batch_size
        while self._may_handle():
            if self._paused():  # pause(): nothing read, nothing started
                await self._flush_group_acks()
                await asleep(0.05)
                continue
            try:
                if self._own_pending:  # what a pause left: this member's pending entries
                    ids = self._pending_acks[:1000]
                    entries = await self.io.read_group(self.tp, batch, ids, None, start="0")
                    del self._pending_acks[: len(ids)]
                    self._own_pending = len(entries) >= batch
                    await self._handle_plain(
                        None, self.io.group_messages(self.tp, entries, lazily=True)
                    )
                    continue
                claimed = await self.io.claim_idle(self.tp, batch)
                if claimed:
                    await self._handle_plain(None, claimed)
                    continue
                ids = self._pending_acks[:1000]
                asked = self.io.sizes.entries_to_run(self.tp, batch)
                entries = await self.io.read_group(self.tp, asked, ids, self.settings.block_ms)
                self.io.sizes.note_entries(self.tp, entries)
                del self._pending_acks[: len(ids)]
                await self._handle_plain(
                    None, self.io.group_messages(self.tp, entries, lazily=True)
                )
            except _Paused:
                self._own_pending = True
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: %s; retrying", consumer.name, *self.tp, exc)
                # a read whose reply was lost took its entries all the same: this member's
                # pending entries are read again first (not left for claim_idle_ms)
                self._own_pending = True
                await asleep(0.2)

    async def _flush_group_acks(self) -> None:
        try:
            while self._pending_acks:
                ids = self._pending_acks[:1000]
                await self.io.ack_group(self.tp, ids)
                del self._pending_acks[: len(ids)]
        except redis.RedisError as exc:
            log.warning("%s: %s/%d: final ack failed: %s", self.consumer.name, *self.tp, exc)
