"""What a consumer group looks like, and the operations of its administrator: list, describe,
delete (re-exported by redisq.group; resetting offsets is group_offsets.py).

A group exists once a member joined it: it is then in the topic's group registry. Every function
here raises TopicNotFound for a missing topic and GroupNotFound for a group not in the registry,
so a typo never reads as an empty, healthy group.

Positions: an orderly group's committed position on a partition is its Redis consumer group's
last-delivered-id (the last entry counted as handled; the next read starts after it), so
XINFO GROUPS shows the truth. A concurrent group has the same position (what was delivered)
and a pending-entries list (delivered, not acknowledged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from redisq.admin import LIVE_MEMBER_MS
from redisq.errors import (
    GroupInUse,
    GroupNotFound,
    InvalidName,
    TopicNotFound,
)
from redisq.keys import dead_letter_topic, validate_name, validate_topic
from redisq.protocol.group import parse_lease
from redisq.records import offset_after

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.group")

COUNT_CAP = 100_000  # entries counted for a lag Redis cannot tell, per partition

__all__ = [
    "GroupDescription",
    "GroupInUse",
    "MemberInfo",
    "PartitionLag",
    "delete_group",
    "describe_group",
    "group_exists",
    "list_groups",
    "live_members",
]


# -- what a group looks like ---------------------------------------------------------------------
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

    @property
    def total_held(self) -> int:
        return sum(p.held for p in self.partitions)


def list_groups(broker: Broker, topic: str | None = None) -> list[tuple[str, str]]:
    """(topic, group) pairs, sorted; TopicNotFound for a topic that does not exist."""
    if topic is not None:
        broker.topic_config(topic, refresh=True)
    topics = [topic] if topic is not None else broker.list_topics()
    pairs = []
    for name in topics:
        for group in broker.client.smembers(broker.keys.groups(name)):
            pairs.append((name, group.decode()))
    return sorted(pairs)


def group_exists(broker: Broker, topic: str, group: str) -> bool:
    """The group is in the topic's registry (a member joined it and it was not deleted)."""
    validate_name("group", group)
    return bool(broker.client.sismember(broker.keys.groups(topic), group))


def require_group(broker: Broker, topic: str, group: str) -> int:
    """The topic's partition count; TopicNotFound / GroupNotFound."""
    validate_topic(topic)
    validate_name("group", group)
    partitions = broker.topic_config(topic, refresh=True).partitions
    if not group_exists(broker, topic, group):
        raise GroupNotFound(topic, group)
    return partitions


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _count_after(broker: Broker, key: str, last_delivered: str | None, cap: int = COUNT_CAP) -> int:
    """Entries after last_delivered (when Redis cannot tell the lag), counted up to cap."""
    start: str | None = "-"
    if last_delivered and last_delivered != "0-0":
        start = offset_after(last_delivered)
    count = 0
    while start is not None and count < cap:
        entries = broker.client.xrange(key, min=start, max="+", count=1000)
        count += len(entries)
        if len(entries) < 1000:
            break
        start = offset_after(entries[-1][0].decode())
    return count


def stream_group(broker: Broker, stream: str, group: str) -> dict[str, Any] | None:
    """The Redis consumer group's XINFO GROUPS entry on one partition, None if it has none."""
    for info in broker.client.xinfo_groups(stream):
        if _text(info.get("name")) == group:
            return dict(info)
    return None


def describe_group(broker: Broker, topic: str, group: str) -> GroupDescription:
    """Members, and per partition: lag, entries-read, pending, owner, lease age, dead letters
    (and how many were malformed entries), parked keys, held messages and a blocked (poison)
    message, if any. TopicNotFound / GroupNotFound."""
    partition_count = require_group(broker, topic, group)
    keys = broker.keys
    client = broker.client
    meta = {
        k.decode(): v.decode() for k, v in client.hgetall(keys.group_meta(topic, group)).items()
    }
    now_s, now_us = client.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    members = [
        MemberInfo(name.decode(), now_ms - int(score))
        for name, score in client.zrange(keys.group_members(topic, group), 0, -1, withscores=True)
    ]
    partitions = [
        _describe_partition(broker, topic, group, p, now_ms) for p in range(partition_count)
    ]
    try:
        dlq = dead_letter_topic(topic, group)
    except InvalidName:  # past the length limit (deeply nested): this group cannot have one
        dlq = ""
    try:
        dlq_messages = broker.describe_topic(dlq).total_messages if dlq else 0
    except TopicNotFound:
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


def _describe_partition(
    broker: Broker, topic: str, group: str, p: int, now_ms: int
) -> PartitionLag:
    keys = broker.keys
    client = broker.client
    stream = keys.log(topic, p)
    info = client.xinfo_stream(stream)
    last = info.get("last-entry")
    length = int(info.get("length", 0))
    entry = stream_group(broker, stream, group)
    lease_value = client.get(keys.lease(topic, p, group))
    lease_ttl = client.pttl(keys.lease(topic, p, group)) if lease_value else None
    lease = parse_lease(lease_value)
    state = {
        k.decode(): v.decode()
        for k, v in client.hgetall(keys.group_partition_state(topic, p, group)).items()
    }
    last_delivered = _text(entry.get("last-delivered-id")) if entry else None
    if entry is None:  # the group has not read this partition yet: all of it is to come
        lag: int | None = length
    else:
        lag = entry.get("lag")
        if lag is None:
            lag = _count_after(broker, stream, last_delivered)
    entries_read = entry.get("entries-read") if entry else None
    return PartitionLag(
        partition=p,
        length=length,
        last_offset=_text(last[0]) if last else None,
        last_delivered=last_delivered,
        entries_read=int(entries_read) if entries_read is not None else None,
        lag=int(lag) if lag is not None else None,
        pending=int(entry.get("pending", 0)) if entry else 0,
        owner=lease[1] if lease else None,
        lease_token=lease[0] if lease else None,
        lease_age_ms=now_ms - lease[2] if lease else None,
        lease_ttl_ms=int(lease_ttl) if lease_ttl is not None and lease_ttl >= 0 else None,
        dead_letters=int(state.get("dead_letters", 0)),
        parked_keys=int(client.hlen(keys.parked_keys(topic, p, group))),
        blocked_offset=state.get("blocked_offset"),
        blocked_error=state.get("blocked_error"),
        blocked_attempts=int(state["blocked_attempts"]) if "blocked_attempts" in state else None,
        malformed=int(state.get("malformed", 0)),
        held=int(client.hlen(keys.held_messages(topic, p, group))),
    )


# -- liveness ------------------------------------------------------------------------------------
def live_members(
    broker: Broker, topic: str, group: str, partitions: int | None = None
) -> list[str]:
    """Members that beat within LIVE_MEMBER_MS (as for delete_topic: a group's own session
    timeout is not stored), and the holders of unexpired partition leases (a member that
    stopped beating may still commit under its lease until the lease runs out)."""
    keys = broker.keys
    client = broker.client
    now_s, now_us = client.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    names = {
        m.decode()
        for m in client.zrangebyscore(
            keys.group_members(topic, group), now_ms - LIVE_MEMBER_MS, "+inf"
        )
    }
    count = partitions if partitions is not None else broker.topic_config(topic).partitions
    for p in range(count):
        lease = parse_lease(client.get(keys.lease(topic, p, group)))
        if lease is not None:
            names.add(lease[1])
    return sorted(names)


def refuse_if_live(broker: Broker, topic: str, group: str, partitions: int, action: str) -> None:
    members = live_members(broker, topic, group, partitions)
    if members:
        raise GroupInUse(topic, group, members, action)


# -- delete --------------------------------------------------------------------------------------
def delete_group(
    broker: Broker,
    topic: str,
    group: str,
    *,
    force: bool = False,
    keep_dead_letters: bool = False,
) -> None:
    """Forget a group and everything it owns: its Redis consumer groups (positions, pending
    entries), leases and fencing counters, partition state, parked keys, held messages,
    members, settings, and its dead-letter topic (unless keep_dead_letters). Idempotency
    markers of `consumer.idempotent` expire by their ttl.

    Refused with GroupInUse while it has live members (force: delete anyway; their next
    commit then finds nothing). TopicNotFound / GroupNotFound."""
    partitions = require_group(broker, topic, group)
    if not force:
        refuse_if_live(broker, topic, group, partitions, "delete it (or delete with force)")
    keys = broker.keys
    client = broker.client
    for p in range(partitions):
        try:
            client.xgroup_destroy(keys.log(topic, p), group)
        except redis.ResponseError:  # the partition was never read by the group
            pass
        client.delete(
            keys.lease(topic, p, group),
            keys.lease_fence(topic, p, group),
            keys.group_partition_state(topic, p, group),
            keys.parked_keys(topic, p, group),
            keys.held_messages(topic, p, group),
        )
    client.delete(keys.group_members(topic, group), keys.group_meta(topic, group))
    client.srem(keys.groups(topic), group)
    if not keep_dead_letters:
        try:
            broker.delete_topic(dead_letter_topic(topic, group), force=True)
        except (TopicNotFound, InvalidName):
            pass
    log.info("deleted group %s of %s", group, topic)
