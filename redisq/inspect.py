"""What the console and the metrics read: a namespace's topics, their delayed messages and their
groups, in a few pipelined round trips whatever their size.

Every read here is a protocol operation (a generator of steps, run with
`redisq.protocol.run_operation(op, broker.scripts.execute)`): each round trip is one list of
plain commands, pipelined, so a page over 1,000 partitions costs three or four round trips, never
one per partition. The round trips are dependent (the topic registry names the topics, their
metadata the partitions, the partitions the keys), which is why there are three and not one.

Nothing here imports a web framework: `redisq.metrics` uses it without the console's extra.

Positions: an orderly group's committed position on a partition is its Redis consumer group's
last-delivered-id, so XINFO GROUPS gives the lag. When Redis cannot tell it (entries deleted
inside the range, a position set without entries-read), the entries after the position are
counted inside the server (count_range.lua, capped at COUNT_CAP) in one more round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from redis.exceptions import ResponseError

from redisq.admin import fields, read_config, server_ms
from redisq.errors import GroupNotFound, InvalidName, TopicNotFound, read_reply
from redisq.keys import KeySpace, dead_letter_topic, parse_dead_letter_topic, validate_topic
from redisq.protocol import Command, Operation, Step, optional_text, text
from redisq.protocol.admin import count_range
from redisq.protocol.group import parse_lease
from redisq.records import offset_after, offset_parts
from redisq.topic import TopicConfig

COUNT_CAP = 100_000  # entries counted after a position when Redis cannot tell the lag
END = "18446744073709551615-18446744073709551615"  # the greatest stream ID (count_range's end)
# The default session timeout (ConsumerOptions: the lease ttl, 30 s). A group's own is not
# stored, so a member silent for longer is shown as silent, not removed.
SILENT_MEMBER_MS = 30_000

__all__ = [
    "GroupPartition",
    "GroupSnapshot",
    "NamespaceSnapshot",
    "PartitionSnapshot",
    "TopicSnapshot",
    "group_snapshot",
    "namespace_snapshot",
    "topic_snapshot",
]


@dataclass(frozen=True, slots=True)
class PartitionSnapshot:
    """One partition stream (XINFO STREAM). entries_added counts every entry ever appended
    (Redis >= 7.0): the produced-messages counter, which trimming does not lower. scheduled:
    delayed messages waiting in the partition's schedule, the first due at next_due_ms (the
    server's clock)."""

    partition: int
    length: int
    first_offset: str | None
    last_offset: str | None
    entries_added: int
    node: str | None = None
    scheduled: int = 0
    next_due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class TopicSnapshot:
    config: TopicConfig
    partitions: list[PartitionSnapshot]
    groups: list[str]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def length(self) -> int:
        return sum(p.length for p in self.partitions)

    @property
    def entries_added(self) -> int:
        return sum(p.entries_added for p in self.partitions)

    @property
    def scheduled(self) -> int:
        return sum(p.scheduled for p in self.partitions)

    @property
    def next_due_ms(self) -> int | None:
        return min((p.next_due_ms for p in self.partitions if p.next_due_ms), default=None)

    @property
    def dead_letter_of(self) -> tuple[str, str] | None:
        """(topic, group) when this is a group's dead-letter topic."""
        return parse_dead_letter_topic(self.config.name)


@dataclass(frozen=True, slots=True)
class GroupPartition:
    """One partition as a group sees it: position and lag (XINFO GROUPS), the lease (holder,
    fencing token, time left), grants so far (the fencing counter), and the failure state the
    commits record (dead letters, a blocked message, parked keys, held messages)."""

    partition: int
    length: int
    last_delivered: str | None
    entries_read: int | None
    lag: int | None
    lag_counted: bool  # True: counted by count_range (Redis could not tell it)
    pending: int
    consumers: int
    holder: str | None
    token: int | None
    granted_ms: int | None
    lease_left_ms: int | None
    grants: int
    dead_letters: int
    malformed: int
    parked: int
    held: int
    blocked_offset: str | None
    blocked_error: str | None
    blocked_attempts: int | None
    takeovers: int


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    topic: str
    group: str
    mode: str | None
    start: str | None
    policy: str | None
    created_ms: int | None
    members: list[tuple[str, int]]  # (name, ms since its last heartbeat), sorted by name
    partitions: list[GroupPartition]
    dead_letter_topic: str
    dead_letters_waiting: int  # messages in the dead-letter topic now
    now_ms: int

    @property
    def lag(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if any(lag is None for lag in lags) else sum(lag or 0 for lag in lags)

    @property
    def live_members(self) -> list[str]:
        return [name for name, age in self.members if age <= SILENT_MEMBER_MS]

    @property
    def blocked(self) -> int:
        return sum(1 for p in self.partitions if p.blocked_offset)

    @property
    def parked(self) -> int:
        return sum(p.parked for p in self.partitions)

    @property
    def held(self) -> int:
        return sum(p.held for p in self.partitions)

    @property
    def pending(self) -> int:
        return sum(p.pending for p in self.partitions)


@dataclass(frozen=True, slots=True)
class NamespaceSnapshot:
    now_ms: int
    topics: dict[str, TopicSnapshot] = field(default_factory=dict)
    groups: dict[tuple[str, str], GroupSnapshot] = field(default_factory=dict)


# -- reply helpers -------------------------------------------------------------------------------
def _stream_reply(reply: Any, what: str) -> Any:
    """XINFO STREAM / XINFO GROUPS: a stream deleted under the read (delete_topic between two
    round trips) answers 'no such key', which is nothing there; any other error is ReadFailed."""
    if isinstance(reply, ResponseError) and str(reply) == "no such key":
        return None
    return read_reply(reply, what)


def _as_dict(reply: Any) -> dict[str, Any]:
    return {} if reply is None else fields(reply)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _hash(reply: Any, what: str) -> dict[str, str]:
    return {k: text(v) for k, v in _as_dict(read_reply(reply, what)).items()}


def _scored(reply: Any, what: str) -> list[tuple[str, float]]:
    """ZRANGE ... WITHSCORES as (member, score) pairs (RESP2 flat, pairs, or RESP3)."""
    if not read_reply(reply, what):
        return []
    if isinstance(reply[0], list | tuple):
        return [(text(m), float(s)) for m, s in reply]
    it = iter(reply)
    return [(text(m), float(s)) for m, s in zip(it, it, strict=True)]


def _stream(topic: str, p: int, replies: Sequence[Any], node: str | None) -> PartitionSnapshot:
    """XINFO STREAM, then ZCARD and the first of the schedule when read (_stream_steps)."""
    info, scheduled, first_due = (*replies, 0, None) if len(replies) == 1 else replies
    where = f"topic {topic!r} partition {p}"
    info = _as_dict(_stream_reply(info, f"{where} (XINFO STREAM)"))
    first, last = info.get("first-entry"), info.get("last-entry")
    due = _scored(first_due, f"{where}'s schedule")
    return PartitionSnapshot(
        partition=p,
        length=_int(info.get("length")),
        first_offset=optional_text(first[0]) if first else None,
        last_offset=optional_text(last[0]) if last else None,
        entries_added=_int(info.get("entries-added"), _int(info.get("length"))),
        node=node,
        scheduled=_int(read_reply(scheduled, f"{where}'s schedule")),
        next_due_ms=int(due[0][1]) if due else None,
    )


def _stream_groups(reply: Any, topic: str, p: int) -> dict[str, dict[str, Any]]:
    """XINFO GROUPS by group name."""
    reply = _stream_reply(reply, f"topic {topic!r} partition {p} (XINFO GROUPS)")
    if not reply:
        return {}
    found = {}
    for entry in reply:
        info = _as_dict(entry)
        found[text(info.get("name"))] = info
    return found


# -- topics --------------------------------------------------------------------------------------
def _topic_configs(keys: KeySpace, names: Sequence[str]) -> Operation[list[TopicSnapshot]]:
    """Metadata and group registries of these topics (one round trip); a topic deleted since
    the registry was read is left out."""
    steps: list[Step] = [Command(("HGETALL", keys.topic_meta(t))) for t in names]
    steps += [Command(("SMEMBERS", keys.groups(t))) for t in names]
    replies = yield steps
    found = []
    for i, name in enumerate(names):
        raw = read_reply(replies[i], f"topic {name!r} (settings)")
        raw = raw if isinstance(raw, dict) else dict(zip(raw[0::2], raw[1::2], strict=True))
        if not raw:
            continue
        registry = read_reply(replies[len(names) + i], f"topic {name!r}'s groups")
        groups = sorted(text(g) for g in registry or ())
        found.append(TopicSnapshot(TopicConfig.from_hash(name, raw), [], groups))
    return found


def _stream_steps(
    keys: KeySpace, topics: Iterable[TopicSnapshot], with_schedules: bool
) -> list[Step]:
    steps: list[Step] = []
    for t in topics:
        for p in range(t.config.partitions):
            steps.append(Command(("XINFO", "STREAM", keys.log(t.name, p))))
            if with_schedules:
                steps += [
                    Command(("ZCARD", keys.scheduled(t.name, p))),
                    Command(("ZRANGE", keys.scheduled(t.name, p), 0, 0, "WITHSCORES")),
                ]
    return steps


def namespace_snapshot(
    keys: KeySpace,
    *,
    with_groups: bool = True,
    with_schedules: bool = True,
    topics: Sequence[str] | None = None,
    nodes: Any = None,
) -> Operation[NamespaceSnapshot]:
    """Every topic of the namespace (or these), their partitions (with_schedules: and their
    delayed messages, two commands more per partition), and (with_groups) every group with its
    per-partition state: three round trips (a fourth only for lags Redis cannot tell).
    nodes: a function key -> "host:port" (a cluster client's slot map), or None."""
    if topics is None:
        members, now = yield [Command(("SMEMBERS", keys.topics())), Command(("TIME",))]
        names = sorted(text(m) for m in read_reply(members, "the topic registry"))
    else:
        (now,) = yield [Command(("TIME",))]
        names = list(topics)
    now_ms = server_ms(read_reply(now, "the server's time"))
    snapshots = yield from _topic_configs(keys, names)
    steps = _stream_steps(keys, snapshots, with_schedules)
    per_stream = 3 if with_schedules else 1
    group_refs = [(t, g) for t in snapshots for g in t.groups] if with_groups else []
    group_steps: list[Step] = []
    for t, g in group_refs:
        group_steps += _group_steps(keys, t.name, g, t.config.partitions)
    group_info_steps: list[Step] = (
        [
            Command(("XINFO", "GROUPS", keys.log(t.name, p)))
            for t in snapshots
            if t.groups
            for p in range(t.config.partitions)
        ]
        if with_groups
        else []
    )
    replies = yield steps + group_info_steps + group_steps
    result = NamespaceSnapshot(now_ms)
    at = 0
    for t in snapshots:
        parts = []
        for p in range(t.config.partitions):
            key = keys.log(t.name, p)
            stream = replies[at : at + per_stream]
            parts.append(_stream(t.name, p, stream, nodes(key) if nodes else None))
            at += per_stream
        result.topics[t.name] = TopicSnapshot(t.config, parts, t.groups)
    stream_groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for t in snapshots:
        if with_groups and t.groups:
            for p in range(t.config.partitions):
                stream_groups[(t.name, p)] = _stream_groups(replies[at], t.name, p)
                at += 1
    groups = []
    for t, g in group_refs:
        size = _group_step_count(t.config.partitions)
        topic = result.topics[t.name]
        groups.append(
            _group_from_replies(
                topic, g, replies[at : at + size], stream_groups, result.topics, now_ms
            )
        )
        at += size
    groups = yield from _count_unknown_lags(keys, groups)
    for snapshot in groups:
        result.groups[(snapshot.topic, snapshot.group)] = snapshot
    return result


def topic_snapshot(keys: KeySpace, topic: str, nodes: Any = None) -> Operation[NamespaceSnapshot]:
    """One topic with its groups (and their dead-letter topics' lengths); TopicNotFound."""
    validate_topic(topic)
    config = yield from read_config(keys, topic)
    if config is None:
        raise TopicNotFound(topic)
    groups = yield Command(("SMEMBERS", keys.groups(topic)))
    wanted = [topic] + [_dlq(topic, text(g)) for g in groups]
    return (yield from namespace_snapshot(keys, topics=[t for t in wanted if t], nodes=nodes))


def group_snapshot(keys: KeySpace, topic: str, group: str) -> Operation[GroupSnapshot]:
    """One group; TopicNotFound / GroupNotFound."""
    snapshot = yield from topic_snapshot(keys, topic)
    found = snapshot.groups.get((topic, group))
    if found is None:
        raise GroupNotFound(topic, group)
    return found


def _dlq(topic: str, group: str) -> str:
    try:
        return dead_letter_topic(topic, group)
    except InvalidName:  # past the length limit: this group cannot have one
        return ""


# -- groups --------------------------------------------------------------------------------------
_PER_PARTITION = 6


def _group_step_count(partitions: int) -> int:
    return 2 + _PER_PARTITION * partitions


def _group_steps(keys: KeySpace, topic: str, group: str, partitions: int) -> list[Step]:
    steps: list[Step] = [
        Command(("HGETALL", keys.group_meta(topic, group))),
        Command(("ZRANGE", keys.group_members(topic, group), 0, -1, "WITHSCORES")),
    ]
    for p in range(partitions):
        lease = keys.lease(topic, p, group)
        steps += [
            Command(("GET", lease)),
            Command(("PTTL", lease)),
            Command(("GET", keys.lease_fence(topic, p, group))),
            Command(("HGETALL", keys.group_partition_state(topic, p, group))),
            Command(("HLEN", keys.parked_keys(topic, p, group))),
            Command(("HLEN", keys.held_messages(topic, p, group))),
        ]
    return steps


def _group_from_replies(
    topic: TopicSnapshot,
    group: str,
    replies: Sequence[Any],
    stream_groups: dict[tuple[str, int], dict[str, dict[str, Any]]],
    topics: dict[str, TopicSnapshot],
    now_ms: int,
) -> GroupSnapshot:
    where = f"group {group!r} of topic {topic.name!r}"
    meta = _hash(replies[0], f"{where} (settings)")
    members = sorted(
        (name, max(0, now_ms - int(score)))
        for name, score in _scored(replies[1], f"{where} (members)")
    )
    partitions = []
    for p, stream in enumerate(topic.partitions):
        at = f"{where} partition {p}"
        lease_raw, ttl, fence, state_raw, parked, held = (
            read_reply(reply, at) for reply in replies[2 + _PER_PARTITION * p :][:_PER_PARTITION]
        )
        try:
            lease = parse_lease(lease_raw)
        except ValueError:  # not a lease value redisq wrote
            lease = None
        state = _hash(state_raw, at)
        entry = stream_groups.get((topic.name, p), {}).get(group)
        if entry is None:  # the group has not read this partition yet: all of it is to come
            lag: int | None = stream.length
            last_delivered = None
            entries_read = None
        else:
            raw_lag = entry.get("lag")
            lag = None if raw_lag is None else int(raw_lag)
            last_delivered = optional_text(entry.get("last-delivered-id"))
            read = entry.get("entries-read")
            entries_read = None if read is None else int(read)
        ttl_ms = _int(ttl, -2) if lease else -2
        blocked_attempts = state.get("blocked_attempts")
        partitions.append(
            GroupPartition(
                partition=p,
                length=stream.length,
                last_delivered=last_delivered,
                entries_read=entries_read,
                lag=lag,
                lag_counted=False,
                pending=_int(entry.get("pending")) if entry else 0,
                consumers=_int(entry.get("consumers")) if entry else 0,
                holder=lease[1] if lease else None,
                token=lease[0] if lease else None,
                granted_ms=lease[2] if lease else None,
                lease_left_ms=ttl_ms if ttl_ms >= 0 else None,
                grants=_int(fence),
                dead_letters=_int(state.get("dead_letters")),
                malformed=_int(state.get("malformed")),
                parked=_int(parked),
                held=_int(held),
                blocked_offset=state.get("blocked_offset"),
                blocked_error=state.get("blocked_error"),
                blocked_attempts=_int(blocked_attempts) if blocked_attempts else None,
                takeovers=_int(state.get("takeovers")),
            )
        )
    dlq = _dlq(topic.name, group)
    dlq_topic = topics.get(dlq) if dlq else None
    created = meta.get("created_ms")
    return GroupSnapshot(
        topic=topic.name,
        group=group,
        mode=meta.get("mode"),
        start=meta.get("start"),
        policy=meta.get("policy"),
        created_ms=int(created) if created else None,
        members=members,
        partitions=partitions,
        dead_letter_topic=dlq,
        dead_letters_waiting=dlq_topic.length if dlq_topic else 0,
        now_ms=now_ms,
    )


def _count_unknown_lags(
    keys: KeySpace, groups: list[GroupSnapshot]
) -> Operation[list[GroupSnapshot]]:
    """Lags Redis could not tell, counted inside the server (one pipelined round trip)."""
    unknown = [
        (i, gp) for i, g in enumerate(groups) for gp in g.partitions if gp.lag is None and gp.length
    ]
    if not unknown:
        return groups
    steps: list[Step] = []
    for i, gp in unknown:
        start = gp.last_delivered or "0-0"
        begin = "-" if offset_parts(start) == (0, 0) else offset_after(start)
        if begin is None:  # the largest stream ID: nothing can follow it (count 0 below)
            steps.append(Command(("ECHO", "0"), lambda _: (0, "")))
            continue
        steps.append(count_range(keys, groups[i].topic, gp.partition, begin, END, COUNT_CAP + 1))
    counts = yield steps
    rebuilt = [list(g.partitions) for g in groups]
    for (i, gp), result in zip(unknown, counts, strict=True):
        where = f"topic {groups[i].topic!r} partition {gp.partition}"
        count = int(read_reply(result, f"{where}: group {groups[i].group!r}'s lag")[0])
        lag = None if count > COUNT_CAP else count
        rebuilt[i][gp.partition] = replace(gp, lag=lag, lag_counted=lag is not None)
    return [replace(g, partitions=parts) for g, parts in zip(groups, rebuilt, strict=True)]
