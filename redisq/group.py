"""Consumer-group membership, partition assignment, partition leases, and what a group looks like.

Membership: every member heartbeats into the group's registry (a zset scored by server time); a
member silent for session_timeout_ms is dead. Every member sorts the live members and computes
the same assignment (RocketMQ's averaging), so no coordinator process exists.

Leases: one per (group, partition), a string set NX with a PX ttl whose value carries a fencing
token bumped on every grant. The assignment only says who *should* own a partition; the lease
says who *does*, and Redis checks it on every read and ack of that partition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from redisq.errors import InvalidName, TopicNotFound
from redisq.keys import dead_letter_topic, validate_name, validate_topic

if TYPE_CHECKING:
    from redisq.broker import Broker

log = logging.getLogger("redisq.group")

MODES = ("orderly", "concurrent")
STARTS = ("earliest", "latest")


def assign_partitions(partitions: int, members: Sequence[str], member: str) -> list[int]:
    """The partitions `member` should own: contiguous ranges over the sorted live members, the
    first `partitions % len(members)` members taking one extra (AllocateMessageQueueAveragely).

    Every member computes this from the same sorted list and gets the same answer.
    """
    ordered = sorted(set(members))
    if member not in ordered or partitions <= 0:
        return []
    index = ordered.index(member)
    count = len(ordered)
    base, extra = divmod(partitions, count)
    size = base + (1 if index < extra else 0)
    start = index * base + min(index, extra)
    return list(range(start, start + size))


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: the whole value is the fencing token the scripts compare."""

    partition: int
    value: str

    @property
    def token(self) -> int:
        return int(self.value.split(":", 1)[0])


def parse_lease(value: bytes | str | None) -> tuple[int, str, int] | None:
    """(token, member, granted_ms) of a lease value, or None."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    token, member, granted = text.split(":", 2)
    return int(token), member, int(granted)


class GroupMembership:
    """Join, heartbeat, leave; and the lease operations of one member of one group."""

    def __init__(
        self,
        broker: Broker,
        topic: str,
        group: str,
        member: str,
        *,
        mode: str,
        start: str,
        policy: str,
        lease_ttl_ms: int,
        session_timeout_ms: int,
    ) -> None:
        self.broker = broker
        self.topic = validate_topic(topic)
        self.group = validate_name("group", group)
        self.member = validate_name("consumer", member)
        self.mode = mode
        self.start = start
        self.policy = policy
        self.lease_ttl_ms = lease_ttl_ms
        self.session_timeout_ms = session_timeout_ms
        self.start_id = "0"
        self._keys = broker.keys
        self._scripts = broker.scripts

    # -- membership ----------------------------------------------------------------------------
    def join(self) -> bool:
        """Register the group (first member fixes mode and start) and this member. True if the
        group was created now."""
        keys = self._keys
        created, start_id, _now = self._scripts.call(
            "join_group",
            [
                keys.groups(self.topic),
                keys.group_meta(self.topic, self.group),
                keys.group_members(self.topic, self.group),
            ],
            [self.group, self.mode, self.start, self.member, self.policy],
            topic=self.topic,
        )
        self.start_id = start_id.decode() if isinstance(start_id, bytes) else str(start_id)
        return bool(created)

    def heartbeat(self) -> list[str]:
        """Beat, and answer the sorted live members (server clock)."""
        reply = self._scripts.call(
            "heartbeat",
            [self._keys.group_members(self.topic, self.group)],
            [self.member, self.session_timeout_ms, "beat"],
            topic=self.topic,
        )
        return sorted(m.decode() for m in reply[1:])

    def leave(self) -> None:
        self._scripts.call(
            "heartbeat",
            [self._keys.group_members(self.topic, self.group)],
            [self.member, self.session_timeout_ms, "leave"],
            topic=self.topic,
        )

    # -- leases ----------------------------------------------------------------------------------
    def _lease_key(self, partition: int) -> str:
        return self._keys.lease(self.topic, partition, self.group)

    def acquire_lease(self, partition: int) -> Lease | None:
        """SET NX PX with a fresh fencing token; None while another member holds it. Also creates
        the Redis consumer group on the stream at the group's start position if it is missing."""
        keys = self._keys
        granted, value = self._scripts.call(
            "acquire_lease",
            [
                self._lease_key(partition),
                keys.lease_fence(self.topic, partition, self.group),
                keys.log(self.topic, partition),
            ],
            [self.group, self.member, self.lease_ttl_ms, self.start_id],
            topic=self.topic,
        )
        if not granted:
            return None
        return Lease(partition, value.decode() if isinstance(value, bytes) else value)

    def renew_lease(self, lease: Lease) -> bool:
        """PEXPIRE while the value is still ours (extend_lease.lua); False means lost."""
        return bool(
            self._scripts.call(
                "extend_lease",
                [self._lease_key(lease.partition)],
                [lease.value, self.lease_ttl_ms],
                topic=self.topic,
            )
        )

    def release_lease(self, lease: Lease) -> bool:
        """DEL while the value is still ours, so the next owner need not wait for the ttl."""
        return bool(
            self._scripts.call(
                "release_lease",
                [self._lease_key(lease.partition)],
                [lease.value],
                topic=self.topic,
            )
        )

    def ensure_stream_group(self, partition: int) -> None:
        """Concurrent mode takes no leases: create the Redis consumer group directly."""
        self._scripts.call(
            "create_group",
            [self._keys.log(self.topic, partition)],
            [self.group, self.start_id],
            topic=self.topic,
        )


# -- observability -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemberInfo:
    name: str
    last_heartbeat_age_ms: int


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition as a group sees it (XINFO GROUPS + lease + dead-letter state).

    dead_letters counts every message the group dead-lettered from this partition; malformed
    counts those of them that were malformed entries (not redisq messages: records.py). A
    malformed entry held by policy block shows as blocked_offset, its blocked_error starting
    with "MalformedEntry"."""

    partition: int
    length: int
    last_offset: str | None
    last_delivered: str | None
    entries_read: int | None
    lag: int | None
    pending: int
    owner: str | None
    lease_token: int | None
    lease_age_ms: int | None
    lease_ttl_ms: int | None
    dead_letters: int
    parked_keys: int
    blocked_offset: str | None = None
    blocked_error: str | None = None
    blocked_attempts: int | None = None
    malformed: int = 0


@dataclass(frozen=True, slots=True)
class GroupDescription:
    topic: str
    group: str
    mode: str | None
    start: str | None
    policy: str | None
    created_ms: int | None
    members: list[MemberInfo] = field(default_factory=list)
    partitions: list[PartitionLag] = field(default_factory=list)
    dead_letter_topic: str = ""
    dead_letter_messages: int = 0

    @property
    def total_lag(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if any(lag is None for lag in lags) else sum(lag or 0 for lag in lags)

    @property
    def total_pending(self) -> int:
        return sum(p.pending for p in self.partitions)

    @property
    def total_malformed(self) -> int:
        return sum(p.malformed for p in self.partitions)


def list_groups(broker: Broker, topic: str | None = None) -> list[tuple[str, str]]:
    """(topic, group) pairs, sorted."""
    topics = [topic] if topic is not None else broker.list_topics()
    pairs = []
    for name in topics:
        for group in broker.client.smembers(broker.keys.groups(name)):
            pairs.append((name, group.decode()))
    return sorted(pairs)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _count_after(broker: Broker, key: str, last_delivered: str | None, cap: int = 100_000) -> int:
    """Entries after last_delivered (when Redis cannot tell the lag), counted up to cap."""
    start = "(" + last_delivered if last_delivered and last_delivered != "0-0" else "-"
    count = 0
    while count < cap:
        entries = broker.client.xrange(key, min=start, max="+", count=1000)
        count += len(entries)
        if len(entries) < 1000:
            break
        start = "(" + entries[-1][0].decode()
    return count


def describe_group(broker: Broker, topic: str, group: str) -> GroupDescription:
    """Members, and per partition: lag, entries-read, pending, owner, lease age, dead letters
    (and how many were malformed entries), parked keys and a blocked (poison) message, if any."""
    validate_name("group", group)
    keys = broker.keys
    client = broker.client
    meta = {
        k.decode(): v.decode() for k, v in client.hgetall(keys.group_meta(topic, group)).items()
    }
    config = broker.topic_config(topic, refresh=True)
    now_s, now_us = client.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    members = [
        MemberInfo(name.decode(), now_ms - int(score))
        for name, score in client.zrange(keys.group_members(topic, group), 0, -1, withscores=True)
    ]
    partitions = []
    for p in range(config.partitions):
        stream = keys.log(topic, p)
        info = client.xinfo_stream(stream)
        last = info.get("last-entry")
        groups = {(_text(g.get("name")) or ""): g for g in client.xinfo_groups(stream)}
        entry = groups.get(group)
        lease_value = client.get(keys.lease(topic, p, group))
        lease_ttl = client.pttl(keys.lease(topic, p, group)) if lease_value else None
        lease = parse_lease(lease_value)
        state = {
            k.decode(): v.decode()
            for k, v in client.hgetall(keys.group_partition_state(topic, p, group)).items()
        }
        parked = int(client.hlen(keys.parked_keys(topic, p, group)))
        last_delivered = _text(entry.get("last-delivered-id")) if entry else None
        lag = entry.get("lag") if entry else None
        if entry is not None and lag is None:
            lag = _count_after(broker, stream, last_delivered)
        entries_read = entry.get("entries-read") if entry else None
        partitions.append(
            PartitionLag(
                partition=p,
                length=int(info.get("length", 0)),
                last_offset=_text(last[0]) if last else None,
                last_delivered=last_delivered,
                entries_read=int(entries_read) if entries_read is not None else None,
                lag=int(lag)
                if lag is not None
                else (int(info.get("length", 0)) if not entry else None),
                pending=int(entry.get("pending", 0)) if entry else 0,
                owner=lease[1] if lease else None,
                lease_token=lease[0] if lease else None,
                lease_age_ms=now_ms - lease[2] if lease else None,
                lease_ttl_ms=int(lease_ttl) if lease_ttl is not None and lease_ttl >= 0 else None,
                dead_letters=int(state.get("dead_letters", 0)),
                parked_keys=parked,
                blocked_offset=state.get("blocked_offset"),
                blocked_error=state.get("blocked_error"),
                blocked_attempts=int(state["blocked_attempts"])
                if "blocked_attempts" in state
                else None,
                malformed=int(state.get("malformed", 0)),
            )
        )
    try:
        dlq = dead_letter_topic(topic, group)
    except InvalidName:  # past the length limit (deeply nested): this group cannot have one
        dlq = ""
    try:
        dlq_messages = broker.describe_topic(dlq).total_messages if dlq else 0
    except TopicNotFound:
        dlq_messages = 0
    except redis.RedisError:  # pragma: no cover - shown as 0 rather than failing describe
        dlq_messages = 0
    created = meta.get("created_ms")
    return GroupDescription(
        topic=topic,
        group=group,
        mode=meta.get("mode"),
        start=meta.get("start"),
        policy=meta.get("policy"),
        created_ms=int(created) if created else None,
        members=members,
        partitions=partitions,
        dead_letter_topic=dlq,
        dead_letter_messages=dlq_messages,
    )


def delete_group(broker: Broker, topic: str, group: str) -> None:
    """Forget a group: its Redis consumer groups, leases, state, members and settings. Its
    dead-letter topic stays (delete it with delete_topic)."""
    validate_name("group", group)
    keys = broker.keys
    client = broker.client
    config = broker.topic_config(topic, refresh=True)
    for p in range(config.partitions):
        try:
            client.xgroup_destroy(keys.log(topic, p), group)
        except redis.ResponseError:
            pass
        client.delete(
            keys.lease(topic, p, group),
            keys.group_partition_state(topic, p, group),
            keys.parked_keys(topic, p, group),
        )
    client.delete(keys.group_members(topic, group))
    client.delete(keys.group_meta(topic, group))
    client.srem(keys.groups(topic), group)
