"""The consumer's coordinator: membership, leases and the partitions' lifecycle, as one task (a
thread in the thread API, generated from this module by tools/async_to_sync.py).

The coordinator heartbeats into the group's registry, follows the assignment (ownership.py
decides), acquires and renews the leases, and hands partitions over (commit, on_revoke,
release) when they move, the lease is lost or the consumer closes.
`redisq.consume.consumer_async.Consumer` is the public API on top of it;
`redisq.consume.worker_async.Worker` handles a partition in run().

The state shared by the coordinator, the workers and the API's callers (ownership, readers,
workers) changes under `with self._guard:` (a re-entrant lock in the thread API, nothing in
asyncio, where code between two awaits runs alone), never across a round trip.

A little over 500 lines: the consumer's state and the lifecycle of its partitions (acquire,
announce, renew, hand over, commit) are one object; its Redis calls are PartitionIO's and
GroupMembership's, its decisions the cores'.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Unpack

import redis

from redisq.consume.dispatch import OrderlyPartition
from redisq.consume.membership_async import GroupMembership
from redisq.consume.ownership import OwnershipCore, TopicPartition
from redisq.consume.partition_io_async import AsyncPartitionIO
from redisq.consume.policies import Backoff, make_policy
from redisq.consume.reading import deserialize, deserializer
from redisq.errors import InvalidConfig, InvalidName, LeaseLost, RedisqError, TopicNotFound
from redisq.model.keys import dead_letter_topic, validate_name, validate_topic
from redisq.model.records import Message
from redisq.model.stats import ConsumerStats, track
from redisq.protocol.group import Commit, Lease
from redisq.protocol.transaction_ops import settle_input
from redisq.runtime import (
    ACancelled,
    AEvent,
    AGuard,
    ALock,
    ATask,
    amaybe_await,
    asleep,
    aspawn,
    is_async,
)
from redisq.schedule.scheduler_async import Scheduler
from redisq.settings import ConsumerOptions, ConsumerSettings

if TYPE_CHECKING:
    from redisq.server.handle_async import AsyncBrokerHandle

log = logging.getLogger("redisq.consumer")

# The consumer whose coordinator, run() worker, key lane, handler or close this is: close()
# called there, from a handler or a callback, must not wait for itself. A context variable
# serves both runtimes: a thread starts with a context of its own, a task copies its creator's,
# and asyncio.to_thread (a plain handler) carries the task's into the thread.
_current: ContextVar[Any] = ContextVar("redisq_consumer", default=None)


def mark_own(consumer: Coordinator) -> None:
    _current.set(consumer)


def default_member_name() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:60]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


class Coordinator:
    """The state and the coordinator task of one consumer (see the module doc)."""

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
            for topic in self.topics:  # a name past its length limit can only block
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
        self._guard = AGuard()
        self.ownership = OwnershipCore(
            self.name,
            orderly=self.mode == "orderly",
            lease_ttl_ms=settings.lease_ttl_ms,
            heartbeat_ms=settings.heartbeat_ms,
            metadata_max_age_ms=settings.metadata_max_age_ms,
        )
        self._memberships: dict[str, GroupMembership] = {}
        self.io = AsyncPartitionIO(broker, self.group, self.name, settings, self.policy)
        self._readers: dict[TopicPartition, OrderlyPartition] = {}
        # One commit of a reader on the wire at a time: two sent at once (commit() from one
        # caller, an ack's or the worker's from another) can arrive in either order, and an
        # earlier position arriving last would move the group back.
        self._commit_locks: weakref.WeakKeyDictionary[OrderlyPartition, ALock] = (
            weakref.WeakKeyDictionary()
        )
        self._workers: dict[TopicPartition, ATask] = {}
        self._handler: Callable[[Message], Any] | None = None
        self._handler_coroutine = False  # asyncio: awaited, else run in a worker thread
        self._use: str | None = None  # "poll" or "run"
        # What on_assign raised: the member stops, and run()/poll() raise it (Kafka's Java
        # consumer raises it from poll()); nothing of the partitions it was told of is read
        self._assign_error: Exception | None = None
        self._stopping = AEvent()
        self._coordinator_stop = AEvent()
        self._wake = AEvent()
        self._closed = False
        self._close_done = AEvent()  # close()'s steps finished (wherever they ran)
        self._closing: ATask | None = None  # close()'s steps (held while they run)
        self._started = False
        self._coordinator: ATask | None = None
        self._poll_cursor = 0
        self._handed: list[Message] = []  # poll()'s and iteration's, not acked since (auto-commit)
        self._stall_logged = 0.0
        self._poll_lock = ALock()  # one poll() read at a time
        self._announce_lock = ALock()  # on_assign once per grant
        self._last_handled = time.monotonic()
        # run(max_messages=N): how many more messages may start (None: no limit), counted
        # under a guard of its own (the workers take it per message)
        self._budget: int | None = None
        self._budget_guard = AGuard()
        # Consumers deliver their topics' delayed messages (redisq.schedule.scheduler_async)
        # while the coordinator runs.
        self._scheduler = Scheduler(broker, start=False)
        if is_async():
            pass  # joins in start() (or `async with`): I/O needs the running loop
        else:
            self.start()

    async def start(self) -> None:
        """Join the group (TopicNotFound, GroupModeMismatch now) and start the coordinator. The
        thread API's consumer does this in its constructor; the asyncio one in start(), which
        `async with`, run() and poll() call."""
        with self._guard:
            if self._started:
                return
            self._started = True
        try:
            await self._join_all()
        except BaseException:
            with self._guard:  # nothing runs: start() may be called again
                self._started = False
            raise
        if self._closed:  # close() came while it started: nothing left running, nor joined
            await self._leave_group()
            return
        self._coordinator = aspawn(self._coordinate, name=f"redisq-consumer-{self.name}")
        track(self)  # its counters in redisq.metrics.collect(), held weakly

    async def _join_all(self) -> None:
        """Read the topics (TopicNotFound first), join the group on each, read the members;
        a lost connection (the server dropped it, twice in a row) is tried again with backoff
        for up to session_timeout_ms (every step can be repeated), then raised."""
        deadline = time.monotonic() + self.settings.session_ms / 1000
        backoff = self.settings.retry_backoff_ms / 1000
        while True:
            try:
                for topic in self.topics:
                    await self.broker.topic_config(topic, refresh=True)
                for topic in list(self.topics):
                    await self._join(topic)
                await self._refresh_metadata()
                return
            except redis.ConnectionError as exc:
                if time.monotonic() + backoff >= deadline:
                    raise
                log.warning("%s: joining %s again: %s", self.name, self.group, exc)
                await asleep(backoff)
                backoff = min(2 * backoff, self.settings.max_retry_backoff_ms / 1000)

    async def _join(self, topic: str) -> None:
        membership = GroupMembership(
            self.broker,
            topic,
            self.group,
            self.name,
            mode=self.mode,
            start=self.settings.start,
            policy=self.policy.name,
            lease_ttl_ms=self.settings.lease_ttl_ms,
            session_timeout_ms=self.settings.session_ms,
        )
        if await membership.join():
            log.info("created group %s on %s (%s)", self.group, topic, self.mode)
        self._memberships[topic] = membership
        self._scheduler.add_topic(topic)
        await self._heartbeat(topic, membership)

    async def _heartbeat(self, topic: str, membership: GroupMembership) -> None:
        members = await membership.heartbeat()
        with self._guard:
            if self.ownership.members_seen(topic, members):
                log.info("%s: members of %s/%s: %s", self.name, topic, self.group, members)

    async def _leave_group(self) -> None:
        """Leave the group on every topic joined (the others get its partitions at once)."""
        for membership in list(self._memberships.values()):  # start() may join one meanwhile
            try:
                await membership.leave()
            except redis.RedisError as exc:
                log.warning("%s: could not leave the group: %s", self.name, exc)

    async def _refresh_metadata(self) -> None:
        """Partition counts of the subscribed topics (added partitions are taken up), and with a
        pattern, topics created or deleted since."""
        if self._pattern is not None:
            for topic in await self.broker.list_topics():
                if topic not in self._memberships and self._pattern.fullmatch(topic):
                    self.topics.append(topic)
                    await self._join(topic)
        for topic in list(self._memberships):
            partitions: int | None
            try:
                config = await self.broker.topic_config(topic, refresh=True)
                partitions = config.partitions
            except TopicNotFound:
                log.warning("%s: topic %s no longer exists", self.name, topic)
                partitions = None
            with self._guard:
                self.ownership.partitions_seen(topic, partitions)
            if partitions is not None and self.mode == "concurrent":
                membership = self._memberships[topic]
                for p in range(partitions):
                    await membership.ensure_stream_group(p)

    def _halt_coordinator(self) -> None:
        self._coordinator_stop.set()
        self._wake.set()

    async def _coordinate(self) -> None:
        """Heartbeats, metadata, assignment, lease acquire/renew/hand-over; until close()."""
        mark_own(self)
        self._scheduler.start()  # stopped by close(), once the coordinator has stopped
        while not self._coordinator_stop.is_set():
            try:
                await self._coordinate_once(time.monotonic())
            except redis.RedisError as exc:
                log.warning("%s: coordinator: %s: %s", self.name, type(exc).__name__, exc)
            except Exception:  # pragma: no cover - keep the member alive (the lease guards)
                log.exception("%s: coordinator error", self.name)
            await self._wake.wait(self._tick_s)
            self._wake.clear()

    async def _coordinate_once(self, now: float) -> None:
        with self._guard:
            due = self.ownership.due(now)
        if due.refresh_metadata:
            await self._refresh_metadata()
        if due.heartbeat:
            for topic, membership in list(self._memberships.items()):
                await self._heartbeat(topic, membership)
            with self._guard:
                self.stats.rebalances = self.ownership.rebalances
                due = self.ownership.due(now)
        for tp in due.renew:
            await self._renew(tp)
        for tp in due.hand_over:
            await self._hand_over(tp, now)
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
        """An acquire of tp given up (tp no longer wanted, or its grant could not be taken up):
        the grant it made, if any, is released (the next owner need not wait for its ttl). An
        error leaves it to the next tick."""
        membership = self._memberships.get(tp[0])
        try:
            released = membership is not None and await membership.give_up_lease(tp[1], request)
        except redis.RedisError as exc:
            log.warning("%s: giving up %s/%d: %s: %s", self.name, *tp, type(exc).__name__, exc)
            return
        with self._guard:
            self.ownership.given_up(request)
        if released:
            log.info("%s: released %s/%d (its acquire given up)", self.name, *tp)

    async def _acquire(self, tp: TopicPartition) -> None:
        """Acquire tp's lease. Its request id is kept until the grant is taken up, refused or
        given up: after any error, the next attempt is answered with the grant this one may
        have made (an error reply to a second attempt says nothing of the first)."""
        sent = time.monotonic()
        membership = self._memberships[tp[0]]
        if self.mode == "concurrent":
            with self._guard:
                self.ownership.granted(tp, None, sent)
                self._maybe_start(tp)
            return
        with self._guard:
            request = self.ownership.acquire_request(tp)
        try:
            grant = await membership.acquire_lease(tp[1], request)
        except TopicNotFound:
            log.warning("%s: topic %s no longer exists", self.name, tp[0])
            with self._guard:
                self.ownership.answered(tp)
                self.ownership.partitions_seen(tp[0], None)
            return
        if grant is None:
            with self._guard:
                self.ownership.answered(tp)
            return
        if grant.pending_tx is not None:  # a transaction of the previous owner holds it
            try:
                grant = await self.broker.run(settle_input(self.broker.keys, grant))
            except (RedisqError, redis.RedisError) as exc:
                log.warning("%s: settling %s/%d: %s", self.name, tp[0], tp[1], exc)
                with self._guard:  # released, nothing given out
                    given_up = self.ownership.give_up(tp)
                if given_up is not None:
                    await self._give_up(given_up, tp)
                return
        reader = OrderlyPartition(grant)
        await self.io.load_parked(reader)
        with self._guard:  # at once: a cancel finds it owned or still asked for
            self.ownership.granted(tp, grant, sent)
            self.ownership.answered(tp)
            self._readers[tp] = reader
            self.stats.leases_acquired += 1
        log.info("%s: acquired %s/%d (token %d)", self.name, tp[0], tp[1], grant.lease.token)
        await self._announce()

    async def _announce(self) -> None:
        """on_assign for the partitions granted and not yet told, once run() or poll() has
        been called (as Kafka calls it from poll(): before that, the consumer may not even be
        bound to its name yet); nothing of a partition is read before on_assign returns."""
        async with self._announce_lock:
            if self._assign_error is not None:  # the member stops: nothing is told any more
                return
            with self._guard:
                owneds = self.ownership.to_announce() if self._use is not None else []
            if not owneds:
                return
            try:
                await self._callback("on_assign", [owned.tp for owned in owneds], reraise=True)
            except BaseException as exc:
                with self._guard:
                    self.ownership.announce_abandoned(owneds)
                if not isinstance(exc, Exception):
                    raise
                log.error(
                    "%s: on_assign raised: the member stops (run()/poll() raise it); nothing "
                    "of %s was read",
                    self.name,
                    ", ".join(f"{t}/{p}" for t, p in (o.tp for o in owneds)),
                    exc_info=exc,
                )
                self._assign_error = exc
                self._wake.set()
                return
            with self._guard:
                start, owed = self.ownership.announce_done(owneds)
                for tp in start:
                    self._maybe_start(tp)
            if owed:  # handed over while on_assign ran (_finish left on_revoke to us)
                await self._callback("on_revoke", owed)

    async def _renew(self, tp: TopicPartition) -> None:
        with self._guard:
            owned = self.ownership.owned.get(tp)
            lease = owned.lease if owned else None
        if lease is None:
            return
        sent = time.monotonic()
        try:
            renewed = await self._memberships[tp[0]].renew_lease(lease)
        except redis.RedisError as exc:
            with self._guard:
                self.ownership.renew_failed(tp, time.monotonic())
            log.warning("%s: renewing %s/%d failed: %s", self.name, tp[0], tp[1], exc)
            return
        with self._guard:
            if renewed:
                self.ownership.renewed(tp, sent)
            else:
                self._lease_lost(tp)

    def _lease_lost(self, tp: TopicPartition) -> None:
        """The lease on tp is gone (under the guard): counted once; a partition no run() worker
        handles is forgotten now, so it is acquired again once it is free (a worker's partition
        is forgotten when the worker stops)."""
        if self.ownership.lost(tp):
            self.stats.leases_lost += 1
            log.warning("%s: lease on %s/%d lost", self.name, tp[0], tp[1])
        if tp not in self._workers:
            self._forget(tp)

    async def _hand_over(self, tp: TopicPartition, now: float) -> None:
        """A revoked partition: run() workers stop by themselves; in poll() mode it is finished
        once the caller acked what it got, or after a lease ttl."""
        with self._guard:
            if tp in self._workers:
                return
            reader = self._readers.get(tp)
            owned = self.ownership.owned.get(tp)
            waiting = reader is not None and bool(reader.outstanding)
            revoked_for = now - owned.revoked_at if owned else 0.0
        if waiting and revoked_for < self.settings.lease_ttl_ms / 1000:
            return
        await self._finish(tp)

    async def _finish(self, tp: TopicPartition) -> None:
        """Commit what was handled, tell on_revoke, release the lease (no ttl wait for the
        next owner)."""
        with self._guard:
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
                with self._guard:
                    tell = self.ownership.revoke_now(owned)
                if tell:
                    await self._callback("on_revoke", [tp])
            if owned.lease is not None and not owned.lost:
                if await self._memberships[tp[0]].release_lease(owned.lease, untried):
                    log.info("%s: released %s/%d", self.name, tp[0], tp[1])
                else:
                    with self._guard:
                        if self.ownership.lost(tp):
                            self.stats.leases_lost += 1
                    log.warning("%s: %s/%d: lease had already moved", self.name, *tp)
        except ACancelled:
            # close() cancelled the coordinator in the middle of this hand-over: left to close(),
            # which finishes what is still owned (from the start: the commit and the release
            # are safe to send again)
            owned.finishing, cancelled = False, True
            raise
        except redis.RedisError as exc:
            log.warning("%s: handing over %s/%d: %s", self.name, tp[0], tp[1], exc)
        finally:
            if not cancelled:
                with self._guard:
                    self._forget(tp)

    def _forget(self, tp: TopicPartition) -> None:
        self.ownership.finished(tp)
        self._readers.pop(tp, None)
        self._workers.pop(tp, None)
        self._wake.set()

    async def _callback(self, name: str, tps: list[TopicPartition], reraise: bool = False) -> None:
        """on_assign / on_revoke (a coroutine function's result awaited); what it raises is
        raised again (reraise) or logged."""
        callback = getattr(self.settings, name)
        if callback is None:
            return
        try:
            await amaybe_await(callback(tps))
        except Exception:
            if reraise:
                raise
            log.exception("%s: %s callback raised", self.name, name)

    async def _commit(
        self, tp: TopicPartition, send: Callable[[Lease, Commit], Awaitable[bool]] | None = None
    ) -> bool:
        """Commit what was handled on tp (False: nothing to commit). send(lease, commit): how
        it goes to Redis (default PartitionIO.commit; a caught-up worker sends it ahead of its
        waiting read), False when a transaction's hold overtook it (nothing was applied)."""
        with self._guard:
            reader = self._readers.get(tp)
            if reader is None:
                return False
            sending = self._commit_locks.get(reader)
            if sending is None:
                sending = self._commit_locks[reader] = ALock()
        async with sending:  # after the commit under way, if any (it may fail and come back)
            with self._guard:
                commit = reader.take_commit()
            if commit is None:
                return False
            try:
                applied = await (send or self.io.commit)(reader.lease, commit)
            except LeaseLost:
                self.stats.fenced_commits += 1
                with self._guard:
                    self._lease_lost(tp)
                raise
            except (redis.RedisError, ACancelled):  # a cancel: close() commits again
                with self._guard:
                    reader.commit_failed(commit, time.monotonic())
                raise
            with self._guard:
                reader.commit_answered(commit, applied, time.monotonic())
        self.stats.commits += applied
        return True

    def _deserialize(self, message: Message) -> Message:
        if self._key_decoder is None and self._value_decoder is None:
            return message
        return deserialize(message, self._key_decoder, self._value_decoder)

    def _maybe_start(self, tp: TopicPartition) -> None:
        if self._use == "run":
            self._start_worker(tp)

    def _own(self) -> bool:
        """Is the caller this consumer's own (a handler, a callback, its close)?"""
        return _current.get() is self

    def handler_for_workers(self) -> Callable[[Message], Any]:
        assert self._handler is not None
        return self._handler

    def take_message(self) -> bool:
        """run(max_messages=N): one more message may go to the handler (False once N went:
        the worker stops before it, and the message is read again by the next owner)."""
        if self._budget is None:
            return True
        with self._budget_guard:
            if self._budget <= 0:
                return False
            self._budget -= 1
            return True

    def note_handled(self, count: int) -> None:
        self.stats.handled += count
        self._last_handled = time.monotonic()

    async def worker_done(self, tp: TopicPartition) -> None:
        """A worker stopped (revoked, lease lost or near its deadline, close): hand over."""
        with self._guard:
            self._workers.pop(tp, None)
        await self._finish(tp)

    def _start_worker(self, tp: TopicPartition) -> None:
        """run() starts a worker per partition (redisq.consume.consumer_async.Consumer)."""
