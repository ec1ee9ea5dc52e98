"""The consumer's coordinator (thread driver): membership, leases and the partitions' lifecycle.

A thread heartbeats into the group's registry, follows the assignment (ownership.py decides),
acquires and renews the leases, and hands partitions over (commit, on_revoke, release) when
they move, the lease is lost or the consumer closes. `redisq.consumer.Consumer` is the public
API on top of it; `redisq.worker.Worker` handles a partition in run().
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import redis

from redisq import metrics
from redisq.dispatch import OrderlyPartition
from redisq.errors import InvalidConfig, InvalidName, LeaseLost, RedisqError, TopicNotFound
from redisq.group import GroupMembership
from redisq.keys import dead_letter_topic, validate_name, validate_topic
from redisq.ownership import OwnershipCore, TopicPartition
from redisq.partition import PartitionIO, deserializer
from redisq.policies import Backoff, make_policy
from redisq.protocol import run_operation
from redisq.protocol.group import Commit, Lease
from redisq.records import Message
from redisq.scheduler import Scheduler
from redisq.settings import ConsumerOptions, ConsumerSettings
from redisq.stats import ConsumerStats
from redisq.tx_ops import settle_input

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle

log = logging.getLogger("redisq.consumer")

# The consumer whose thread this is (its coordinator, a run() worker or lane): close() called
# there, from a handler or a callback, must not wait for the thread it runs in.
_current = threading.local()


def mark_thread(consumer: Coordinator) -> None:
    _current.consumer = consumer


def default_member_name() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:60]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


class Coordinator:
    """The state and the coordinator thread of one consumer (see the module doc)."""

    def __init__(
        self,
        broker: BrokerHandle,
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
        self._lock = threading.RLock()
        self.ownership = OwnershipCore(
            self.name,
            orderly=self.mode == "orderly",
            lease_ttl_ms=settings.lease_ttl_ms,
            heartbeat_ms=settings.heartbeat_ms,
            metadata_max_age_ms=settings.metadata_max_age_ms,
        )
        self._memberships: dict[str, GroupMembership] = {}
        self.io = PartitionIO(broker, self.group, self.name, settings, self.policy)
        self._readers: dict[TopicPartition, OrderlyPartition] = {}
        # One commit of a reader on the wire at a time: two sent at once (commit() from one
        # thread, an ack's or the worker's from another) can arrive in either order, and an
        # earlier position arriving last would move the group back.
        self._commit_locks: weakref.WeakKeyDictionary[OrderlyPartition, threading.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._workers: dict[TopicPartition, threading.Thread] = {}
        self._handler: Callable[[Message], Any] | None = None
        self._use: str | None = None  # "poll" or "run"
        self._stopping = threading.Event()
        self._coordinator_stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._close_done = threading.Event()  # close() finished (in whichever thread)
        self._poll_cursor = 0
        self._poll_lock = threading.Lock()
        self._announce_lock = threading.Lock()  # on_assign once per grant
        self._last_handled = time.monotonic()
        # run(max_messages=N): how many more messages may start (None: no limit)
        self._budget: int | None = None
        self._budget_lock = threading.Lock()
        # Consumers deliver their topics' delayed messages (redisq.scheduler), from the
        # coordinator thread's start until it stops.
        self._scheduler = Scheduler(broker, start=False)

        for topic in self.topics:
            broker.topic_config(topic, refresh=True)  # TopicNotFound before anything is written
        for topic in self.topics:
            self._join(topic)
        self._refresh_metadata()
        self._coordinator = threading.Thread(
            target=self._coordinate, name=f"redisq-consumer-{self.name}", daemon=True
        )
        self._coordinator.start()
        metrics.track(self)  # its counters in redisq.metrics.collect(), held weakly

    def _join(self, topic: str) -> None:
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
        if membership.join():
            log.info("created group %s on %s (%s)", self.group, topic, self.mode)
        self._memberships[topic] = membership
        self._scheduler.add_topic(topic)
        self.ownership.members_seen(topic, membership.heartbeat())

    def _refresh_metadata(self) -> None:
        """Partition counts of the subscribed topics (added partitions are taken up), and with a
        pattern, topics created or deleted since."""
        if self._pattern is not None:
            for topic in self.broker.list_topics():
                if topic not in self._memberships and self._pattern.fullmatch(topic):
                    self.topics.append(topic)
                    self._join(topic)
        for topic in list(self._memberships):
            try:
                partitions = self.broker.topic_config(topic, refresh=True).partitions
            except TopicNotFound:
                log.warning("%s: topic %s no longer exists", self.name, topic)
                partitions = None
            with self._lock:
                self.ownership.partitions_seen(topic, partitions)
            if partitions is not None and self.mode == "concurrent":
                membership = self._memberships[topic]
                for p in range(partitions):
                    membership.ensure_stream_group(p)

    def _coordinate(self) -> None:
        """Heartbeats, metadata, assignment, lease acquire/renew/hand-over; until close()."""
        mark_thread(self)
        self._scheduler.start()
        while not self._coordinator_stop.is_set():
            try:
                self._coordinate_once(time.monotonic())
            except redis.RedisError as exc:
                log.warning("%s: coordinator: %s: %s", self.name, type(exc).__name__, exc)
            except Exception:  # pragma: no cover - keep the member alive; the lease is the guard
                log.exception("%s: coordinator error", self.name)
            self._wake.wait(self._tick_s)
            self._wake.clear()
        self._scheduler.close()

    def _coordinate_once(self, now: float) -> None:
        with self._lock:
            due = self.ownership.due(now)
        if due.refresh_metadata:
            self._refresh_metadata()
        if due.heartbeat:
            for topic, membership in list(self._memberships.items()):
                members = membership.heartbeat()
                with self._lock:
                    if self.ownership.members_seen(topic, members):
                        log.info("%s: members of %s/%s: %s", self.name, topic, self.group, members)
            with self._lock:
                self.stats.rebalances = self.ownership.rebalances
                due = self.ownership.due(now)
        for tp in due.renew:
            self._renew(tp)
        for tp in due.hand_over:
            self._hand_over(tp, now)
        for request, tp in due.give_up:  # first: an acquire that fails must not hold them up
            self._give_up(request, tp)
        for tp in due.acquire:
            if self._stopping.is_set():
                break
            try:
                self._acquire(tp)
            except redis.RedisError as exc:  # the others are tried all the same
                log.warning("%s: acquiring %s/%d: %s: %s", self.name, *tp, type(exc).__name__, exc)

    def _give_up(self, request: str, tp: TopicPartition) -> None:
        """An acquire of tp given up (tp no longer wanted, or its grant could not be taken up):
        the grant it made, if any, is released (the next owner need not wait for its ttl). An
        error leaves it to the next tick."""
        membership = self._memberships.get(tp[0])
        try:
            released = membership is not None and membership.give_up_lease(tp[1], request)
        except redis.RedisError as exc:
            log.warning("%s: giving up %s/%d: %s: %s", self.name, *tp, type(exc).__name__, exc)
            return
        with self._lock:
            self.ownership.given_up(request)
        if released:
            log.info("%s: released %s/%d (its acquire given up)", self.name, *tp)

    def _acquire(self, tp: TopicPartition) -> None:
        """Acquire tp's lease. Its request id is kept until the grant is taken up, refused or
        given up: after any error, the next attempt is answered with the grant this one may
        have made (an error reply to a second attempt says nothing of the first)."""
        sent = time.monotonic()
        membership = self._memberships[tp[0]]
        if self.mode == "concurrent":
            with self._lock:
                self.ownership.granted(tp, None, sent)
                self._maybe_start(tp)
            return
        with self._lock:
            request = self.ownership.acquire_request(tp)
        try:
            grant = membership.acquire_lease(tp[1], request)
        except TopicNotFound:
            log.warning("%s: topic %s no longer exists", self.name, tp[0])
            with self._lock:
                self.ownership.answered(tp)
                self.ownership.partitions_seen(tp[0], None)
            return
        if grant is None:
            with self._lock:
                self.ownership.answered(tp)
            return
        if grant.pending_tx is not None:  # a transaction of the previous owner holds it
            try:
                grant = run_operation(
                    settle_input(self.broker.keys, grant), self.broker.scripts.execute
                )
            except (RedisqError, redis.RedisError) as exc:
                log.warning("%s: settling %s/%d: %s", self.name, tp[0], tp[1], exc)
                with self._lock:  # released, nothing given out
                    given_up = self.ownership.give_up(tp)
                if given_up is not None:
                    self._give_up(given_up, tp)
                return
        reader = OrderlyPartition(grant)
        self.io.load_parked(reader)
        with self._lock:
            self.ownership.granted(tp, grant, sent)
            self.ownership.answered(tp)
            self._readers[tp] = reader
            self.stats.leases_acquired += 1
        log.info("%s: acquired %s/%d (token %d)", self.name, tp[0], tp[1], grant.lease.token)
        self._announce()

    def _announce(self) -> None:
        """on_assign for the partitions granted and not yet told, once run() or poll() has
        been called (as Kafka calls it from poll(): before that, the consumer may not even be
        bound to its name yet); nothing of a partition is read before on_assign returns."""
        with self._announce_lock:
            with self._lock:
                owneds = self.ownership.to_announce() if self._use is not None else []
            if not owneds:
                return
            try:
                self._callback("on_assign", [owned.tp for owned in owneds])
            except BaseException:
                with self._lock:
                    self.ownership.announce_abandoned(owneds)
                raise
            with self._lock:
                start, owed = self.ownership.announce_done(owneds)
                for tp in start:
                    self._maybe_start(tp)
            if owed:  # handed over while on_assign ran (_finish left on_revoke to us)
                self._callback("on_revoke", owed)

    def _renew(self, tp: TopicPartition) -> None:
        with self._lock:
            owned = self.ownership.owned.get(tp)
            lease = owned.lease if owned else None
        if lease is None:
            return
        sent = time.monotonic()
        try:
            renewed = self._memberships[tp[0]].renew_lease(lease)
        except redis.RedisError as exc:
            with self._lock:
                self.ownership.renew_failed(tp, time.monotonic())
            log.warning("%s: renewing %s/%d failed: %s", self.name, tp[0], tp[1], exc)
            return
        with self._lock:
            if renewed:
                self.ownership.renewed(tp, sent)
            else:
                self._lease_lost(tp)

    def _lease_lost(self, tp: TopicPartition) -> None:
        """The lease on tp is gone (the lock is held): counted once; a partition no run() worker
        handles is forgotten now, so it is acquired again once it is free (a worker's partition
        is forgotten when the worker stops)."""
        if self.ownership.lost(tp):
            self.stats.leases_lost += 1
            log.warning("%s: lease on %s/%d lost", self.name, tp[0], tp[1])
        if tp not in self._workers:
            self._forget(tp)

    def _hand_over(self, tp: TopicPartition, now: float) -> None:
        """A revoked partition: run() workers stop by themselves; in poll() mode it is finished
        once the caller acked what it got, or after a lease ttl."""
        with self._lock:
            if tp in self._workers:
                return
            reader = self._readers.get(tp)
            owned = self.ownership.owned.get(tp)
            waiting = reader is not None and bool(reader.outstanding)
            revoked_for = now - owned.revoked_at if owned else 0.0
        if waiting and revoked_for < self.settings.lease_ttl_ms / 1000:
            return
        self._finish(tp)

    def _finish(self, tp: TopicPartition) -> None:
        """Commit what was handled, tell on_revoke, release the lease (no ttl wait for the
        next owner)."""
        with self._lock:
            owned = self.ownership.owned.get(tp)
            reader = self._readers.get(tp)
            if owned is None or owned.finishing:
                return
            owned.finishing = True
            untried = reader.hand_back() if reader is not None else None  # a poll() read: dropped
        try:
            if reader is not None:
                try:
                    self._commit(tp)
                except LeaseLost:
                    log.warning("%s: %s/%d: final commit refused, lease lost", self.name, *tp)
                with self._lock:
                    tell = self.ownership.revoke_now(owned)
                if tell:
                    self._callback("on_revoke", [tp])
            if owned.lease is not None and not owned.lost:
                if self._memberships[tp[0]].release_lease(owned.lease, untried):
                    log.info("%s: released %s/%d", self.name, tp[0], tp[1])
                else:
                    with self._lock:
                        if self.ownership.lost(tp):
                            self.stats.leases_lost += 1
                    log.warning("%s: %s/%d: lease had already moved", self.name, *tp)
        except redis.RedisError as exc:
            log.warning("%s: handing over %s/%d: %s", self.name, tp[0], tp[1], exc)
        finally:
            with self._lock:
                self._forget(tp)

    def _forget(self, tp: TopicPartition) -> None:
        self.ownership.finished(tp)
        self._readers.pop(tp, None)
        self._workers.pop(tp, None)
        self._wake.set()

    def _callback(self, name: str, tps: list[TopicPartition]) -> None:
        callback = getattr(self.settings, name)
        if callback is None:
            return
        try:
            callback(tps)
        except Exception:
            log.exception("%s: %s callback raised", self.name, name)

    def _commit(
        self, tp: TopicPartition, send: Callable[[Lease, Commit], bool] | None = None
    ) -> bool:
        """Commit what was handled on tp (False: nothing to commit). send(lease, commit): how
        it goes to Redis (default PartitionIO.commit; a caught-up worker sends it ahead of its
        waiting read), False when a transaction's hold overtook it (nothing was applied)."""
        with self._lock:
            reader = self._readers.get(tp)
            if reader is None:
                return False
            sending = self._commit_locks.get(reader)
            if sending is None:
                sending = self._commit_locks[reader] = threading.Lock()
        with sending:  # after the commit under way, if any (it may fail and come back)
            with self._lock:
                commit = reader.take_commit()
            if commit is None:
                return False
            try:
                applied = (send or self.io.commit)(reader.lease, commit)
            except LeaseLost:
                self.stats.fenced_commits += 1
                with self._lock:
                    self._lease_lost(tp)
                raise
            except redis.RedisError:
                with self._lock:
                    reader.commit_failed(commit, time.monotonic())
                raise
            with self._lock:
                reader.commit_answered(commit, applied, time.monotonic())
        self.stats.commits += applied
        return True

    def _deserialize(self, message: Message) -> Message:
        if self._key_decoder is None and self._value_decoder is None:
            return message
        return self.io.deserialize(message, self._key_decoder, self._value_decoder)

    def _maybe_start(self, tp: TopicPartition) -> None:
        if self._use == "run":
            self._start_worker(tp)

    def _own_thread(self) -> bool:
        """Is the caller a thread of this consumer's (a handler's, a callback's)?"""
        return getattr(_current, "consumer", None) is self

    def handler_for_workers(self) -> Callable[[Message], Any]:
        assert self._handler is not None
        return self._handler

    def take_message(self) -> bool:
        """run(max_messages=N): one more message may go to the handler (False once N went:
        the worker stops before it, and the message is read again by the next owner)."""
        if self._budget is None:
            return True
        with self._budget_lock:
            if self._budget <= 0:
                return False
            self._budget -= 1
            return True

    def note_handled(self, count: int) -> None:
        self.stats.handled += count
        self._last_handled = time.monotonic()

    def worker_done(self, tp: TopicPartition) -> None:
        """A worker stopped (revoked, lease lost or near its deadline, close): hand over."""
        self._finish(tp)

    def _start_worker(self, tp: TopicPartition) -> None:
        """run() starts a worker per partition (redisq.consumer.Consumer)."""
