"""What the console and the metrics read: a namespace's topics, their delayed messages and their
groups, in a few pipelined round trips whatever their size.

Every read here is a protocol operation (a generator of steps, run with
`redisq.protocol.run_operation(op, broker.scripts.execute)`): each round trip is one list of
plain commands, pipelined, so a page over 1,000 partitions costs three or four round trips, never
one per partition. The round trips are dependent (the topic registry names the topics, their
metadata the partitions, the partitions the keys), which is why there are three and not one.

Nothing here imports a web framework: `redisq.metrics` uses it without the console's extra.

Groups are read by redisq.protocol.group_view, which is also where their lag is computed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from redisq.errors import GroupNotFound, TopicNotFound, read_reply
from redisq.model.counting import retained_messages
from redisq.model.fields import parse_id_field
from redisq.model.keys import KeySpace, validate_name, validate_topic
from redisq.model.snapshots import (
    GroupPartition,
    GroupSnapshot,
    NamespaceSnapshot,
    PartitionSnapshot,
    TopicSnapshot,
)
from redisq.model.topic import TopicConfig
from redisq.protocol import Command, Operation, Step, optional_text, text
from redisq.protocol.group_view import (
    as_dict,
    as_int,
    count_unknown_lags,
    dlq_name,
    group_from_replies,
    group_step_count,
    group_steps,
    scored,
    stream_groups,
    stream_reply,
)
from redisq.protocol.topics import read_config, server_ms

__all__ = [
    "GroupPartition",
    "GroupSnapshot",
    "NamespaceSnapshot",
    "PartitionSnapshot",
    "TopicSnapshot",
    "group_and_topic",
    "group_snapshot",
    "namespace_snapshot",
    "topic_snapshot",
]


def _stream(
    topic: str, p: int, replies: Sequence[Any], node: str | None, batch: bool
) -> PartitionSnapshot:
    """XINFO STREAM, then ZCARD and the first of the schedule when read, then the messages
    counted on a batch topic (_stream_steps)."""
    counted = (
        parse_id_field(read_reply(replies[-1], f"topic {topic!r}'s counters")) if batch else None
    )
    replies = replies[:-1] if batch else replies
    info, scheduled, first_due = (*replies, 0, None) if len(replies) == 1 else replies
    where = f"topic {topic!r} partition {p}"
    info = as_dict(stream_reply(info, f"{where} (XINFO STREAM)"))
    first, last = info.get("first-entry"), info.get("last-entry")
    due = scored(first_due, f"{where}'s schedule")
    length = as_int(info.get("length"))
    return PartitionSnapshot(
        partition=p,
        counted=counted,
        messages=retained_messages(counted, length, first) if batch else length,
        length=length,
        first_offset=optional_text(first[0]) if first else None,
        last_offset=optional_text(last[0]) if last else None,
        entries_added=as_int(info.get("entries-added"), as_int(info.get("length"))),
        node=node,
        scheduled=as_int(read_reply(scheduled, f"{where}'s schedule")),
        next_due_ms=int(due[0][1]) if due else None,
    )


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
            if t.config.entry_format == "batch":
                steps.append(Command(("HGET", keys.counts(t.name, p), "m")))
    return steps


def namespace_snapshot(
    keys: KeySpace,
    *,
    with_groups: bool = True,
    with_schedules: bool = True,
    topics: Sequence[str] | None = None,
    nodes: Any = None,
    groups: Collection[tuple[str, str]] | None = None,
) -> Operation[NamespaceSnapshot]:
    """Every topic of the namespace (or these), their partitions (with_schedules: and their
    delayed messages, two commands more per partition), and (with_groups) every group with its
    per-partition state (or only these (topic, group) pairs): three round trips (a fourth only
    for lags Redis cannot tell). nodes: a function key -> "host:port" (a cluster client's slot
    map), or None."""
    if topics is None:
        members, now = yield [Command(("SMEMBERS", keys.topics())), Command(("TIME",))]
        names = sorted(text(m) for m in read_reply(members, "the topic registry"))
    else:
        (now,) = yield [Command(("TIME",))]
        names = list(topics)
    now_ms = server_ms(read_reply(now, "the server's time"))
    snapshots = yield from _topic_configs(keys, names)
    steps = _stream_steps(keys, snapshots, with_schedules)
    group_refs = (
        [(t, g) for t in snapshots for g in t.groups if groups is None or (t.name, g) in groups]
        if with_groups
        else []
    )
    read_topics = {t.name for t, _g in group_refs}
    per_group: list[Step] = []
    for t, g in group_refs:
        per_group += group_steps(keys, t.name, g, t.config.partitions)
    group_info_steps: list[Step] = (
        [
            Command(("XINFO", "GROUPS", keys.log(t.name, p)))
            for t in snapshots
            if t.name in read_topics
            for p in range(t.config.partitions)
        ]
        if with_groups
        else []
    )
    replies = yield steps + group_info_steps + per_group
    result = NamespaceSnapshot(now_ms)
    at = 0
    for t in snapshots:
        parts = []
        batch = t.config.entry_format == "batch"
        per_stream = (3 if with_schedules else 1) + batch
        for p in range(t.config.partitions):
            key = keys.log(t.name, p)
            stream = replies[at : at + per_stream]
            parts.append(_stream(t.name, p, stream, nodes(key) if nodes else None, batch))
            at += per_stream
        result.topics[t.name] = TopicSnapshot(t.config, parts, t.groups)
    by_stream: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for t in snapshots:
        if t.name in read_topics:
            for p in range(t.config.partitions):
                by_stream[(t.name, p)] = stream_groups(replies[at], t.name, p)
                at += 1
    read = []
    for t, g in group_refs:
        size = group_step_count(t.config.partitions)
        topic = result.topics[t.name]
        read.append(
            group_from_replies(topic, g, replies[at : at + size], by_stream, result.topics, now_ms)
        )
        at += size
    read = yield from count_unknown_lags(keys, read, result.topics)
    for snapshot in read:
        result.groups[(snapshot.topic, snapshot.group)] = snapshot
    return result


def topic_snapshot(keys: KeySpace, topic: str, nodes: Any = None) -> Operation[NamespaceSnapshot]:
    """One topic with its groups (and their dead-letter topics' lengths); TopicNotFound."""
    validate_topic(topic)
    config = yield from read_config(keys, topic)
    if config is None:
        raise TopicNotFound(topic)
    groups = yield Command(("SMEMBERS", keys.groups(topic)))
    wanted = [topic] + [dlq_name(topic, text(g)) for g in groups]
    return (yield from namespace_snapshot(keys, topics=[t for t in wanted if t], nodes=nodes))


def group_snapshot(keys: KeySpace, topic: str, group: str) -> Operation[GroupSnapshot]:
    """One group (with its dead-letter topic's length; no other group of the topic is read);
    TopicNotFound / GroupNotFound."""
    snapshot = yield from group_and_topic(keys, topic, group)
    return snapshot.groups[(topic, group)]


def group_and_topic(keys: KeySpace, topic: str, group: str) -> Operation[NamespaceSnapshot]:
    """The topic's partitions and this one group of it (group_snapshot); TopicNotFound /
    GroupNotFound."""
    validate_topic(topic)
    validate_name("group", group)
    wanted = [topic, dlq_name(topic, group)]
    snapshot = yield from namespace_snapshot(
        keys, topics=[t for t in wanted if t], groups=[(topic, group)]
    )
    if topic not in snapshot.topics:
        raise TopicNotFound(topic)
    if (topic, group) not in snapshot.groups:
        raise GroupNotFound(topic, group)
    return snapshot
