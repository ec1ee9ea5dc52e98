"""run() of the asyncio consumer: the task that handles one partition (the twin of
redisq.worker): reading like a log under the lease, handling each message under the failure
policy (policies.handle_under_policy), committing; or competing in concurrent mode.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from itertools import chain
from typing import TYPE_CHECKING, Any

import redis

from redisq.chunks import admitted_chunks, lanes, lanes_end
from redisq.dispatch import OrderlyPartition
from redisq.errors import LeaseLost, log_text
from redisq.ownership import TopicPartition
from redisq.partition import PartitionIO
from redisq.policies import CallHandler, DeadLetter, GaveUp, MarkBlocked, handle_under_policy
from redisq.protocol.group import Commit, Lease
from redisq.records import DECODE_CHUNK, MalformedMessage, Message, decode_lazily
from redisq.transactions import RETRIABLE_ERRORS

if TYPE_CHECKING:
    from redisq.asyncio.coordinator import Coordinator

log = logging.getLogger("redisq.consumer")

# Connection errors and a cluster's redirections the reads met after following them for a while
# (a slot migrating): the partition is read or committed again later, and kept.
_NETWORK_ERRORS = RETRIABLE_ERRORS


class Stop(Exception):
    """The partition must stop being handled (revoked, lease lost or near its deadline, close)."""


class _Retry(Exception):
    """A malformed entry blocks, or a seek came while a message was retried: read the
    partition again from its position."""


class _Paused(Exception):
    """pause(): the read is handled up to `offset` (not included); the rest is read again."""

    def __init__(self, offset: str) -> None:
        super().__init__(offset)
        self.offset = offset


async def handle_partition(consumer: Coordinator, tp: TopicPartition) -> None:
    """run(): one partition's task (see redisq.partition.Worker, its thread twin)."""
    reader = consumer._readers.get(tp)
    handler = _Handling(consumer, tp, reader)
    try:
        if reader is not None:
            await handler.orderly(reader)
        else:
            await handler.concurrent()
    except Stop:
        pass
    except LeaseLost:
        log.warning("%s: %s/%d: lease lost; stopping", consumer.name, *tp)
        if consumer.ownership.lost(tp):
            consumer.stats.leases_lost += 1
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s: %s/%d worker failed", consumer.name, *tp)
    finally:
        if reader is None:
            await handler.flush_group_acks()
        await consumer.worker_done(tp)


class _Handling:
    def __init__(self, consumer: Coordinator, tp: TopicPartition, reader: OrderlyPartition | None):
        self.consumer = consumer
        self.tp = tp
        self.reader = reader
        self.io = consumer.io
        self.settings = consumer.settings
        self.policy = consumer.policy
        self.pending_acks: list[str] = []
        # concurrent: a pause stopped a read part way; its rest is pending on this member
        self.own_pending = False

    def may_handle(self) -> bool:
        consumer = self.consumer
        if self.reader is None:
            return not consumer._stopping.is_set() and self.tp in consumer.ownership.owned
        return consumer.ownership.may_handle(self.tp, time.monotonic())

    def check(self) -> None:
        if not self.may_handle():
            raise Stop

    async def sleep_while_owned(self, delay: float) -> None:
        end = time.monotonic() + delay
        while True:
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.05))

    # -- orderly ---------------------------------------------------------------------------------
    async def orderly(self, reader: OrderlyPartition) -> None:
        consumer = self.consumer
        interval = consumer._ack_interval_s
        batch = self.settings.batch_size
        lanes_of = self.settings.key_concurrency
        caught_up = False
        while self.may_handle():
            owned = consumer.ownership.owned.get(self.tp)
            if owned is not None and owned.paused:
                await self.commit_if_due(reader, interval)
                await asyncio.sleep(0.05)
                continue
            if reader.parked_check_due(time.monotonic()):
                free = reader.released(await self.io.parked_now(self.tp))
                if free:
                    try:
                        for message in await self.io.fetch_offsets(self.tp, free):
                            owned = consumer.ownership.owned.get(self.tp)
                            if owned is not None and owned.paused:  # the rest stay held,
                                reader.next_parked_check = 0.0  # released again after resume()
                                break
                            await self.handle_one(reader, message, lane=False)
                    except _Retry:  # a seek while one of them was retried
                        pass
                    except redis.RedisError as exc:  # they stay held, and go first
                        log.warning("%s: %s/%d: reading released messages: %s", consumer.name,
                                    *self.tp, exc)  # fmt: skip
                        reader.next_parked_check = 0.0
                        await asyncio.sleep(0.2)
                    continue
            # Caught up (the last read was not a full batch): commit what was handled, then
            # wait for entries and read them in one round trip, no longer than the lease allows.
            block_ms = self.block_ms(reader) if caught_up else 0
            moves = reader.moves  # taken before the read starts: a seek after it drops the read
            try:
                if block_ms > 0:
                    read = await self.commit_and_wait(reader, batch, block_ms)
                else:
                    read = await self.io.read_range(reader, batch)
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: %s; reading again", consumer.name, *self.tp, exc)
                await asyncio.sleep(0.2)
                continue
            caught_up = len(read) < batch
            try:
                chunks = admitted_chunks(reader, read, DECODE_CHUNK, nullcontext(), moves)
                if lanes_of > 1:
                    for messages in chunks:
                        owned = consumer.ownership.owned.get(self.tp)
                        if owned is not None and owned.paused:  # lanes stop between chunks
                            raise _Paused(messages[0].offset)
                        await self.handle_batch(reader, messages)
                else:
                    await self.handle_plain(reader, chain.from_iterable(chunks))
            except _Retry:
                caught_up = False
                continue
            except _Paused as paused:
                reader.stopped_before(paused.offset, moves)
                caught_up = False
                continue
            await self.commit_if_due(reader, interval)

    async def commit_and_wait(
        self, reader: OrderlyPartition, count: int, block_ms: int
    ) -> list[Any]:
        """See redisq.worker.Worker._commit_and_wait."""
        replies: list[Any] = []

        async def send(lease: Lease, commit: Commit) -> bool:
            applied, read = await self.io.commit_then_wait(reader, commit, count, block_ms)
            replies.extend(read)
            return applied

        if not await self.consumer._commit(self.tp, send):  # nothing to commit
            return await self.io.read_waiting(reader, count, block_ms)
        return PartitionIO.waited(reader.lease, replies)

    def block_ms(self, reader: OrderlyPartition) -> int:
        """How long a caught-up read may wait for entries (0: do not wait): block_ms, no later
        than the partition's handling limit (the lease)."""
        if not reader.read_from:
            return 0
        limit = self.consumer.ownership.handling_limit(self.tp)
        return min(self.settings.block_ms, int((limit - time.monotonic()) * 1000))

    async def commit_if_due(self, reader: OrderlyPartition, interval: float) -> None:
        if reader.commit_due(time.monotonic(), interval):
            try:
                await self.consumer._commit(self.tp)
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: commit failed (%s); again later", self.consumer.name,
                            *self.tp, exc)  # fmt: skip

    async def handle_batch(self, reader: OrderlyPartition, messages: list[Message]) -> None:
        if self.settings.key_concurrency > 1 and len(messages) > 1:
            # Lanes up to a malformed entry the policy blocks at, then it (and the rest) in order.
            end = lanes_end(messages, not isinstance(self.policy.malformed(), DeadLetter))
            batch, messages = messages[:end], messages[end:]

            async def run_lane(lane: list[Message]) -> None:
                for message in lane:
                    await self.handle_one(reader, message, lane=True)

            results = await asyncio.gather(
                *(run_lane(lane) for lane in lanes(batch, self.settings.key_concurrency)),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if batch:
                reader.handled_through(batch[-1].offset, len(batch), time.monotonic())
        await self.handle_plain(reader, messages)

    async def handle_plain(
        self, reader: OrderlyPartition | None, messages: Iterable[Message]
    ) -> None:
        """Messages in order, the common case in a few steps each (see
        redisq.worker.Worker._handle_plain); anything else takes handle_one's path, a failure
        going on from its first attempt."""
        consumer = self.consumer
        ownership = consumer.ownership
        stopping = consumer._stopping
        call_handler = consumer._call_handler
        stats = consumer.stats
        tp = self.tp
        monotonic = time.monotonic
        owned = ownership.owned.get(tp)
        margin = ownership.margin_s
        limited = consumer._budget is not None  # run(max_messages=N): counted
        for message in messages:
            if owned is not None and owned.paused:  # pause(): no further message starts
                raise _Paused(message.offset)
            if message.__class__ is not Message or (reader is not None and reader.parked):
                await self.handle_one(reader, message, lane=False)
                continue
            if reader is not None:  # ownership.may_handle, inlined (see redisq.worker)
                if (
                    owned is None or owned.revoked or owned.lost or owned.finished
                    or ownership.stopping or monotonic() >= owned.deadline - margin
                ):  # fmt: skip
                    raise Stop
            elif stopping.is_set() or tp not in ownership.owned:
                raise Stop
            if limited and not consumer.take_message():  # run(max_messages=N)
                raise Stop
            stats.consumed += 1
            failure = await call_handler(message)
            if failure is not None:
                self.failed(message, failure)
                await self.attempts(reader, message, lane=False, failure=failure)
                continue
            stats.handled += 1  # consumer.note_handled(1), inlined
            consumer._last_handled = now = monotonic()
            if reader is None:  # concurrent: XACK with the next read
                self.pending_acks.append(message.offset)
            else:
                reader.handled(message, now)

    async def handle_one(
        self, reader: OrderlyPartition | None, message: Message, *, lane: bool
    ) -> None:
        consumer = self.consumer
        self.check()
        if reader is not None and reader.parked:
            if reader.hold_if_parked(message, time.monotonic(), advance=not lane):
                return
        if message.__class__ is MalformedMessage:
            await self.on_malformed(reader, message, lane)
            return
        if not consumer.take_message():  # run(max_messages=N): N taken
            raise Stop
        consumer.stats.consumed += 1
        await self.attempts(reader, message, lane=lane)

    def failed(self, message: Message, error: BaseException) -> None:
        self.consumer.stats.failures += 1
        log.warning(
            "%s: %s/%d@%s attempt %d failed (%s: %s)",
            self.consumer.name, *self.tp, message.offset, message.attempt,
            type(error).__name__, log_text(error),
        )  # fmt: skip

    async def attempts(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        *,
        lane: bool,
        failure: BaseException | None = None,
    ) -> None:
        """The handler under the failure policy (handle_under_policy's steps); `failure`: the
        first attempt was made already and failed with it."""
        consumer = self.consumer
        steps = handle_under_policy(message, self.policy)
        moves = reader.moves if reader is not None else 0
        try:
            step = next(steps)
            if failure is not None:
                step = steps.send(failure)
            while True:
                if isinstance(step, CallHandler):
                    current: Message = step.message  # type: ignore[assignment]
                    failure = await consumer._call_handler(current)
                    if failure is not None:
                        self.failed(current, failure)
                    step = steps.send(failure)
                elif isinstance(step, MarkBlocked):
                    if reader is not None:
                        reader.blocked = message.offset
                    await self.io.mark_blocked(self.tp, message, step.error, step.attempts)
                    step = next(steps)
                else:
                    await self.sleep_while_owned(step.delay_s)
                    if reader is not None and reader.moves != moves:
                        raise _Retry  # sought away (or past it): read from where it jumped to
                    if (
                        reader is not None
                        and reader.blocked == message.offset
                        and (await self.gone(message))
                    ):  # a blocked message deleted (XDEL, retention): passed over
                        self.handled(reader, message, lane, unblock=True)
                        return
                    consumer.stats.retries += 1
                    step = next(steps)
        except StopIteration as done:
            outcome = done.value
        if isinstance(outcome, GaveUp):
            await self.dead_letter(reader, message, outcome.error, outcome.attempts,
                                   outcome.park_key, lane)  # fmt: skip
            return
        consumer.note_handled(1)
        self.handled(reader, message, lane, unblock=outcome.was_blocked)

    def handled(
        self, reader: OrderlyPartition | None, message: Message, lane: bool, *, unblock: bool
    ) -> None:
        """See redisq.worker.Worker._handled."""
        if reader is None:
            self.pending_acks.append(message.offset)
            return
        if unblock:
            reader.unblocked(time.monotonic())
        if not lane or message.offset in reader.held:
            reader.handled(message, time.monotonic())

    async def gone(self, message: Message) -> bool:
        """The message is no longer in the partition (deleted or trimmed while blocked)."""
        try:
            return not await self.io.fetch_offsets(self.tp, [message.offset])
        except redis.RedisError:
            return False

    async def dead_letter(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        error: BaseException,
        attempts: int,
        park: bool,
        lane: bool,
    ) -> None:
        await self.io.dead_letter(reader, message, error, attempts)
        self.consumer.stats.dead_letters += 1
        if not isinstance(message, MalformedMessage):
            log.error(
                "%s: %s/%d@%s dead-lettered after %d attempts%s: %s",
                self.consumer.name, *self.tp, message.offset, attempts,
                " (key parked)" if park else "", log_text(error),
            )  # fmt: skip
        if reader is None:
            return
        malformed = isinstance(message, MalformedMessage)
        if lane:  # the batch's end moves the position; count and park now
            reader.dead_lettered_in_lane(message, park=park, malformed=malformed)
        else:
            reader.dead_lettered(message, park=park, malformed=malformed, now=time.monotonic())

    async def on_malformed(
        self, reader: OrderlyPartition | None, message: Message, lane: bool
    ) -> None:
        action = self.policy.malformed()
        error = message.error()  # type: ignore[attr-defined]
        if isinstance(action, DeadLetter):
            self.consumer.stats.malformed += 1
            await self.dead_letter(reader, message, error, 0, action.park_key, lane)
            return
        if reader is None:  # concurrent: it stays pending and is retried when reclaimed
            self.consumer.stats.malformed += 1
            self.io.note_malformed(message, "left pending (policy block)")
            return
        if reader.block_on(message.offset):  # once per entry, however long it blocks
            self.consumer.stats.malformed += 1
            self.io.note_malformed(message, "blocking (policy block)")
            await self.io.mark_blocked(self.tp, message, error, 0)
        await self.sleep_while_owned(self.policy.backoff.delay(1))
        raise _Retry

    # -- concurrent ------------------------------------------------------------------------------
    async def concurrent(self) -> None:
        batch = self.settings.batch_size
        while self.may_handle():
            owned = self.consumer.ownership.owned.get(self.tp)
            if owned is not None and owned.paused:  # pause(): nothing read, nothing started
                await self.flush_group_acks()
                await asyncio.sleep(0.05)
                continue
            try:
                if self.own_pending:  # what a pause left: this member's pending entries
                    ids = self.pending_acks[:1000]
                    entries = await self.io.read_group(self.tp, batch, ids, None, start="0")
                    del self.pending_acks[: len(ids)]
                    self.own_pending = len(entries) >= batch
                    await self.handle_plain(None, decode_lazily(*self.tp, entries))
                    continue
                claimed = await self.io.claim_idle(self.tp, batch)
                if claimed:
                    await self.handle_plain(None, claimed)
                    continue
                ids = self.pending_acks[:1000]
                entries = await self.io.read_group(self.tp, batch, ids, self.settings.block_ms)
                del self.pending_acks[: len(ids)]
                await self.handle_plain(None, decode_lazily(*self.tp, entries))
            except _Paused:
                self.own_pending = True
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: %s; retrying", self.consumer.name, *self.tp, exc)
                await asyncio.sleep(0.2)

    async def flush_group_acks(self) -> None:
        try:
            while self.pending_acks:
                ids = self.pending_acks[:1000]
                await self.io.ack_group(self.tp, ids)
                del self.pending_acks[: len(ids)]
        except redis.RedisError as exc:
            log.warning("%s: %s/%d: final ack failed: %s", self.consumer.name, *self.tp, exc)


def is_async_handler(handler: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


__all__ = ["Stop", "handle_partition", "is_async_handler"]
