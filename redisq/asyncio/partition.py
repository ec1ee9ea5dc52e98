"""Reading and handling one partition (asyncio driver): the Redis calls of an asyncio
consumer's partitions, and the task that runs a handler over one of them.

The same calls and decisions as redisq.partition (the thread driver): a fenced range read
(MULTI GET lease / XRANGE / EXEC), XREAD BLOCK, the commit, the Redis consumer group for
concurrent mode, the dead-letter copy; handling one message is policies.handle_under_policy.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio.cluster import RedisCluster

from redisq.deadletter import LETTER_PRODUCER_OPTIONS, letter
from redisq.dispatch import OrderlyPartition, lanes
from redisq.errors import LeaseLost
from redisq.keys import dead_letter_topic
from redisq.ownership import TopicPartition
from redisq.partition import PartitionIO
from redisq.policies import (
    CallHandler,
    DeadLetter,
    GaveUp,
    MarkBlocked,
    handle_under_policy,
)
from redisq.protocol import group as calls
from redisq.protocol.group import Commit, Lease
from redisq.records import MalformedMessage, Message, decode_entries

if TYPE_CHECKING:
    from redisq.asyncio.consumer import Consumer
    from redisq.asyncio.producer import Producer

log = logging.getLogger("redisq.consumer")

_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class Stop(Exception):
    """The partition must stop being handled (revoked, lease lost or near its deadline, close)."""


class _Retry(Exception):
    """A malformed entry blocks: read the partition again from it."""


class AsyncPartitionIO:
    """The Redis calls of one asyncio consumer's partitions."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.broker = consumer.broker
        self.group = consumer.group
        self.member = consumer.name
        self.settings = consumer.settings
        self.policy = consumer.policy
        self._keys = consumer.broker.keys
        self._client = consumer.broker.client
        self._cluster = isinstance(self._client, RedisCluster)
        self._letters: Producer | None = None
        self._letter_topics: set[str] = set()
        self._last_claim: dict[TopicPartition, float] = {}

    async def _exchange(self, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Commands in one write on a pooled connection of the node serving `key`, raw replies."""
        if self._cluster:
            node = self._client.get_node_from_key(key)
            conn = node.acquire_connection()
            release = node.release
        else:
            pool = self._client.connection_pool
            conn = await pool.get_connection()
            release = pool.release
        try:
            await conn.connect()
            await conn.send_packed_command(conn.pack_commands(commands))
            replies = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()
            result = release(conn)
            if inspect.isawaitable(result):
                await result
            raise
        result = release(conn)
        if inspect.isawaitable(result):
            await result
        return replies

    async def read_range(self, reader: OrderlyPartition, count: int) -> list[Message]:
        lease = reader.lease
        start, inclusive = reader.next_range()
        commands = calls.fenced_range_commands(self._keys, lease, start, count)
        if inclusive:
            commands[2] = (*commands[2][:2], start, *commands[2][3:])
        replies = await self._exchange(commands[1][1], commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        result = calls.range_read_reply(replies)
        if result.lease_value != lease.value:
            raise LeaseLost(f"{lease.topic}/{lease.partition} lease is held by another grant")
        return decode_entries(lease.topic, lease.partition, result.entries)

    async def commit(self, lease: Lease, commit: Commit) -> None:
        await self.broker.scripts.run(calls.commit_position(self._keys, lease, commit))

    async def wait_for_entries(self, tp: TopicPartition, after: str, block_ms: int) -> None:
        await self._client.xread(
            {self._keys.log(*tp): after or "$"}, count=1, block=max(10, int(block_ms))
        )

    async def load_parked(self, reader: OrderlyPartition) -> None:
        if self.policy.name != "park_key" and not reader.held:
            return
        topic, p = reader.tp
        reader.parked = set(await self._client.hkeys(self._keys.parked_keys(topic, p, self.group)))
        held = await self._client.hgetall(self._keys.held_messages(topic, p, self.group))
        reader.held = {k.decode(): v for k, v in held.items()}

    async def parked_now(self, tp: TopicPartition) -> set[bytes]:
        return set(await self._client.hkeys(self._keys.parked_keys(tp[0], tp[1], self.group)))

    async def fetch_offsets(self, tp: TopicPartition, offsets: list[str]) -> list[Message]:
        key = self._keys.log(*tp)
        replies = await self._exchange(key, [("XRANGE", key, o, o) for o in offsets])
        entries = [e for reply in replies if not isinstance(reply, Exception) for e in reply]
        return decode_entries(tp[0], tp[1], entries)

    async def committed(self, tp: TopicPartition) -> str | None:
        for info in await self._client.xinfo_groups(self._keys.log(*tp)):
            name = info.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == self.group:
                last = info.get("last-delivered-id")
                return last.decode() if isinstance(last, bytes) else last
        return None

    # -- concurrent ------------------------------------------------------------------------------
    async def read_group(
        self, tp: TopicPartition, count: int, ack_ids: list[str], block_ms: int | None
    ) -> list[Message]:
        stream = self._keys.log(*tp)
        read: tuple[Any, ...] = ("XREADGROUP", "GROUP", self.group, self.member, "COUNT", count)
        if block_ms is not None:
            read += ("BLOCK", block_ms)
        commands: list[tuple[Any, ...]] = [(*read, "STREAMS", stream, ">")]
        if ack_ids:
            commands.insert(0, ("XACK", stream, self.group, *ack_ids))
        replies = await self._exchange(stream, commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        entries = replies[-1]
        if isinstance(entries, dict):
            entries = next(iter(entries.values())) if entries else []
        else:
            entries = entries[0][1] if entries else []
        return decode_entries(tp[0], tp[1], entries or [])

    async def claim_idle(self, tp: TopicPartition, count: int) -> list[Message]:
        now = time.monotonic()
        idle_ms = self.settings.claim_idle
        if now - self._last_claim.get(tp, 0.0) < idle_ms / 2000:
            return []
        self._last_claim[tp] = now
        claimed = await self.broker.scripts.run(
            calls.claim_pending(
                self._keys, calls.GroupRef(tp[0], self.group), tp[1], self.member, "", "0-0",
                count, idle_ms,
            )
        )  # fmt: skip
        return decode_entries(tp[0], tp[1], claimed.entries, claimed.deliveries)

    async def ack_group(self, tp: TopicPartition, ids: list[str]) -> int:
        if not ids:
            return 0
        return int(await self._client.xack(self._keys.log(*tp), self.group, *ids))

    # -- failures --------------------------------------------------------------------------------
    async def dead_letter(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        error: BaseException | str,
        attempts: int,
    ) -> None:
        """The copy (idempotent, as redisq.deadletter.DeadLetterWriter writes it); concurrent
        mode then acks it with dead_letter.lua."""
        topic = dead_letter_topic(message.topic, self.group)
        if topic not in self._letter_topics:
            await self.broker.create_topic(topic, partitions=1, exist_ok=True)
            self._letter_topics.add(topic)
        if self._letters is None:
            self._letters = self.broker.producer(**LETTER_PRODUCER_OPTIONS)  # type: ignore[arg-type]
        value, key, headers, message_id = letter(message, error, attempts, self.group)
        await self._letters.send(topic, value, key=key, headers=headers, message_id=message_id)
        if reader is None:
            await self.broker.scripts.run(
                calls.dead_letter(
                    self._keys, calls.GroupRef(message.topic, self.group), message.partition, "",
                    message.offset,
                )
            )  # fmt: skip

    async def mark_blocked(
        self, tp: TopicPartition, message: Message, error: BaseException, attempts: int
    ) -> None:
        try:
            await self._client.hset(
                self._keys.group_partition_state(tp[0], tp[1], self.group),
                mapping={
                    "blocked_offset": message.offset,
                    "blocked_error": f"{type(error).__name__}: {error}"[:500],
                    "blocked_attempts": attempts,
                },
            )
        except redis.RedisError as exc:
            log.warning("%s: could not record the blocked message: %s", self.member, exc)

    async def close(self) -> None:
        if self._letters is not None:
            await self._letters.close()


async def handle_partition(consumer: Consumer, tp: TopicPartition) -> None:
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
    def __init__(self, consumer: Consumer, tp: TopicPartition, reader: OrderlyPartition | None):
        self.consumer = consumer
        self.tp = tp
        self.reader = reader
        self.io = consumer.io
        self.settings = consumer.settings
        self.policy = consumer.policy
        self.pending_acks: list[str] = []

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
        next_parked_check = 0.0
        while self.may_handle():
            owned = consumer.ownership.owned.get(self.tp)
            if owned is not None and owned.paused:
                await self.commit_if_due(reader, interval)
                await asyncio.sleep(0.05)
                continue
            now = time.monotonic()
            if reader.held and now >= next_parked_check:
                next_parked_check = now + 1.0
                free = reader.released(await self.io.parked_now(self.tp))
                if free:
                    for message in await self.io.fetch_offsets(self.tp, free):
                        await self.handle_one(reader, message, lane=False)
                    continue
            try:
                read = await self.io.read_range(reader, self.settings.batch_size)
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: %s; reading again", consumer.name, *self.tp, exc)
                await asyncio.sleep(0.2)
                continue
            messages = reader.admit(read, time.monotonic())
            if messages:
                try:
                    await self.handle_batch(reader, messages)
                except _Retry:
                    continue
            elif not read:
                await self.commit_if_due(reader, 0.0)
                limit = consumer.ownership.handling_limit(self.tp)
                block_ms = min(self.settings.block_ms, int((limit - time.monotonic()) * 1000))
                if block_ms > 0:
                    try:
                        await self.io.wait_for_entries(self.tp, reader.read_from, block_ms)
                    except _NETWORK_ERRORS:
                        await asyncio.sleep(0.2)
            await self.commit_if_due(reader, interval)

    async def commit_if_due(self, reader: OrderlyPartition, interval: float) -> None:
        if reader.commit_due(time.monotonic(), interval):
            try:
                await self.consumer._commit(self.tp)
            except _NETWORK_ERRORS as exc:
                log.warning("%s: %s/%d: commit failed (%s); again later", self.consumer.name,
                            *self.tp, exc)  # fmt: skip

    async def handle_batch(self, reader: OrderlyPartition, messages: list[Message]) -> None:
        if self.settings.key_concurrency > 1 and len(messages) > 1:

            async def run_lane(lane: list[Message]) -> None:
                for message in lane:
                    await self.handle_one(reader, message, lane=True)

            results = await asyncio.gather(
                *(run_lane(lane) for lane in lanes(messages, self.settings.key_concurrency)),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            reader.handled_through(messages[-1].offset, len(messages), time.monotonic())
            return
        for message in messages:
            await self.handle_one(reader, message, lane=False)

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
        steps = handle_under_policy(message, self.policy)
        step = next(steps)
        try:
            while True:
                if isinstance(step, CallHandler):
                    current: Message = step.message  # type: ignore[assignment]
                    failure = await consumer._call_handler(current)
                    if failure is not None:
                        consumer.stats.failures += 1
                        log.warning(
                            "%s: %s/%d@%s attempt %d failed (%s: %s)",
                            consumer.name, *self.tp, current.offset, current.attempt,
                            type(failure).__name__, failure,
                        )  # fmt: skip
                    step = steps.send(failure)
                elif isinstance(step, MarkBlocked):
                    if reader is not None:
                        reader.blocked = message.offset
                    await self.io.mark_blocked(self.tp, message, step.error, step.attempts)
                    step = next(steps)
                else:
                    await self.sleep_while_owned(step.delay_s)
                    consumer.stats.retries += 1
                    step = next(steps)
        except StopIteration as done:
            outcome = done.value
        if isinstance(outcome, GaveUp):
            await self.dead_letter(reader, message, outcome.error, outcome.attempts,
                                   outcome.park_key, lane)  # fmt: skip
            return
        consumer.note_handled(1)
        if reader is None:
            self.pending_acks.append(message.offset)
            return
        if outcome.was_blocked:
            reader.unblocked(time.monotonic())
        if not lane or message.offset in reader.held:
            reader.handled(message, time.monotonic())

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
                " (key parked)" if park else "", error,
            )  # fmt: skip
        if reader is None:
            return
        if lane:
            reader.pending.dead_letters += 1
            if park and message.key:
                reader.parked.add(message.key)
                reader.pending.parked.append((message.key, message.offset))
        else:
            reader.dead_lettered(
                message, park=park, malformed=isinstance(message, MalformedMessage),
                now=time.monotonic(),
            )  # fmt: skip

    async def on_malformed(
        self, reader: OrderlyPartition | None, message: Message, lane: bool
    ) -> None:
        action = self.policy.malformed()
        error = message.error()  # type: ignore[attr-defined]
        if isinstance(action, DeadLetter):
            self.consumer.stats.malformed += 1
            await self.dead_letter(reader, message, error, 0, action.park_key, lane)
            return
        if reader is None:
            self.consumer.stats.malformed += 1
            return
        if reader.blocked != message.offset:
            self.consumer.stats.malformed += 1
            await self.io.mark_blocked(self.tp, message, error, 0)
        reader.blocked = message.offset
        reader.reread_from(message.offset)
        await self.sleep_while_owned(self.policy.backoff.delay(1))
        raise _Retry

    # -- concurrent ------------------------------------------------------------------------------
    async def concurrent(self) -> None:
        batch = self.settings.batch_size
        while self.may_handle():
            try:
                claimed = await self.io.claim_idle(self.tp, batch)
                if claimed:
                    for message in claimed:
                        await self.handle_one(None, message, lane=False)
                    continue
                ids = self.pending_acks[:1000]
                messages = await self.io.read_group(self.tp, batch, ids, self.settings.block_ms)
                del self.pending_acks[: len(ids)]
                for message in messages:
                    await self.handle_one(None, message, lane=False)
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


__all__ = ["AsyncPartitionIO", "PartitionIO", "Stop", "handle_partition", "is_async_handler"]
