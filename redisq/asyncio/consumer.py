"""The asyncio consumer: the same cores as the thread consumer (ownership.py, dispatch.py,
policies.py) driven by tasks on redis.asyncio.

    async with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        async for message in consumer:
            ...
            await consumer.ack(message)
        # or: await consumer.run(handler, idle_timeout=2.0)

Handlers may be coroutine functions, or plain functions (run in a worker thread, so a slow one
does not stall the event loop). The guarantees and options are those of redisq.Consumer.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import redis

from redisq.consumer import ConsumerStats, default_member_name
from redisq.dispatch import OrderlyPartition
from redisq.errors import (
    ConsumerClosed,
    InvalidConfig,
    InvalidName,
    LeaseLost,
    TopicNotFound,
    check_int,
)
from redisq.keys import dead_letter_topic, validate_name, validate_topic
from redisq.ownership import OwnershipCore, TopicPartition
from redisq.partition import PartitionIO, deserializer
from redisq.policies import Backoff, DeadLetter, make_policy
from redisq.protocol import group as calls
from redisq.protocol.group import GroupRef
from redisq.records import MalformedMessage, Message
from redisq.settings import ConsumerOptions, ConsumerSettings

from .partition import AsyncPartitionIO, handle_partition, is_async_handler

if TYPE_CHECKING:
    from redisq.asyncio.broker import Broker

log = logging.getLogger("redisq.consumer")


class Consumer:
    """An asyncio member of consumer group `group` of `topics`; see redisq.Consumer."""

    def __init__(
        self,
        broker: Broker,
        topics: str | Sequence[str],
        group: str,
        name: str | None = None,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        settings = ConsumerSettings.from_options(dict(options))
        self.settings = settings
        self.broker = broker
        topic_list = [topics] if isinstance(topics, str) else list(topics)
        if not topic_list and settings.pattern is None:
            raise InvalidConfig("name at least one topic, or a pattern")
        self.topics = [validate_topic(t) for t in topic_list]
        self.group = validate_name("group", group)
        self.name = validate_name("consumer", name) if name is not None else default_member_name()
        self.mode = settings.mode
        self.policy = make_policy(
            settings.failure_policy,
            settings.max_attempts,
            Backoff(settings.retry_backoff_ms, settings.max_retry_backoff_ms),
        )
        if self.policy.needs_order and self.mode != "orderly":
            raise InvalidConfig(f"failure_policy {self.policy.name!r} needs mode='orderly'")
        if self.policy.name != "block":
            for topic in self.topics:
                try:
                    dead_letter_topic(topic, self.group)
                except InvalidName as exc:
                    raise InvalidName(
                        f"{exc}; a group whose dead-letter topic cannot exist needs "
                        "failure_policy='block'"
                    ) from None
        self.stats = ConsumerStats()
        self._pattern = re.compile(settings.pattern) if settings.pattern else None
        self._ack_interval_s = settings.ack_interval_ms / 1000
        self._tick_s = min(0.1, settings.lease_ttl_ms / 9000)
        self._key_decoder = deserializer(settings.key_deserializer)
        self._value_decoder = deserializer(settings.value_deserializer)
        self.ownership = OwnershipCore(
            self.name,
            orderly=self.mode == "orderly",
            lease_ttl_ms=settings.lease_ttl_ms,
            heartbeat_ms=settings.heartbeat_ms,
            metadata_max_age_ms=settings.metadata_max_age_ms,
        )
        self._start_ids: dict[str, str] = {}
        self.io = AsyncPartitionIO(self)
        self._readers: dict[TopicPartition, OrderlyPartition] = {}
        self._workers: dict[TopicPartition, asyncio.Task[None]] = {}
        self._handler: Callable[[Message], Any] | None = None
        self._handler_is_async = False
        self._use: str | None = None
        self._stopping = asyncio.Event()
        self._closed = False
        self._started = False
        self._coordinator: asyncio.Task[None] | None = None
        self._poll_cursor = 0
        self._last_handled = time.monotonic()

    @property
    def topic(self) -> str:
        return self.topics[0]

    def __repr__(self) -> str:
        return (
            f"<redisq.asyncio.Consumer topics={self.topics!r} group={self.group!r} "
            f"name={self.name!r} mode={self.mode!r}>"
        )

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- membership ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Join the group (TopicNotFound, GroupModeMismatch now) and start the coordinator."""
        if self._started:
            return
        self._started = True
        for topic in self.topics:
            await self.broker.topic_config(topic, refresh=True)
        for topic in self.topics:
            await self._join(topic)
        await self._refresh_metadata()
        self._coordinator = asyncio.ensure_future(self._coordinate())

    def _ref(self, topic: str) -> GroupRef:
        return GroupRef(topic, self.group)

    async def _join(self, topic: str) -> None:
        created, start_id = await self.broker.scripts.run(
            calls.join_group(
                self.broker.keys, self._ref(topic), self.name, mode=self.mode,
                start=self.settings.start, policy=self.policy.name,
            )
        )  # fmt: skip
        if created:
            log.info("created group %s on %s (%s)", self.group, topic, self.mode)
        self._start_ids[topic] = start_id
        await self._heartbeat(topic)

    async def _heartbeat(self, topic: str) -> None:
        members = await self.broker.scripts.run(
            calls.heartbeat(self.broker.keys, self._ref(topic), self.name, self.settings.session_ms)
        )
        if self.ownership.members_seen(topic, members):
            log.info("%s: members of %s/%s: %s", self.name, topic, self.group, members)

    async def _refresh_metadata(self) -> None:
        if self._pattern is not None:
            for topic in await self.broker.list_topics():
                if topic not in self._start_ids and self._pattern.fullmatch(topic):
                    self.topics.append(topic)
                    await self._join(topic)
        for topic in list(self._start_ids):
            try:
                partitions: int | None = (
                    await self.broker.topic_config(topic, refresh=True)
                ).partitions
            except TopicNotFound:
                partitions = None
            self.ownership.partitions_seen(topic, partitions)
            if partitions is not None and self.mode == "concurrent":
                for p in range(partitions):
                    await self.broker.scripts.run(
                        calls.ensure_stream_group(
                            self.broker.keys, self._ref(topic), p, self._start_ids[topic]
                        )
                    )

    # -- public API ------------------------------------------------------------------------------
    @property
    def assignment(self) -> list[int] | list[TopicPartition]:
        held = self.ownership.held()
        if len(self.topics) == 1 and self._pattern is None:
            return [p for _, p in held]
        return held

    async def run(
        self,
        handler: Callable[[Message], Any],
        *,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_messages: int | None = None,
    ) -> int:
        """See redisq.Consumer.run; handler may be a coroutine function."""
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        self._start_use("run")
        await self.start()
        self._handler = handler
        self._handler_is_async = is_async_handler(handler)
        started = time.monotonic()
        handled_before = self.stats.handled
        self._last_handled = started
        for tp in list(self.ownership.owned):
            self._start_worker(tp)
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if timeout is not None and now - started >= timeout:
                    break
                if idle_timeout is not None and now - self._last_handled >= idle_timeout:
                    break
                if max_messages is not None and self.stats.handled - handled_before >= max_messages:
                    break
                try:
                    await asyncio.wait_for(self._stopping.wait(), 0.05)
                except TimeoutError:
                    pass
        finally:
            await self.close()
        return self.stats.handled - handled_before

    async def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        """See redisq.Consumer.poll."""
        self._start_use("poll")
        await self.start()
        check_int("max_messages", max_messages, 1, 100_000)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            messages = await self._poll_once(max_messages)
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0 or self._stopping.is_set():
                return messages
            await asyncio.sleep(min(0.02, remaining))

    async def __aiter__(self) -> AsyncIterator[Message]:
        while not self._closed:
            for message in await self.poll():
                yield message

    async def ack(self, *messages: Message | Iterable[Message]) -> int:
        """See redisq.Consumer.ack (orderly: committed within ack_interval_ms)."""
        by_tp: dict[TopicPartition, list[Message]] = {}
        for item in messages:
            for message in [item] if isinstance(item, Message) else item:
                if message.topic not in self._start_ids:
                    raise ValueError(f"message of topic {message.topic!r}, not of this consumer")
                by_tp.setdefault((message.topic, message.partition), []).append(message)
        acked = 0
        now = time.monotonic()
        for tp, batch in by_tp.items():
            if self.mode == "concurrent":
                acked += await self.io.ack_group(tp, [m.offset for m in batch])
                continue
            reader = self._readers.get(tp)
            owned = self.ownership.owned.get(tp)
            if reader is None or owned is None or owned.lost:
                self.stats.fenced_commits += 1
                raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
            reader.ack([m.offset for m in batch], now)
            acked += len(batch)
            if reader.commit_due(now, self._ack_interval_s):
                await self._commit(tp)
        return acked

    async def commit(self) -> None:
        """See redisq.Consumer.commit."""
        lost = []
        for tp in list(self._readers):
            try:
                await self._commit(tp)
            except LeaseLost:
                lost.append(tp)
        if lost:
            raise LeaseLost(f"{', '.join(f'{t}/{p}' for t, p in lost)} no longer held")

    def seek(self, partition: int | TopicPartition, offset: str) -> None:
        tp = self._tp(partition)
        reader = self._readers.get(tp)
        if reader is None:
            raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
        reader.seek(PartitionIO.check_offset(offset))

    def seek_to_time(self, partition: int | TopicPartition, timestamp_ms: int) -> None:
        check_int("timestamp_ms", timestamp_ms, 0)
        self.seek(partition, f"{timestamp_ms}-0")

    def position(self, partition: int | TopicPartition) -> str:
        tp = self._tp(partition)
        reader = self._readers.get(tp)
        if reader is None:
            raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
        return reader.read_from

    async def committed(self, partition: int | TopicPartition) -> str | None:
        return await self.io.committed(self._tp(partition))

    def pause(self, *partitions: int | TopicPartition) -> None:
        self._set_paused(partitions, True)

    def resume(self, *partitions: int | TopicPartition) -> None:
        self._set_paused(partitions, False)

    def _set_paused(self, partitions: Iterable[int | TopicPartition], paused: bool) -> None:
        for partition in partitions:
            owned = self.ownership.owned.get(self._tp(partition))
            if owned is None:
                raise InvalidConfig(f"{partition} is not assigned to {self.name}")
            owned.paused = paused

    async def close(self) -> None:
        """Finish the messages in flight, commit, release the leases and leave the group."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self.ownership.stopping = True
        if self._workers:
            await asyncio.gather(*self._workers.values(), return_exceptions=True)
        for tp in list(self._readers) + list(self.ownership.owned):
            await self._finish(tp)
        if self._coordinator is not None:
            self._coordinator.cancel()
            await asyncio.gather(self._coordinator, return_exceptions=True)
        for topic in self._start_ids:
            try:
                await self.broker.scripts.run(
                    calls.heartbeat(
                        self.broker.keys, self._ref(topic), self.name,
                        self.settings.session_ms, leave=True,
                    )
                )  # fmt: skip
            except redis.RedisError as exc:
                log.warning("%s: could not leave the group: %s", self.name, exc)
        await self.io.close()

    # -- the coordinator task --------------------------------------------------------------------
    async def _coordinate(self) -> None:
        while True:
            try:
                await self._coordinate_once(time.monotonic())
            except asyncio.CancelledError:
                raise
            except redis.RedisError as exc:
                log.warning("%s: coordinator: %s: %s", self.name, type(exc).__name__, exc)
            except Exception:  # pragma: no cover - keep the member alive; the lease is the guard
                log.exception("%s: coordinator error", self.name)
            await asyncio.sleep(self._tick_s)

    async def _coordinate_once(self, now: float) -> None:
        due = self.ownership.due(now)
        if due.refresh_metadata:
            await self._refresh_metadata()
        if due.heartbeat:
            for topic in list(self._start_ids):
                await self._heartbeat(topic)
            self.stats.rebalances = self.ownership.rebalances
            due = self.ownership.due(now)
        for tp in due.renew:
            await self._renew(tp)
        for tp in due.hand_over:
            if tp in self._workers:
                continue
            reader = self._readers.get(tp)
            owned = self.ownership.owned.get(tp)
            waiting = reader is not None and bool(reader.outstanding)
            if waiting and owned and now - owned.revoked_at < self.settings.lease_ttl_ms / 1000:
                continue
            await self._finish(tp)
        for tp in due.acquire:
            if self._stopping.is_set():
                break
            await self._acquire(tp)

    async def _acquire(self, tp: TopicPartition) -> None:
        sent = time.monotonic()
        if self.mode == "concurrent":
            self.ownership.granted(tp, None, sent)
            self._maybe_start(tp)
            return
        try:
            grant = await self.broker.scripts.run(
                calls.acquire_lease(
                    self.broker.keys, self._ref(tp[0]), tp[1], self.name,
                    self.settings.lease_ttl_ms, self._start_ids[tp[0]],
                )
            )  # fmt: skip
        except TopicNotFound:
            self.ownership.partitions_seen(tp[0], None)
            return
        if grant is None:
            return
        reader = OrderlyPartition(grant)
        await self.io.load_parked(reader)
        self.ownership.granted(tp, grant, sent)
        self._readers[tp] = reader
        self.stats.leases_acquired += 1
        log.info("%s: acquired %s/%d (token %d)", self.name, tp[0], tp[1], grant.lease.token)
        await self._callback("on_assign", [tp])
        self._maybe_start(tp)

    async def _renew(self, tp: TopicPartition) -> None:
        owned = self.ownership.owned.get(tp)
        lease = owned.lease if owned else None
        if lease is None:
            return
        sent = time.monotonic()
        try:
            renewed = await self.broker.scripts.run(
                calls.renew_lease(self.broker.keys, lease, self.settings.lease_ttl_ms)
            )
        except redis.RedisError as exc:
            self.ownership.renew_failed(tp, time.monotonic())
            log.warning("%s: renewing %s/%d failed: %s", self.name, tp[0], tp[1], exc)
            return
        if renewed:
            self.ownership.renewed(tp, sent)
        elif self.ownership.lost(tp):
            self.stats.leases_lost += 1
            log.warning("%s: lease on %s/%d lost", self.name, tp[0], tp[1])
            if tp not in self._workers:
                self._forget(tp)

    async def _finish(self, tp: TopicPartition) -> None:
        owned = self.ownership.owned.get(tp)
        reader = self._readers.get(tp)
        if owned is None or owned.finishing:
            return
        owned.finishing = True
        try:
            if reader is not None:
                try:
                    await self._commit(tp)
                except LeaseLost:
                    log.warning("%s: %s/%d: final commit refused, lease lost", self.name, *tp)
                await self._callback("on_revoke", [tp])
            if owned.lease is not None and not owned.lost:
                released = await self.broker.scripts.run(
                    calls.release_lease(self.broker.keys, owned.lease)
                )
                if not released and self.ownership.lost(tp):
                    self.stats.leases_lost += 1
        except redis.RedisError as exc:
            log.warning("%s: handing over %s/%d: %s", self.name, tp[0], tp[1], exc)
        finally:
            self._forget(tp)

    def _forget(self, tp: TopicPartition) -> None:
        self.ownership.finished(tp)
        self._readers.pop(tp, None)
        self._workers.pop(tp, None)

    async def _callback(self, name: str, tps: list[TopicPartition]) -> None:
        callback = getattr(self.settings, name)
        if callback is None:
            return
        try:
            result = callback(tps)
            if asyncio.iscoroutine(result):
                await result
        except Exception:
            log.exception("%s: %s callback raised", self.name, name)

    async def _commit(self, tp: TopicPartition) -> None:
        reader = self._readers.get(tp)
        commit = reader.take_commit() if reader is not None else None
        if reader is None or commit is None:
            return
        try:
            await self.io.commit(reader.lease, commit)
        except LeaseLost:
            self.stats.fenced_commits += 1
            if self.ownership.lost(tp):
                self.stats.leases_lost += 1
            raise
        except redis.RedisError:
            reader.commit_failed(commit, time.monotonic())
            raise
        reader.committed(commit)
        self.stats.commits += 1

    # -- poll ------------------------------------------------------------------------------------
    def _start_use(self, use: str) -> None:
        if self._closed:
            raise ConsumerClosed(f"{use}() after close()")
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise InvalidConfig(f"this consumer already uses {self._use}(); it cannot {use}() too")

    async def _poll_once(self, max_messages: int) -> list[Message]:
        tps = sorted(tp for tp, o in self.ownership.owned.items() if not o.paused)
        if not tps:
            return []
        self._poll_cursor = (self._poll_cursor + 1) % len(tps)
        tps = tps[self._poll_cursor :] + tps[: self._poll_cursor]
        result: list[Message] = []
        now = time.monotonic()
        for tp in tps:
            room = max_messages - len(result)
            if room <= 0:
                break
            if not self.ownership.may_handle(tp, now):
                continue
            reader = self._readers.get(tp)
            if reader is not None and reader.outstanding:
                continue
            try:
                if reader is not None:
                    if reader.commit_due(now, self._ack_interval_s):
                        await self._commit(tp)
                    messages = reader.admit(await self.io.read_range(reader, room), now)
                else:
                    messages = await self.io.claim_idle(tp, room) or await self.io.read_group(
                        tp, room, [], None
                    )
            except LeaseLost:
                if self.ownership.lost(tp):
                    self.stats.leases_lost += 1
                continue
            except redis.RedisError as exc:
                log.warning("%s: reading %s/%d: %s", self.name, tp[0], tp[1], exc)
                continue
            messages = await self._screen(reader, messages)
            result.extend(self._deserialize(m) for m in messages)
        return result

    async def _screen(
        self, reader: OrderlyPartition | None, messages: list[Message]
    ) -> list[Message]:
        """As redisq.partition.PartitionIO.screen (malformed entries go to the policy)."""
        good: list[Message] = []
        given: list[Message] = []
        passed: list[str] = []
        for message in messages:
            if message.__class__ is not MalformedMessage:
                good.append(message)
                given.append(message)
                continue
            action = self.policy.malformed()
            if not (reader is not None and reader.blocked == message.offset):
                self.stats.malformed += 1
            if isinstance(action, DeadLetter):
                self.stats.dead_letters += 1
                await self.io.dead_letter(reader, message, message.error(), 0)  # type: ignore[attr-defined]
                given.append(message)
                passed.append(message.offset)
                continue
            if reader is not None:
                if reader.blocked != message.offset:
                    await self.io.mark_blocked(reader.tp, message, message.error(), 0)  # type: ignore[attr-defined]
                reader.blocked = message.offset
                reader.reread_from(message.offset)
            break
        if reader is not None:
            reader.given(given)
            reader.pending.dead_letters += len(passed)
            reader.pending.malformed += len(passed)
            reader.ack(passed, time.monotonic())
        return good

    def _deserialize(self, message: Message) -> Message:
        if self._key_decoder is None and self._value_decoder is None:
            return message
        return PartitionIO.deserialize(message, self._key_decoder, self._value_decoder)

    def _tp(self, partition: int | TopicPartition) -> TopicPartition:
        if isinstance(partition, tuple):
            return partition
        if len(self.topics) != 1:
            raise InvalidConfig("name the partition as (topic, partition): several topics")
        return (self.topics[0], partition)

    # -- run: one task per partition -------------------------------------------------------------
    def _maybe_start(self, tp: TopicPartition) -> None:
        if self._use == "run":
            self._start_worker(tp)

    def _start_worker(self, tp: TopicPartition) -> None:
        if tp in self._workers or self._handler is None:
            return
        self._workers[tp] = asyncio.ensure_future(handle_partition(self, tp))

    async def _call_handler(self, message: Message) -> Exception | None:
        """The handler's exception, or None; a plain function runs in a worker thread."""
        assert self._handler is not None
        try:
            if self._handler_is_async:
                await self._handler(self._deserialize(message))
            else:
                await asyncio.to_thread(self._handler, self._deserialize(message))
        except Exception as exc:
            return exc
        return None

    def note_handled(self, count: int) -> None:
        self.stats.handled += count
        self._last_handled = time.monotonic()

    async def worker_done(self, tp: TopicPartition) -> None:
        self._workers.pop(tp, None)
        await self._finish(tp)
