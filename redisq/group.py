"""Consumer groups: a member's membership calls, and what a group looks like (describe, list,
delete).

Membership: every member heartbeats into the group's registry (a zset scored by server time); a
member silent for session_timeout_ms is dead. Every member sorts the live members and computes
the same assignment (ownership.py), so no coordinator process exists.

Leases: one per (group, partition), a string set NX with a PX ttl whose value carries a fencing
token bumped on every grant. The assignment only says who *should* own a partition; the lease
says who *does*, and Redis checks it on every read and commit of that partition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from redisq.errors import InvalidName, TopicNotFound
from redisq.keys import dead_letter_topic, validate_name, validate_topic
from redisq.ownership import assign_partitions
from redisq.protocol import group as calls
from redisq.protocol.group import Grant, Lease, parse_lease

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.group")

__all__ = [
    "GroupDescription",
    "GroupMembership",
    "Lease",
    "MemberInfo",
    "PartitionLag",
    "assign_partitions",
    "delete_group",
    "describe_group",
    "list_groups",
    "parse_lease",
]


class GroupMembership:
    """Join, heartbeat, leave; and the lease operations of one member of one group of one topic
    (the thread driver's calls of redisq.protocol.group)."""

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
        self.ref = calls.GroupRef(self.topic, self.group)
        self.mode = mode
        self.start = start
        self.policy = policy
        self.lease_ttl_ms = lease_ttl_ms
        self.session_timeout_ms = session_timeout_ms
        self.start_id = "0"
        self._keys = broker.keys
        self._scripts = broker.scripts

    def join(self) -> bool:
        """Register the group (the first member fixes mode and start) and this member. True if
        the group was created now."""
        created, self.start_id = self._scripts.run(
            calls.join_group(
                self._keys, self.ref, self.member, mode=self.mode, start=self.start,
                policy=self.policy,
            )
        )  # fmt: skip
        return created

    def heartbeat(self) -> list[str]:
        """Beat, and answer the sorted live members (server clock)."""
        return self._scripts.run(
            calls.heartbeat(self._keys, self.ref, self.member, self.session_timeout_ms)
        )

    def leave(self) -> None:
        self._scripts.run(
            calls.heartbeat(self._keys, self.ref, self.member, self.session_timeout_ms, leave=True)
        )

    def acquire_lease(self, partition: int) -> Grant | None:
        """SET NX PX with a fresh fencing token, and the group's position on the partition; None
        while another member holds it."""
        return self._scripts.run(
            calls.acquire_lease(
                self._keys, self.ref, partition, self.member, self.lease_ttl_ms, self.start_id
            )
        )

    def renew_lease(self, lease: Lease) -> bool:
        """PEXPIRE while the value is still ours; False means lost."""
        return self._scripts.run(calls.renew_lease(self._keys, lease, self.lease_ttl_ms))

    def release_lease(self, lease: Lease) -> bool:
        """DEL while the value is still ours, so the next owner need not wait for the ttl."""
        return self._scripts.run(calls.release_lease(self._keys, lease))

    def ensure_stream_group(self, partition: int) -> None:
        """Concurrent mode takes no leases: create the Redis consumer group directly."""
        self._scripts.run(calls.ensure_stream_group(self._keys, self.ref, partition, self.start_id))


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
    held: int = 0  # messages held back behind parked keys (orderly groups)


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
        held = int(client.hlen(keys.held_messages(topic, p, group)))
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
                held=held,
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
            keys.held_messages(topic, p, group),
        )
    client.delete(keys.group_members(topic, group))
    client.delete(keys.group_meta(topic, group))
    client.srem(keys.groups(topic), group)
