"""The consumer: a member of a consumer group that reads a topic's partitions.

    with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        consumer.run(handle)            # handle(message); raising means retry

Orderly mode (the default): each partition is owned by one member at a time, under a lease that
Redis checks on every read and ack (group.py). The owner first takes over the partition's pending
entries (XAUTOCLAIM, in offset order), then reads new ones (XREADGROUP). run() gives every owned
partition a thread that calls the handler one message at a time, in offset order; with
key_concurrency=N, N lanes of one partition run different keys in parallel, each key in order.
A member stops handling a partition once its lease deadline is near and it could not renew.

Concurrent mode: every member reads every partition (competing consumers, no order); entries
left pending by a dead member are reclaimed with XAUTOCLAIM once idle for claim_idle_ms.

Delivery is at-least-once: a message handled but not yet acknowledged when its owner dies is
handled again by the next owner. Exactly-once effects need an idempotent handler
(`Consumer.idempotent`).

Malformed entries (written by another client; see records.py) never reach the handler nor
poll()'s caller: each goes to the group's failure policy as it is met, in offset order with the
messages around it. dead_letter: copied to the dead-letter topic with its raw fields, acked, and
the partition goes on. park_key: the same, and its key is parked when it has one (run() only;
poll() dead-letters without parking, as `Consumer.dead_letter` does). block: orderly, the
partition waits on it (describe shows it blocked) until the entry is deleted (XDEL) or trimmed;
concurrent, it stays pending and is retried when reclaimed. They count in stats.malformed and
describe_group, and are logged at most once per partition per MALFORMED_LOG_INTERVAL_S.

Partitions added to the topic (broker.add_partitions) are read within metadata_max_age_ms: the
member re-reads the topic's metadata that often and rebalances when the count changed.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import redis

from redisq.deadletter import DeadLetterWriter
from redisq.errors import (
    ConsumerClosed,
    InvalidConfig,
    InvalidName,
    LeaseLost,
    TopicNotFound,
    check_int,
)
from redisq.group import MODES, STARTS, GroupMembership, Lease, assign_partitions
from redisq.idempotent import IdempotentHandler
from redisq.keys import validate_name
from redisq.records import MalformedMessage, Message, decode_entries, offset_parts

if TYPE_CHECKING:
    from redisq.broker import Broker

log = logging.getLogger("redisq.consumer")

POLICIES = ("dead_letter", "park_key", "block")
MALFORMED_LOG_INTERVAL_S = 10.0
MAX_IDS_PER_CALL = 1000  # ids per XACK script call: Lua's unpack() has a stack limit


class _Stop(Exception):
    """The partition must stop being handled (revoked, lease lost or near its deadline, close)."""


class _Blocked(Exception):
    """Orderly, policy block: the partition waits on a malformed entry; read it again from the
    pending entries after a backoff (it is gone once deleted or trimmed)."""

    def __init__(self, message: Message) -> None:
        super().__init__(message.offset)
        self.message = message


@dataclass
class ConsumerStats:
    handled: int = 0
    failures: int = 0
    retries: int = 0
    dead_letters: int = 0
    leases_acquired: int = 0
    leases_lost: int = 0
    fenced_acks: int = 0
    rebalances: int = 0
    malformed: int = 0  # malformed entries handed to the failure policy


class _Partition:
    """What this member holds for one partition: its lease and its place in the stream."""

    def __init__(self, number: int, lease: Lease | None, deadline: float) -> None:
        self.number = number
        self.lease = lease
        self.lease_value = lease.value if lease else ""
        self.deadline = deadline
        self.renew_due = 0.0
        self.revoked = False
        self.revoked_at = 0.0
        self.lost = False
        self.finished = threading.Event()
        self.claiming = True  # first take over the pending entries, then read new ones
        self.cursor = "0-0"
        self.unacked: list[str] = []
        self.unacked_since = 0.0
        self.outstanding: set[str] = set()  # poll mode: returned, not yet acked
        self.parked: set[bytes] = set()
        self.held: dict[bytes, list[Message]] = defaultdict(list)
        self.parked_refreshed = 0.0
        self.blocked_offset: str | None = None
        self.worker: threading.Thread | None = None
        self.lanes: ThreadPoolExecutor | None = None
        self.last_claim = 0.0
        self.retry_at = 0.0  # poll, orderly: blocked on a malformed entry until then


def _default_name() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:60]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


class Consumer:
    """A member of consumer group `group` of `topic`. Create it with `broker.consumer(...)`.

    Parameters (validated here, eagerly):
      name                member name, unique in the group (default: host-pid-random)
      mode                "orderly" (partition leases, offset order) or "concurrent"
      start               where a new group starts: "earliest" or "latest"
      lease_ttl_ms        lease time to live; renewed every lease_ttl_ms / 3
      session_timeout_ms  a member silent this long is dead (default: lease_ttl_ms)
      heartbeat_interval_ms  default min(lease_ttl_ms / 3, 3000)
      batch_size          entries per read
      key_concurrency     orderly: lanes per partition running different keys in parallel
      max_attempts        handler calls per message before the failure policy applies
      retry_backoff_ms, max_retry_backoff_ms   exponential backoff with jitter between attempts
      failure_policy      "dead_letter", "park_key" (orderly only) or "block"
      claim_idle_ms       concurrent: reclaim entries pending this long (default: lease_ttl_ms)
      block_ms            how long an idle partition waits for new entries per round
      ack_interval_ms     handled messages are acknowledged at least this often
      metadata_max_age_ms partitions added to the topic are read within this (as Kafka's
                          metadata.max.age.ms, shorter by default)
    """

    def __init__(
        self,
        broker: Broker,
        topic: str,
        group: str,
        name: str | None = None,
        *,
        mode: str = "orderly",
        start: str = "earliest",
        lease_ttl_ms: int = 30_000,
        session_timeout_ms: int | None = None,
        heartbeat_interval_ms: int | None = None,
        batch_size: int = 500,
        key_concurrency: int = 1,
        max_attempts: int = 5,
        retry_backoff_ms: int = 100,
        max_retry_backoff_ms: int = 30_000,
        failure_policy: str = "dead_letter",
        claim_idle_ms: int | None = None,
        block_ms: int = 300,
        ack_interval_ms: int = 100,
        metadata_max_age_ms: int = 5000,
    ) -> None:
        if mode not in MODES:
            raise InvalidConfig(f"mode={mode!r}: expected one of {MODES}")
        if start not in STARTS:
            raise InvalidConfig(f"start={start!r}: expected one of {STARTS}")
        if failure_policy not in POLICIES:
            raise InvalidConfig(f"failure_policy={failure_policy!r}: expected one of {POLICIES}")
        if failure_policy == "park_key" and mode != "orderly":
            raise InvalidConfig("failure_policy='park_key' needs mode='orderly'")
        check_int("lease_ttl_ms", lease_ttl_ms, 300, 3_600_000)
        session_timeout_ms = session_timeout_ms if session_timeout_ms is not None else lease_ttl_ms
        check_int("session_timeout_ms", session_timeout_ms, 300, 3_600_000)
        if heartbeat_interval_ms is None:
            heartbeat_interval_ms = min(lease_ttl_ms // 3, 3000)
        check_int("heartbeat_interval_ms", heartbeat_interval_ms, 50, session_timeout_ms // 2)
        check_int("batch_size", batch_size, 1, 10_000)
        check_int("key_concurrency", key_concurrency, 1, 256)
        if key_concurrency > 1 and mode != "orderly":
            raise InvalidConfig("key_concurrency needs mode='orderly'")
        check_int("max_attempts", max_attempts, 1)
        check_int("retry_backoff_ms", retry_backoff_ms, 0)
        check_int("max_retry_backoff_ms", max_retry_backoff_ms, retry_backoff_ms)
        claim_idle_ms = claim_idle_ms if claim_idle_ms is not None else lease_ttl_ms
        check_int("claim_idle_ms", claim_idle_ms, 100)
        check_int("block_ms", block_ms, 10, 10_000)
        check_int("ack_interval_ms", ack_interval_ms, 0)
        check_int("metadata_max_age_ms", metadata_max_age_ms, 100, 3_600_000)

        self.broker = broker
        self.topic = topic
        self.group = validate_name("group", group)
        self.name = validate_name("consumer", name) if name is not None else _default_name()
        self.mode = mode
        self.lease_ttl_ms = lease_ttl_ms
        self.batch_size = batch_size
        self.key_concurrency = key_concurrency
        self.max_attempts = max_attempts
        self.failure_policy = failure_policy
        self._retry_backoff_s = retry_backoff_ms / 1000
        self._max_retry_backoff_s = max_retry_backoff_ms / 1000
        self._claim_idle_ms = claim_idle_ms
        self._block_ms = block_ms
        self._ack_interval_s = ack_interval_ms / 1000
        self._heartbeat_s = heartbeat_interval_ms / 1000
        self._metadata_max_age_s = metadata_max_age_ms / 1000
        self._renew_s = lease_ttl_ms / 3000
        # Stop handling a partition this long before its lease deadline (when renewals fail).
        self._margin_s = lease_ttl_ms / 10000
        self._tick_s = min(0.1, self._renew_s / 3)

        self.stats = ConsumerStats()
        self._keys = broker.keys
        self._scripts = broker.scripts
        self._client = broker.client
        self._cluster = bool(getattr(broker, "is_cluster", False))
        self._partitions = broker.topic_config(topic).partitions  # TopicNotFound now
        self.membership = GroupMembership(
            broker,
            topic,
            self.group,
            self.name,
            mode=mode,
            start=start,
            policy=failure_policy,
            lease_ttl_ms=lease_ttl_ms,
            session_timeout_ms=session_timeout_ms,
        )
        # A dead-letter topic's name has a length limit that only deep nesting (a group on a
        # dead-letter topic of a dead-letter topic ...) can pass: block needs none.
        self._dead_letters: DeadLetterWriter | None = None
        try:
            self._dead_letters = DeadLetterWriter(broker, topic, self.group)
        except InvalidName:
            if failure_policy != "block":
                raise
        self._malformed_log = _RateLimitedLog(MALFORMED_LOG_INTERVAL_S)
        self._lock = threading.RLock()
        self._parts: dict[int, _Partition] = {}
        self._members: list[str] = []
        self._target: list[int] = []
        self._handler: Callable[[Message], Any] | None = None
        self._use: str | None = None  # "poll" or "run"
        self._stopping = threading.Event()  # partitions stop; the coordinator still renews
        self._coordinator_stop = threading.Event()
        self._wake = threading.Event()
        self._abandoned = False
        self._closed = False
        self._poll_cursor = 0
        self._last_handled = time.monotonic()

        if self.membership.join():
            log.info("created group %s on %s (%s, start=%s)", self.group, topic, mode, start)
        if mode == "concurrent":
            for p in range(self._partitions):
                self.membership.ensure_stream_group(p)
        self._members = self.membership.heartbeat()
        self._coordinator = threading.Thread(
            target=self._coordinate, name=f"redisq-consumer-{self.name}", daemon=True
        )
        self._coordinator.start()

    def __repr__(self) -> str:
        return (
            f"<redisq.Consumer topic={self.topic!r} group={self.group!r} name={self.name!r} "
            f"mode={self.mode!r}>"
        )

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ----------------------------------------------------------------------------
    @property
    def assignment(self) -> list[int]:
        """The partitions this member holds a lease on now (orderly) or reads (concurrent)."""
        with self._lock:
            return sorted(
                p for p, part in self._parts.items() if not part.lost and not part.revoked
            )

    @property
    def members(self) -> list[str]:
        return list(self._members)

    def idempotent(self, handler: Callable[[Message], Any], **options: Any) -> IdempotentHandler:
        """handler wrapped so that a redelivered message whose handling finished is skipped
        (scope: this group). See `redisq.idempotent.IdempotentHandler`."""
        return IdempotentHandler(self.broker, handler, scope=self.group, **options)

    def run(
        self,
        handler: Callable[[Message], Any],
        *,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_messages: int | None = None,
    ) -> int:
        """Call handler(message) for every message and ack it when it returns; a raise means
        retry (then the failure policy). Blocks until close() (from another thread or a signal
        handler), timeout seconds, idle_timeout seconds without a message, or max_messages
        handled; the consumer is closed when run() returns. Returns the messages handled."""
        self._start_use("run")
        self._handler = handler
        started = time.monotonic()
        handled_before = self.stats.handled
        self._last_handled = started
        with self._lock:
            for part in self._parts.values():
                self._start_worker(part)
        self._wake.set()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if timeout is not None and now - started >= timeout:
                    break
                if idle_timeout is not None and now - self._last_handled >= idle_timeout:
                    break
                if max_messages is not None and self.stats.handled - handled_before >= max_messages:
                    break
                self._stopping.wait(0.05)
        finally:
            self.close()
        return self.stats.handled - handled_before

    def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        """Messages from the partitions this member reads, each partition's in offset order.

        In orderly mode a partition gives no more messages until the ones it gave are acked, so
        a caller that handles and acks what it got keeps the one-at-a-time order. Waits up to
        timeout seconds for the first message."""
        self._start_use("poll")
        check_int("max_messages", max_messages, 1, 100_000)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            messages = self._poll_once(max_messages)
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0 or self._stopping.is_set():
                return messages
            time.sleep(min(0.02, remaining))

    def ack(self, *messages: Message | Iterable[Message]) -> int:
        """Acknowledge messages (one script call per partition). Orderly mode: LeaseLost if this
        member no longer holds a partition's lease; then nothing of that partition is acked."""
        flat: list[Message] = []
        for item in messages:
            if isinstance(item, Message):
                flat.append(item)
            else:
                flat.extend(item)
        by_partition: dict[int, list[str]] = defaultdict(list)
        for message in flat:
            if message.topic != self.topic:
                raise ValueError(f"message of topic {message.topic!r}, not {self.topic!r}")
            by_partition[message.partition].append(message.offset)
        acked = 0
        for p, offsets in by_partition.items():
            with self._lock:
                part = self._parts.get(p)
            if self.mode == "orderly" and (part is None or part.lost):
                self.stats.fenced_acks += 1
                raise LeaseLost(f"partition {p} of {self.topic!r} is not held by {self.name}")
            value = part.lease_value if part is not None else ""
            try:
                acked += self._ack_entries(p, value, offsets)
            except LeaseLost:
                self.stats.fenced_acks += 1
                if part is not None:
                    self._mark_lost(part)
                raise
            if part is not None:
                part.outstanding.difference_update(offsets)
                if part.revoked and not part.outstanding and self._use == "poll":
                    self._finish_partition(part)
        return acked

    def dead_letter(self, message: Message, error: BaseException | str, attempts: int = 0) -> None:
        """Move a message to the group's dead-letter topic and ack it (for poll() users)."""
        with self._lock:
            part = self._parts.get(message.partition)
        if self.mode == "orderly" and (part is None or part.lost):
            raise LeaseLost(f"partition {message.partition} is not held by {self.name}")
        if part is None:
            part = _Partition(message.partition, None, float("inf"))
        self._dead_letter(part, message, error, attempts or message.attempt, park=False)
        part.outstanding.discard(message.offset)

    def close(self, timeout: float | None = None) -> None:
        """Finish the messages in flight, ack them, release the leases and leave the group."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            parts = list(self._parts.values())
        for part in parts:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if part.worker is not None:
                part.worker.join(remaining)
            elif not self._abandoned:
                self._finish_partition(part)
        self._coordinator_stop.set()
        self._wake.set()
        self._coordinator.join(timeout)
        if not self._abandoned:
            try:
                self.membership.leave()
            except redis.RedisError as exc:
                log.warning("%s: could not leave the group: %s", self.name, exc)
        if self._dead_letters is not None:
            self._dead_letters.close()
        for partition, count in self._malformed_log.flush().items():
            log.error(
                "%s: %s/%d: %d more malformed entries since the last report",
                self.name,
                self.topic,
                partition,
                count,
            )

    # -- membership and leases (the coordinator thread) -----------------------------------------
    def _coordinate(self) -> None:
        """Heartbeats, assignment, lease acquire/renew/release; runs until close()."""
        next_beat = time.monotonic() + self._heartbeat_s
        next_metadata = time.monotonic() + self._metadata_max_age_s
        self._target = self._assignment()
        while not self._coordinator_stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_metadata and not self._stopping.is_set():
                    next_metadata = now + self._metadata_max_age_s
                    self._refresh_metadata()
                if now >= next_beat and not self._stopping.is_set():
                    next_beat = now + self._heartbeat_s
                    self._heartbeat()
                if self.mode == "orderly":
                    self._maintain_leases()
                else:
                    self._maintain_concurrent()
            except redis.RedisError as exc:
                log.warning("%s: coordinator: %s: %s", self.name, type(exc).__name__, exc)
            except Exception:  # pragma: no cover - keep the member alive; the lease is the guard
                log.exception("%s: coordinator error", self.name)
            self._wake.wait(self._tick_s)
            self._wake.clear()
        if not self._abandoned:
            with self._lock:
                parts = list(self._parts.values())
            for part in parts:
                if part.worker is None:
                    self._finish_partition(part)

    def _heartbeat(self) -> None:
        members = self.membership.heartbeat()
        if members != self._members:
            log.info("%s: members of %s/%s: %s", self.name, self.topic, self.group, members)
            self.stats.rebalances += 1
        self._members = members
        self._target = self._assignment()

    def _refresh_metadata(self) -> None:
        """Re-read the topic's partition count (every metadata_max_age_ms): a partition added
        by add_partitions is assigned, leased and read from the group's start position."""
        try:
            partitions = self.broker.topic_config(self.topic, refresh=True).partitions
        except TopicNotFound:
            log.warning("%s: topic %s no longer exists", self.name, self.topic)
            return
        if partitions != self._partitions:
            log.info(
                "%s: %s has %d partitions (was %d)",
                self.name,
                self.topic,
                partitions,
                self._partitions,
            )
            self._partitions = partitions
            self._target = self._assignment()

    def _assignment(self) -> list[int]:
        if self.mode == "concurrent":
            return list(range(self._partitions))
        return assign_partitions(self._partitions, self._members, self.name)

    def _maintain_leases(self) -> None:
        now = time.monotonic()
        target = set(self._target) if not self._stopping.is_set() else set()
        with self._lock:
            parts = list(self._parts.values())
        for part in parts:
            if part.finished.is_set():
                with self._lock:
                    if self._parts.get(part.number) is part:
                        del self._parts[part.number]
                continue
            if part.lost:
                continue
            if part.number not in target and not part.revoked:
                self._revoke(part)
            if part.revoked and part.worker is None and self._use != "run":
                # poll mode: release once the caller acked what it got, or after a lease ttl
                if not part.outstanding or now - part.revoked_at > self.lease_ttl_ms / 1000:
                    self._finish_partition(part)
                    continue
            if now >= part.renew_due:
                self._renew_lease(part)
        if self._stopping.is_set():
            return
        with self._lock:
            missing = [p for p in sorted(target) if p not in self._parts]
        for p in missing:
            self._acquire_lease(p)

    def _revoke(self, part: _Partition) -> None:
        """The partition moves to another member: finish the current message, ack, release."""
        if not self._stopping.is_set():
            log.info("%s: handing over partition %d", self.name, part.number)
        part.revoked = True
        part.revoked_at = time.monotonic()

    def _acquire_lease(self, partition: int) -> None:
        sent = time.monotonic()
        lease = self.membership.acquire_lease(partition)
        if lease is None:
            return
        part = _Partition(partition, lease, sent + self.lease_ttl_ms / 1000)
        part.renew_due = sent + self._renew_s
        self.stats.leases_acquired += 1
        log.info("%s: acquired partition %d (token %d)", self.name, partition, lease.token)
        with self._lock:
            self._parts[partition] = part
            if self._use == "run":
                self._start_worker(part)

    def _renew_lease(self, part: _Partition) -> None:
        assert part.lease is not None
        sent = time.monotonic()
        try:
            renewed = self.membership.renew_lease(part.lease)
        except redis.RedisError as exc:
            # Keep the deadline: the partition stops by itself if no renewal lands in time.
            part.renew_due = sent + self._tick_s
            log.warning("%s: renewing partition %d failed: %s", self.name, part.number, exc)
            return
        if renewed:
            part.deadline = sent + self.lease_ttl_ms / 1000
            part.renew_due = sent + self._renew_s
        else:
            log.warning("%s: lease on partition %d lost", self.name, part.number)
            self._mark_lost(part)

    def _mark_lost(self, part: _Partition) -> None:
        if not part.lost:
            part.lost = True
            self.stats.leases_lost += 1
        if part.worker is None:
            part.finished.set()
        self._wake.set()

    def _finish_partition(self, part: _Partition) -> None:
        """Ack what was handled and release the lease (explicitly: no ttl wait for the next)."""
        if part.finished.is_set():
            return
        try:
            if not self._abandoned:
                # Even when the lease looks lost, send the acks: Redis decides (a fenced ack
                # changes nothing), and a renewal that merely failed to arrive loses nothing.
                self._flush_acks(part)
                if (
                    not part.lost
                    and part.lease is not None
                    and self.membership.release_lease(part.lease)
                ):
                    log.info("%s: released partition %d", self.name, part.number)
        except LeaseLost:
            self.stats.fenced_acks += 1
            log.warning("%s: partition %d: acks refused, the lease is lost", self.name, part.number)
        except redis.RedisError as exc:
            log.warning("%s: releasing partition %d: %s", self.name, part.number, exc)
        finally:
            part.finished.set()
            self._wake.set()

    def _maintain_concurrent(self) -> None:
        """Concurrent mode holds no leases: every partition is read (by run() workers)."""
        if self._stopping.is_set():
            return
        with self._lock:
            missing = [p for p in range(self._partitions) if p not in self._parts]
        for p in missing:
            self.membership.ensure_stream_group(p)
            part = _Partition(p, None, float("inf"))
            with self._lock:
                self._parts[p] = part
                if self._use == "run":
                    self._start_worker(part)

    # -- reading and acking (one Redis idea each) -----------------------------------------------
    def _decode(
        self, partition: int, entries: list[Any], deliveries: list[Any] | None = None
    ) -> list[Message]:
        """records.decode_entries: malformed entries come back as MalformedMessage in place."""
        return decode_entries(self.topic, partition, entries, deliveries)

    def _claim_pending(self, part: _Partition, count: int, min_idle_ms: int = 0) -> list[Message]:
        """XAUTOCLAIM the partition's pending entries (the previous owner's, and ours from before a
        restart) to this member, from part.cursor on, in offset order."""
        cursor, entries, deliveries = self._scripts.call(
            "claim_pending",
            [self._keys.log(self.topic, part.number), self._lease_key(part.number)],
            [self.group, self.name, part.lease_value, part.cursor, count, min_idle_ms],
            topic=self.topic,
        )
        part.cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        if part.cursor == "0-0":
            part.claiming = False
        return self._decode(part.number, entries, deliveries)

    def _read_new_entries(self, part: _Partition, count: int) -> tuple[list[Message], str]:
        """Ack part.unacked and XREADGROUP ">" in one fenced step; returns the messages, or none
        and the stream's last ID to wait from.

        Standalone servers: WATCH the lease key, GET it, then MULTI / XACK / XREADGROUP /
        XREVRANGE / EXEC on one connection. Redis aborts the EXEC if the lease key was written
        (a new grant, a release, our own renewal) or expired after the WATCH, so a fenced member
        neither acks nor pulls entries into its pending list; the entries come back as native
        RESP, without the Lua table round trip of read_partition.lua (about 4x the server time
        per entry). Clusters keep the script (one slot either way)."""
        if self._cluster:
            return self._read_new_entries_script(part, count)
        stream = self._keys.log(self.topic, part.number)
        lease = self._lease_key(part.number)
        ack_ids = part.unacked[:MAX_IDS_PER_CALL]
        tx: list[tuple[Any, ...]] = [("MULTI",)]
        if ack_ids:
            tx.append(("XACK", stream, self.group, *ack_ids))
        tx.append(
            ("XREADGROUP", "GROUP", self.group, self.name, "COUNT", count, "STREAMS", stream, ">")
        )
        tx.append(("XREVRANGE", stream, "+", "-", "COUNT", 1))
        tx.append(("EXEC",))
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            packed_tx = conn.pack_commands(tx)
            packed_watch = conn.pack_commands([("WATCH", lease), ("GET", lease)])
            for _ in range(10):
                conn.send_packed_command(packed_watch)
                conn.read_response()
                holder = conn.read_response()
                if isinstance(holder, bytes):
                    holder = holder.decode()
                if holder != part.lease_value:
                    raise LeaseLost(
                        f"topic {self.topic!r} partition lease is held by another grant"
                    )
                conn.send_packed_command(packed_tx)
                for _ in range(len(tx)):
                    result = conn.read_response()
                if result is not None:
                    break
                # The lease key changed after WATCH (our renewal, or a new grant): check again.
            else:
                pool.release(conn)
                return [], ""
        except BaseException:
            conn.disconnect()  # drops any WATCH/MULTI state with the connection
            pool.release(conn)
            raise
        pool.release(conn)
        for item in result:
            if isinstance(item, Exception):
                raise item
        del part.unacked[: len(ack_ids)]
        entries = _stream_entries(result[-2])
        if entries:
            return self._decode(part.number, entries), ""
        last = result[-1]
        tail = last[0][0] if last else "0-0"
        return [], tail.decode() if isinstance(tail, bytes) else str(tail)

    def _read_new_entries_script(self, part: _Partition, count: int) -> tuple[list[Message], str]:
        """read_partition.lua: the fenced ack + read as one script call (clusters)."""
        ack_ids = part.unacked[:MAX_IDS_PER_CALL]
        _acked, tail, entries = self._scripts.call(
            "read_partition",
            [self._keys.log(self.topic, part.number), self._lease_key(part.number)],
            [self.group, self.name, part.lease_value, count, *ack_ids],
            topic=self.topic,
        )
        del part.unacked[: len(ack_ids)]
        return self._decode(part.number, entries), tail.decode() if isinstance(
            tail, bytes
        ) else tail

    def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send commands in one write on a pooled connection and read their raw replies (no
        response callbacks: entries stay flat lists for _decode). Error replies are raised."""
        if self._cluster:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            replies = [conn.read_response() for _ in commands]
        except BaseException:
            conn.disconnect()  # replies may be left unread
            pool.release(conn)
            raise
        pool.release(conn)
        return replies

    def _ack_entries(self, partition: int, lease_value: str, offsets: list[str]) -> int:
        acked = 0
        stream = self._keys.log(self.topic, partition)
        lease = self._lease_key(partition)
        for start in range(0, len(offsets), MAX_IDS_PER_CALL):
            chunk = offsets[start : start + MAX_IDS_PER_CALL]
            acked += int(
                self._scripts.call(
                    "ack", [stream, lease], [self.group, lease_value, *chunk], topic=self.topic
                )
            )
        return acked

    def _flush_acks(self, part: _Partition) -> None:
        if part.unacked:
            ids = part.unacked
            part.unacked = []
            self._ack_entries(part.number, part.lease_value, ids)

    def _wait_for_entries(self, part: _Partition, tail: str) -> None:
        """XREAD BLOCK from the stream's last ID: returns when something new is appended (the
        next fenced read takes it), or after block_ms."""
        block_ms = self._block_ms
        if part.lease is not None:
            left_ms = int((part.deadline - self._margin_s - time.monotonic()) * 1000)
            block_ms = max(10, min(block_ms, left_ms))
        self._client.xread(
            {self._keys.log(self.topic, part.number): tail or "$"}, count=1, block=block_ms
        )

    def _lease_key(self, partition: int) -> str:
        return self._keys.lease(self.topic, partition, self.group)

    # -- poll -------------------------------------------------------------------------------------
    def _start_use(self, use: str) -> None:
        if self._closed:
            raise ConsumerClosed(f"{use}() after close()")
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise InvalidConfig(f"this consumer already uses {self._use}(); it cannot {use}() too")

    def _may_handle(self, part: _Partition) -> bool:
        return (
            not part.revoked
            and not part.lost
            and not self._stopping.is_set()
            and time.monotonic() < part.deadline - self._margin_s
        )

    def _poll_once(self, max_messages: int) -> list[Message]:
        with self._lock:
            parts = [self._parts[p] for p in sorted(self._parts)]
        if not parts:
            return []
        self._poll_cursor = (self._poll_cursor + 1) % len(parts)
        parts = parts[self._poll_cursor :] + parts[: self._poll_cursor]
        result: list[Message] = []
        for part in parts:
            room = max_messages - len(result)
            if room <= 0:
                break
            if not self._may_handle(part) or (self.mode == "orderly" and part.outstanding):
                continue
            if part.retry_at and time.monotonic() < part.retry_at:
                continue  # blocked on a malformed entry: not yet time to look again
            try:
                messages = self._screen_malformed(part, self._fetch(part, room))
            except LeaseLost:
                self._mark_lost(part)
                continue
            part.outstanding.update(m.offset for m in messages)
            result.extend(messages)
        return result

    def _fetch(self, part: _Partition, count: int) -> list[Message]:
        """The next messages of a partition: pending ones first (orderly), then new ones."""
        if self.mode == "orderly":
            while part.claiming:
                messages = self._claim_pending(part, count)
                if messages:
                    return messages
            return self._read_new_entries(part, count)[0]
        now = time.monotonic()
        if now - part.last_claim >= self._claim_idle_ms / 2000:
            part.last_claim = now
            part.cursor = "0-0"
            messages = self._claim_pending(part, count, self._claim_idle_ms)
            if messages:
                return messages
        reply = self._client.xreadgroup(
            self.group, self.name, {self._keys.log(self.topic, part.number): ">"}, count=count
        )
        return self._decode(part.number, reply[0][1]) if reply else []

    # -- run: one worker thread per partition -----------------------------------------------------
    def _start_worker(self, part: _Partition) -> None:
        if part.worker is not None or part.finished.is_set():
            return
        target = self._work_orderly if self.mode == "orderly" else self._work_concurrent
        part.worker = threading.Thread(
            target=target, args=(part,), name=f"redisq-{self.topic}-{part.number}", daemon=True
        )
        part.worker.start()

    def _work_orderly(self, part: _Partition) -> None:
        """Own one partition: pending entries first, then new ones; stop when revoked, when the
        lease is lost or near its deadline, or on close."""
        try:
            self._load_parked(part)
            while self._may_handle(part):
                try:
                    if part.claiming:
                        if part.cursor == "0-0":
                            part.held.clear()  # the claim hands every held entry back, in order
                        messages = self._claim_pending(part, self.batch_size)
                        self._handle_batch(part, messages)
                        self._flush_acks(part)
                        continue
                    released = self._release_unparked(part)
                    if released:
                        self._handle_batch(part, released)
                        continue
                    messages, tail = self._read_new_entries(part, self.batch_size)
                    if messages:
                        self._handle_batch(part, messages)
                    elif self._may_handle(part):
                        self._wait_for_entries(part, tail)
                except _Blocked as blocked:
                    # Ack what came before it, wait, then read the pending entries again from
                    # it: an operator's XDEL (or retention) removes it from them.
                    self._flush_acks(part)
                    self._sleep_while_owned(part, self._backoff(blocked.message.attempt))
                    part.claiming, part.cursor = True, "0-0"
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # A read may have run without its answer reaching us: its entries sit in our
                    # pending list, so take the pending entries again before reading new ones.
                    log.warning("%s: partition %d: %s; retrying", self.name, part.number, exc)
                    part.claiming, part.cursor = True, "0-0"
                    time.sleep(0.2)
        except _Stop:
            pass
        except LeaseLost:
            log.warning("%s: partition %d: lease lost; stopping", self.name, part.number)
            self.stats.fenced_acks += 1
            self._mark_lost(part)
        except Exception:
            log.exception("%s: partition %d worker failed", self.name, part.number)
        finally:
            if part.lanes is not None:
                part.lanes.shutdown(wait=True)
            self._finish_partition(part)

    def _work_concurrent(self, part: _Partition) -> None:
        """Competing consumption of one partition: reclaim idle entries now and then, else read
        new ones (XACK of the previous batch and XREADGROUP BLOCK in one round trip)."""
        stream = self._keys.log(self.topic, part.number)
        read = (
            "XREADGROUP", "GROUP", self.group, self.name, "COUNT", self.batch_size,
            "BLOCK", self._block_ms, "STREAMS", stream, ">",
        )  # fmt: skip
        while not self._stopping.is_set():
            try:
                now = time.monotonic()
                if now - part.last_claim >= self._claim_idle_ms / 2000:
                    part.last_claim = now
                    part.cursor = "0-0"
                    claimed = self._claim_pending(part, self.batch_size, self._claim_idle_ms)
                    if claimed:
                        log.info(
                            "%s: reclaimed %d idle entries of partition %d",
                            self.name,
                            len(claimed),
                            part.number,
                        )
                        self._handle_batch(part, claimed)
                        continue
                ids = part.unacked[:MAX_IDS_PER_CALL]
                commands: list[tuple[Any, ...]] = [read]
                if ids:
                    commands.insert(0, ("XACK", stream, self.group, *ids))
                replies = self._exchange(commands)
                del part.unacked[: len(ids)]
                entries = _stream_entries(replies[-1])
                if entries:
                    self._handle_batch(part, self._decode(part.number, entries))
            except _Stop:
                break
            except redis.RedisError as exc:
                log.warning("%s: partition %d: %s; retrying", self.name, part.number, exc)
                time.sleep(0.2)
            except Exception:
                log.exception("%s: partition %d worker failed", self.name, part.number)
                time.sleep(0.2)
        try:
            if not self._abandoned:
                self._flush_acks(part)
        except redis.RedisError as exc:
            log.warning("%s: partition %d: final ack failed: %s", self.name, part.number, exc)
        part.finished.set()

    def _handle_batch(self, part: _Partition, messages: list[Message]) -> None:
        if self.key_concurrency > 1 and len(messages) > 1:
            self._handle_in_lanes(part, messages)
            return
        # The one-lane hot path: per message one clock read, the ownership check, the handler
        # and an append; acks go out with the next read, or when ack_interval has passed.
        handler = self._handler
        assert handler is not None
        stopping = self._stopping
        unacked = part.unacked
        limit = part.deadline - self._margin_s
        handled = 0
        blocked = False
        try:
            for message in messages:
                now = time.monotonic()
                if now >= limit:
                    limit = part.deadline - self._margin_s  # the coordinator may have renewed
                    if now >= limit:
                        raise _Stop
                if part.revoked or part.lost or stopping.is_set():
                    raise _Stop
                if part.parked and message.key in part.parked:
                    part.held[message.key].append(message)  # pending until the key is released
                    continue
                if message.__class__ is MalformedMessage:
                    if self._on_malformed(part, message, park=True) or self.mode != "orderly":
                        continue  # dead-lettered (acked by the script), or left pending
                    blocked = True
                    raise _Blocked(message)
                try:
                    handler(message)
                except Exception as exc:
                    if not self._handle_failure(part, message, exc):
                        continue  # dead-lettered: acked by the dead_letter script
                if not unacked:
                    part.unacked_since = now
                unacked.append(message.offset)
                handled += 1
                if (
                    len(unacked) >= MAX_IDS_PER_CALL
                    or now - part.unacked_since >= self._ack_interval_s
                ):
                    self._flush_acks(part)
                    unacked = part.unacked
        finally:
            if handled:
                self.stats.handled += handled
                self._last_handled = time.monotonic()
                if part.blocked_offset is not None and not blocked:
                    self._clear_blocked(part)

    def _handle_in_lanes(self, part: _Partition, messages: list[Message]) -> None:
        """key_concurrency lanes: a key always maps to the same lane, so each key stays in order
        while different keys of the partition run in parallel. Keyless messages spread out."""
        lanes: list[list[Message]] = [[] for _ in range(self.key_concurrency)]
        for i, message in enumerate(messages):
            lane = zlib.crc32(message.key) if message.key is not None else i
            lanes[lane % self.key_concurrency].append(message)
        if part.lanes is None:
            part.lanes = ThreadPoolExecutor(self.key_concurrency, thread_name_prefix="redisq-lane")

        def run_lane(batch: list[Message]) -> None:
            for message in batch:
                if not self._may_handle(part):
                    raise _Stop
                self._handle_message(part, message)

        futures = [part.lanes.submit(run_lane, lane) for lane in lanes if lane]
        stop: BaseException | None = None
        for future in futures:
            error = future.exception()
            if error is not None and stop is None:
                stop = error
        if stop is not None:
            raise stop

    def _handle_message(self, part: _Partition, message: Message) -> None:
        """One message in a key_concurrency lane: handler, then queue its ack (under the lock:
        lanes share the partition's ack list)."""
        if message.key is not None and message.key in part.parked:
            with self._lock:
                part.held[message.key].append(message)
            return
        if message.__class__ is MalformedMessage:
            if not self._on_malformed(part, message, park=True):
                raise _Blocked(message)  # lanes are orderly only
            return
        handler = self._handler
        assert handler is not None
        try:
            handler(message)
        except Exception as exc:
            if not self._handle_failure(part, message, exc):
                return
        self.stats.handled += 1
        self._last_handled = time.monotonic()
        with self._lock:
            if not part.unacked:
                part.unacked_since = time.monotonic()
            part.unacked.append(message.offset)

    def _handle_failure(self, part: _Partition, message: Message, error: Exception) -> bool:
        """Retry with backoff until the handler succeeds (True: ack it) or max_attempts is
        reached and the policy dead-letters it (False: already acked by the dead_letter script).
        Policy block retries forever, showing the message as blocked."""
        handler = self._handler
        assert handler is not None
        attempt = message.attempt
        while True:
            self.stats.failures += 1
            if attempt >= self.max_attempts and self.failure_policy != "block":
                self._dead_letter(
                    part, message, error, attempt, park=self.failure_policy == "park_key"
                )
                return False
            if attempt >= self.max_attempts:
                self._mark_blocked(part, message, error, attempt)
            delay = self._backoff(attempt)
            log.warning(
                "%s: %s/%d@%s attempt %d failed (%s: %s); retrying in %.2fs",
                self.name,
                self.topic,
                part.number,
                message.offset,
                attempt,
                type(error).__name__,
                error,
                delay,
            )
            self._sleep_while_owned(part, delay)
            attempt += 1
            self.stats.retries += 1
            message = replace(message, attempt=attempt)
            try:
                handler(message)
            except Exception as exc:
                error = exc
                continue
            if part.blocked_offset is not None:
                self._clear_blocked(part)
            return True

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with equal jitter: half fixed, half random."""
        delay = min(self._max_retry_backoff_s, self._retry_backoff_s * (2 ** (attempt - 1)))
        return delay / 2 + random.uniform(0, delay / 2)

    def _sleep_while_owned(self, part: _Partition, delay: float) -> None:
        end = time.monotonic() + delay
        while True:
            if self.mode == "orderly" and not self._may_handle(part):
                raise _Stop
            if self.mode == "concurrent" and self._stopping.is_set():
                raise _Stop
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    # -- failure policies -------------------------------------------------------------------------
    def _dead_letter(
        self,
        part: _Partition,
        message: Message,
        error: BaseException | str,
        attempts: int,
        *,
        park: bool,
    ) -> None:
        """Copy to the dead-letter topic, then (fenced) ack, count, and park the key if asked."""
        # None only when the name is past its limit: building it again raises InvalidName.
        writer = self._dead_letters or DeadLetterWriter(self.broker, self.topic, self.group)
        writer.write(message, error, attempts)
        park_key = message.key if park and message.key else b""
        acked = self._scripts.call(
            "dead_letter",
            [
                self._keys.log(self.topic, part.number),
                self._lease_key(part.number),
                self._keys.group_partition_state(self.topic, part.number, self.group),
                self._keys.parked_keys(self.topic, part.number, self.group),
            ],
            [self.group, part.lease_value, message.offset, park_key],
            topic=self.topic,
        )
        part.blocked_offset = None
        self.stats.dead_letters += 1
        if park_key:
            part.parked.add(park_key)
        if isinstance(message, MalformedMessage):
            if acked:
                # Not in dead_letter.lua (another engineer's file): a crash right here loses
                # one count, never a message.
                self._client.hincrby(
                    self._keys.group_partition_state(self.topic, part.number, self.group),
                    "malformed",
                    1,
                )
            parked = " (key parked)" if park_key else ""
            self._note_malformed(part, message, f"dead-lettered to {writer.topic}{parked}")
            return
        log.error(
            "%s: %s/%d@%s dead-lettered to %s after %d attempts%s: %s",
            self.name,
            self.topic,
            part.number,
            message.offset,
            writer.topic,
            attempts,
            " (key parked)" if park_key else "",
            error,
        )

    # -- malformed entries -------------------------------------------------------------------------
    def _on_malformed(self, part: _Partition, message: MalformedMessage, *, park: bool) -> bool:
        """Hand a malformed entry to the failure policy (it never reaches the handler: it is
        not a message). True: dead-lettered and acked by the dead_letter script, go on. False:
        policy block; orderly, the partition waits on it; concurrent, it stays pending and is
        retried when reclaimed (nothing waits in concurrent mode)."""
        if self.failure_policy != "block":
            self.stats.malformed += 1
            park = park and self.failure_policy == "park_key"
            self._dead_letter(part, message, message.error(), message.attempt, park=park)
            return True
        if self.mode != "orderly":
            self.stats.malformed += 1
            self._note_malformed(part, message, "left pending (policy block)")
            return False
        if part.blocked_offset != message.offset:
            self.stats.malformed += 1
            self._note_malformed(part, message, "blocking the partition until it is deleted")
        self._mark_blocked(part, message, message.error(), message.attempt)
        return False

    def _screen_malformed(self, part: _Partition, messages: list[Message]) -> list[Message]:
        """poll(): the messages without the malformed entries, each handed to the policy in
        offset order. Orderly, policy block: only those before it; the rest stay pending and
        are read again from it after a backoff (part.retry_at)."""
        part.retry_at = 0.0
        if not any(m.__class__ is MalformedMessage for m in messages):
            if messages and part.blocked_offset is not None:
                self._clear_blocked(part)  # the entry it waited on was deleted
            return messages
        kept: list[Message] = []
        for message in messages:
            if not isinstance(message, MalformedMessage):
                kept.append(message)
            elif not self._on_malformed(part, message, park=False) and self.mode == "orderly":
                part.retry_at = time.monotonic() + self._backoff(message.attempt)
                part.claiming, part.cursor = True, "0-0"
                break
        return kept

    def _note_malformed(self, part: _Partition, message: MalformedMessage, outcome: str) -> None:
        """One log line per partition per MALFORMED_LOG_INTERVAL_S at most, with a count: a
        stream full of foreign entries must not flood the log."""
        count = self._malformed_log.note(part.number)
        if count is not None:
            log.error(
                "%s: %s/%d: %d malformed entr%s %s; the last at %s: %s",
                self.name,
                self.topic,
                part.number,
                count,
                "y" if count == 1 else "ies",
                outcome,
                message.offset,
                message.reason,
            )

    def _mark_blocked(
        self, part: _Partition, message: Message, error: Exception, attempts: int
    ) -> None:
        """Policy block: the partition waits on this message; describe/lag show it."""
        part.blocked_offset = message.offset
        try:
            self._client.hset(
                self._keys.group_partition_state(self.topic, part.number, self.group),
                mapping={
                    "blocked_offset": message.offset,
                    "blocked_error": f"{type(error).__name__}: {error}"[:500],
                    "blocked_attempts": attempts,
                },
            )
        except redis.RedisError as exc:
            log.warning("%s: could not record the blocked message: %s", self.name, exc)

    def _clear_blocked(self, part: _Partition) -> None:
        part.blocked_offset = None
        try:
            self._client.hdel(
                self._keys.group_partition_state(self.topic, part.number, self.group),
                "blocked_offset",
                "blocked_error",
                "blocked_attempts",
            )
        except redis.RedisError:
            pass

    def _load_parked(self, part: _Partition) -> None:
        if self.failure_policy != "park_key":
            return
        raw = self._client.hkeys(self._keys.parked_keys(self.topic, part.number, self.group))
        part.parked = set(raw)
        part.parked_refreshed = time.monotonic()

    def _release_unparked(self, part: _Partition) -> list[Message]:
        """Held messages of keys released since (checked once a second while anything is held),
        in offset order."""
        if not part.held or time.monotonic() - part.parked_refreshed < 1.0:
            return []
        self._load_parked(part)
        released: list[Message] = []
        for key in [k for k in part.held if k not in part.parked]:
            released.extend(part.held.pop(key))
        released.sort(key=lambda m: offset_parts(m.offset))
        if released:
            log.info(
                "%s: partition %d: %d held messages released", self.name, part.number, len(released)
            )
        return released

    # -- testing and demos ------------------------------------------------------------------------
    def _simulate_crash(self) -> None:
        """Stop every thread as a crash would: no ack, no lease release, no leave."""
        self._abandoned = True
        self._stopping.set()
        self._coordinator_stop.set()
        self._wake.set()
        with self._lock:
            parts = list(self._parts.values())
        for part in parts:
            part.lost = True
        for part in parts:
            if part.worker is not None:
                part.worker.join(5)
        self._coordinator.join(5)
        self._closed = True


class _RateLimitedLog:
    """Counts events per partition and says when to report them: at most once per interval."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self._unreported: dict[int, int] = {}

    def note(self, partition: int) -> int | None:
        """Count one; the number to report now (this one and those held back), or None."""
        with self._lock:
            count = self._unreported.get(partition, 0) + 1
            now = time.monotonic()
            last = self._last.get(partition)
            if last is not None and now - last < self._interval_s:
                self._unreported[partition] = count
                return None
            self._last[partition] = now
            self._unreported[partition] = 0
            return count

    def flush(self) -> dict[int, int]:
        """The counts held back, reset."""
        with self._lock:
            held = {p: n for p, n in self._unreported.items() if n}
            self._unreported.clear()
            return held


def _stream_entries(reply: Any) -> list[Any]:
    """The entries of a raw XREADGROUP reply for one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values())) or []
    return reply[0][1] or []
