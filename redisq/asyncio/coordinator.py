"""The asyncio consumer's coordinator: membership, leases and the partitions' lifecycle (the
twin of redisq.coordinator), as one task. redisq.asyncio.consumer.Consumer is the API on top.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import redis

from redisq import metrics
from redisq.asyncio.scheduler import Scheduler
from redisq.coordinator import default_member_name
from redisq.dispatch import OrderlyPartition
from redisq.errors import InvalidConfig, InvalidName, LeaseLost, RedisqError, TopicNotFound
from redisq.keys import dead_letter_topic, validate_name, validate_topic
from redisq.ownership import OwnershipCore, TopicPartition
from redisq.partition import PartitionIO, deserializer
from redisq.policies import Backoff, make_policy
from redisq.protocol import group as calls
from redisq.protocol.group import Commit, GroupRef, Lease
from redisq.records import Message
from redisq.settings import ConsumerOptions, ConsumerSettings
from redisq.stats import ConsumerStats
from redisq.tx_ops import settle_input

from .partition import AsyncPartitionIO

if TYPE_CHECKING:
    from redisq.asyncio.handle import AsyncBrokerHandle

log = logging.getLogger("redisq.consumer")


class Coordinator:
    """The state and the coordinator task of one asyncio consumer."""

    def __init__(
        self,
        broker: AsyncBrokerHandle,
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
        self.io = AsyncPartitionIO(broker, self.group, self.name, settings)
        self._readers: dict[TopicPartition, OrderlyPartition] = {}
        # one commit of a reader on the wire at a time (see redisq.coordinator)
        self._commit_locks: weakref.WeakKeyDictionary[OrderlyPartition, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._workers: dict[TopicPartition, asyncio.Task[None]] = {}
        self._handler: Callable[[Message], Any] | None = None
        self._handler_is_async = False
        self._use: str | None = None
        self._stopping = asyncio.Event()
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # close()'s steps (held while they run)
        self._started = False
        self._coordinator: asyncio.Task[None] | None = None
        # Set by close() before it cancels the coordinator task: a cancel can be lost on its
        # way (client.stop_task), so the loop also ends on this flag at its next tick.
        self._halted = False
        self._poll_cursor = 0
        self._announce_lock = asyncio.Lock()  # on_assign once per grant
        self._last_handled = time.monotonic()
        # run(max_messages=N): how many more messages may start (None: no limit)
        self._budget: int | None = None
        # Consumers deliver their topics' delayed messages (redisq.scheduler) while the
        # coordinator task runs.
        self._scheduler = Scheduler(broker, start=False)

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
        if self._closed:  # close() came while it started: nothing left running, nor joined
            await self._leave_group()
            return
        self._coordinator = asyncio.ensure_future(self._coordinate())
        metrics.track(self)  # its counters in redisq.metrics.collect(), held weakly

    async def _leave_group(self) -> None:
        """Leave the group on every topic joined (the others get its partitions at once)."""
        for topic in list(self._start_ids):  # start() may join one more meanwhile
            try:
                await self.broker.scripts.run(
                    calls.heartbeat(
                        self.broker.keys, self._ref(topic), self.name,
                        self.settings.session_ms, leave=True,
                    )
                )  # fmt: skip
            except redis.RedisError as exc:
                log.warning("%s: could not leave the group: %s", self.name, exc)

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
        self._scheduler.add_topic(topic)
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

    def _halt(self) -> None:
        self._halted = True

    async def _coordinate(self) -> None:
        self._scheduler.start()
        try:
            while not self._halted:
                try:
                    await self._coordinate_once(time.monotonic())
                except asyncio.CancelledError:
                    raise
                except redis.RedisError as exc:
                    log.warning("%s: coordinator: %s: %s", self.name, type(exc).__name__, exc)
                except Exception:  # pragma: no cover - keep the member alive (the lease guards)
                    log.exception("%s: coordinator error", self.name)
                await asyncio.sleep(self._tick_s)
        finally:
            await self._scheduler.close()

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
        for request, tp in due.give_up:  # first: an acquire that fails must not hold them up
            await self._give_up(request, tp)
        for tp in due.acquire:
            if self._stopping.is_set():
                break
            try:
                await self._acquire(tp)
            except redis.RedisError as exc:  # the others are tried all the same
                log.warning("%s: acquiring %s/%d: %s: %s", self.name, *tp, type(exc).__name__, exc)

    async def _give_up(self, request: str, tp: TopicPartition) -> None:
        """See redisq.coordinator.Coordinator._give_up."""
        try:
            released = await self.broker.scripts.run(
                calls.give_up_lease(self.broker.keys, self._ref(tp[0]), tp[1], self.name, request)
            )
        except redis.RedisError as exc:
            log.warning("%s: giving up %s/%d: %s: %s", self.name, *tp, type(exc).__name__, exc)
            return
        self.ownership.given_up(request)
        if released:
            log.info("%s: released %s/%d (its acquire given up)", self.name, *tp)

    async def _acquire(self, tp: TopicPartition) -> None:
        """See redisq.coordinator.Coordinator._acquire (the request id is kept until the grant
        is taken up, refused or released)."""
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
                    self.ownership.acquire_request(tp),
                )
            )  # fmt: skip
        except TopicNotFound:
            self.ownership.answered(tp)
            self.ownership.partitions_seen(tp[0], None)
            return
        if grant is None:
            self.ownership.answered(tp)
            return
        if grant.pending_tx is not None:  # a transaction of the previous owner holds it
            try:
                grant = await self.broker.run(settle_input(self.broker.keys, grant))
            except (RedisqError, redis.RedisError) as exc:
                log.warning("%s: settling %s/%d: %s", self.name, tp[0], tp[1], exc)
                request = self.ownership.give_up(tp)  # released, nothing given out
                if request is not None:
                    await self._give_up(request, tp)
                return
        reader = OrderlyPartition(grant)
        await self.io.load_parked(reader)
        self.ownership.granted(tp, grant, sent)
        self.ownership.answered(tp)  # no await between: a cancel finds it owned or still asked
        self._readers[tp] = reader
        self.stats.leases_acquired += 1
        log.info("%s: acquired %s/%d (token %d)", self.name, tp[0], tp[1], grant.lease.token)
        await self._announce()

    async def _announce(self) -> None:
        """See redisq.coordinator.Coordinator._announce."""
        async with self._announce_lock:
            owneds = self.ownership.to_announce() if self._use is not None else []
            if not owneds:
                return
            try:
                await self._callback("on_assign", [owned.tp for owned in owneds])
            except BaseException:
                self.ownership.announce_abandoned(owneds)
                raise
            start, owed = self.ownership.announce_done(owneds)
            for tp in start:
                self._maybe_start(tp)
            if owed:  # handed over while on_assign ran (_finish left on_revoke to us)
                await self._callback("on_revoke", owed)

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
        else:
            self._lease_lost(tp)

    def _lease_lost(self, tp: TopicPartition) -> None:
        """The lease on tp is gone: counted once; a partition no run() task handles is forgotten
        now, so it is acquired again once it is free (see redisq.coordinator)."""
        if self.ownership.lost(tp):
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
        untried = reader.hand_back() if reader is not None else None  # a poll() read: dropped
        cancelled = False
        try:
            if reader is not None:
                try:
                    await self._commit(tp)
                except LeaseLost:
                    log.warning("%s: %s/%d: final commit refused, lease lost", self.name, *tp)
                if self.ownership.revoke_now(owned):
                    await self._callback("on_revoke", [tp])
            if owned.lease is not None and not owned.lost:
                released = await self.broker.scripts.run(
                    calls.release_lease(self.broker.keys, owned.lease, untried)
                )
                if not released and self.ownership.lost(tp):
                    self.stats.leases_lost += 1
        except asyncio.CancelledError:
            # close() cancelled the coordinator in the middle of this hand-over: left to close(),
            # which finishes what is still owned (from the start: the commit and the release
            # are safe to send again)
            owned.finishing, cancelled = False, True
            raise
        except redis.RedisError as exc:
            log.warning("%s: handing over %s/%d: %s", self.name, tp[0], tp[1], exc)
        finally:
            if not cancelled:
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

    async def _commit(
        self, tp: TopicPartition, send: Callable[[Lease, Commit], Awaitable[bool]] | None = None
    ) -> bool:
        """See redisq.coordinator.Coordinator._commit."""
        reader = self._readers.get(tp)
        if reader is None:
            return False
        sending = self._commit_locks.get(reader)
        if sending is None:
            sending = self._commit_locks[reader] = asyncio.Lock()
        async with sending:  # one commit of a reader on the wire at a time (see the thread's)
            commit = reader.take_commit()
            if commit is None:
                return False
            try:
                applied = await (send or self.io.commit)(reader.lease, commit)
            except LeaseLost:
                self.stats.fenced_commits += 1
                self._lease_lost(tp)
                raise
            except (redis.RedisError, asyncio.CancelledError):  # a cancel: close() commits again
                reader.commit_failed(commit, time.monotonic())
                raise
            reader.commit_answered(commit, applied, time.monotonic())
        self.stats.commits += applied
        return True

    def _deserialize(self, message: Message) -> Message:
        if self._key_decoder is None and self._value_decoder is None:
            return message
        return PartitionIO.deserialize(message, self._key_decoder, self._value_decoder)

    def _maybe_start(self, tp: TopicPartition) -> None:
        if self._use == "run":
            self._start_worker(tp)

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

    def take_message(self) -> bool:
        """See redisq.coordinator.Coordinator.take_message."""
        if self._budget is None:
            return True
        if self._budget <= 0:
            return False
        self._budget -= 1
        return True

    def note_handled(self, count: int) -> None:
        self.stats.handled += count
        self._last_handled = time.monotonic()

    async def worker_done(self, tp: TopicPartition) -> None:
        self._workers.pop(tp, None)
        await self._finish(tp)

    def _start_worker(self, tp: TopicPartition) -> None:
        """run() starts a task per partition (redisq.asyncio.consumer.Consumer)."""
