"""Consumer-group administration, written once as protocol operations that both brokers run
(`Broker.list_groups`, `describe_group`, `delete_group`; resetting offsets is
redisq.protocol.offsets).

A group exists once a member joined it: it is then in the topic's group registry. Every operation
here raises TopicNotFound for a missing topic and GroupNotFound for a group not in the registry,
so a typo never reads as an empty, healthy group. A read answered with an error is a ReadFailed
naming what could not be read, never a lag of 0 in its place.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from redisq.errors import GroupInUse, GroupNotFound, read_reply
from redisq.model.groups import GroupDescription, MemberInfo, PartitionLag
from redisq.model.keys import KeySpace, validate_name, validate_topic
from redisq.model.snapshots import NamespaceSnapshot
from redisq.protocol import Command, Operation, Step, text
from redisq.protocol.group import parse_lease
from redisq.protocol.group_view import dlq_name
from redisq.protocol.overview import group_and_topic
from redisq.protocol.topics import LIVE_MEMBER_MS, list_topics, server_ms, topic_config

log = logging.getLogger("redisq.group")

__all__ = [
    "delete_group",
    "describe_group",
    "description",
    "group_exists",
    "lease_holders",
    "list_groups",
    "live_members",
    "refuse_if_live",
    "require_group",
]


def list_groups(keys: KeySpace, topic: str | None = None) -> Operation[list[tuple[str, str]]]:
    """(topic, group) pairs, sorted: of one topic (TopicNotFound if it does not exist) or of
    every topic of the namespace."""
    if topic is not None:
        yield from topic_config(keys, topic)
        topics = [topic]
    else:
        topics = yield from list_topics(keys)
    registries = yield [Command(("SMEMBERS", keys.groups(name))) for name in topics]
    pairs = []
    for name, members in zip(topics, registries, strict=True):
        pairs += [(name, text(g)) for g in read_reply(members, f"topic {name!r}'s groups")]
    return sorted(pairs)


def group_exists(keys: KeySpace, topic: str, group: str) -> Operation[bool]:
    """The group is in the topic's registry (a member joined it and it was not deleted)."""
    validate_name("group", group)
    found = yield Command(("SISMEMBER", keys.groups(topic), group), int)
    return bool(found)


def require_group(keys: KeySpace, topic: str, group: str) -> Operation[int]:
    """The topic's partition count; TopicNotFound / GroupNotFound."""
    validate_topic(topic)
    validate_name("group", group)
    config = yield from topic_config(keys, topic)
    if not (yield from group_exists(keys, topic, group)):
        raise GroupNotFound(topic, group)
    return config.partitions


# -- describe ------------------------------------------------------------------------------------
def describe_group(keys: KeySpace, topic: str, group: str) -> Operation[GroupDescription]:
    """Members, and per partition: lag, entries read, pending, owner, lease age, dead letters
    (and how many were malformed entries), parked keys, held messages and a blocked (poison)
    message, if any. Read as the console reads a group (redisq.protocol.overview, pipelined:
    three round trips, a fourth for lags Redis cannot tell), so the two never disagree.
    TopicNotFound / GroupNotFound."""
    snapshot = yield from group_and_topic(keys, topic, group)
    return description(snapshot, topic, group)


def description(snapshot: NamespaceSnapshot, topic: str, group: str) -> GroupDescription:
    """describe_group's answer from a namespace snapshot that read the topic and the group."""
    read = snapshot.groups[(topic, group)]
    streams = snapshot.topics[topic].partitions
    partitions = [
        PartitionLag(
            partition=p.partition,
            length=p.length,
            last_offset=streams[p.partition].last_offset,
            last_delivered=p.last_delivered,
            entries_read=p.entries_read,
            lag=p.lag,
            pending=p.pending,
            owner=p.holder,
            lease_token=p.token,
            lease_age_ms=read.now_ms - p.granted_ms if p.granted_ms is not None else None,
            lease_ttl_ms=p.lease_left_ms,
            dead_letters=p.dead_letters,
            parked_keys=p.parked,
            blocked_offset=p.blocked_offset,
            blocked_error=p.blocked_error,
            blocked_attempts=p.blocked_attempts,
            malformed=p.malformed,
            held=p.held,
        )
        for p in read.partitions
    ]
    return GroupDescription(
        topic=topic,
        group=group,
        mode=read.mode,
        start=read.start,
        policy=read.policy,
        created_ms=read.created_ms,
        members=[MemberInfo(name, age) for name, age in read.members],
        partitions=partitions,
        dead_letter_topic=read.dead_letter_topic,
        dead_letter_messages=read.dead_letters_waiting,
    )


# -- liveness ------------------------------------------------------------------------------------
def live_members(keys: KeySpace, topic: str, group: str, partitions: int) -> Operation[list[str]]:
    """Members that beat within LIVE_MEMBER_MS (as for delete_topic: a group's own session
    timeout is not stored), and the holders of unexpired partition leases (a member that
    stopped beating may still commit under its lease until the lease runs out)."""
    now = yield Command(("TIME",), server_ms)
    where = f"group {group!r} of topic {topic!r}"
    steps: list[Step] = [
        Command(("ZRANGEBYSCORE", keys.group_members(topic, group), now - LIVE_MEMBER_MS, "+inf"))
    ]
    steps += [Command(("GET", keys.lease(topic, p, group))) for p in range(partitions)]
    replies = yield steps
    names = {text(m) for m in read_reply(replies[0], f"{where} (members)")}
    for p, value in enumerate(replies[1:]):
        names.update(lease_holders(read_reply(value, f"{where} partition {p} (lease)")))
    return sorted(names)


def lease_holders(value: bytes | str | None) -> list[str]:
    """The member a lease value names ([] for no lease; the value itself if redisq did not
    write it: a lease is a lease, whoever wrote it)."""
    if value is None:
        return []
    try:
        lease = parse_lease(value)
    except ValueError:
        return [text(value)]
    return [lease[1]] if lease else []


def refuse_if_live(
    keys: KeySpace, topic: str, group: str, partitions: int, action: str
) -> Operation[None]:
    """GroupInUse while the group has live members or a partition lease is held."""
    members = yield from live_members(keys, topic, group, partitions)
    if members:
        raise GroupInUse(topic, group, members, action)


# -- delete --------------------------------------------------------------------------------------
def delete_group(
    keys: KeySpace, topic: str, group: str, *, force: bool = False
) -> Operation[str | None]:
    """Forget a group and everything it owns: its Redis consumer groups (positions, pending
    entries), leases and fencing counters, partition state, parked keys, held messages,
    members and settings. Returns its dead-letter topic's name, for the caller to delete (a
    topic's keys may sit on every node of a cluster), or None if it cannot have one.

    Refused with GroupInUse while it has live members (force: delete anyway; their next
    commit then finds nothing). TopicNotFound / GroupNotFound."""
    partitions = yield from require_group(keys, topic, group)
    if not force:
        action = "delete it (or delete with force)"
        yield from refuse_if_live(keys, topic, group, partitions, action)
    destroyed = yield [
        Command(("XGROUP", "DESTROY", keys.log(topic, p), group)) for p in range(partitions)
    ]
    for result in destroyed:
        # A ResponseError: the partition stream is gone (XGROUP refuses a missing key).
        if isinstance(result, Exception) and not isinstance(result, ResponseError):
            raise result
    deleted = yield [
        Command(
            (
                "DEL",
                keys.lease(topic, p, group),
                keys.lease_fence(topic, p, group),
                keys.group_partition_state(topic, p, group),
                keys.parked_keys(topic, p, group),
                keys.held_messages(topic, p, group),
                keys.settled_messages(topic, p, group),
            )
        )
        for p in range(partitions)
    ]
    deleted += yield [
        Command(("DEL", keys.group_members(topic, group), keys.group_meta(topic, group))),
        Command(("SREM", keys.groups(topic), group)),
    ]
    for result in deleted:
        if isinstance(result, Exception):
            raise result
    log.info("deleted group %s of %s", group, topic)
    return dlq_name(topic, group) or None
