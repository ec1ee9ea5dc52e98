"""One consumer group as the views read it: the commands that read its state on every partition,
their decoding, and its lag, in the pipelined round trips of redisq.protocol.overview.

Positions: an orderly group's committed position on a partition is its Redis consumer group's
last-delivered-id, so XINFO GROUPS gives the lag. When Redis cannot tell it (entries deleted
inside the range, a position set without entries-read), the entries after the position are
counted inside the server (count_range.lua, capped at COUNT_CAP) in one more round trip. A
partition the group has not read yet has no position: its lag is what its first reader will be
handed (`unread_lag`): everything for a group that starts at the earliest, what came after the
group was created for one that starts at the latest.

This module is the one place lag is computed: the namespace snapshot (the console, the
metrics), describe_group (`redisq group describe`, `redisq lag`) and the offset reset's lags all
take it from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from redis.exceptions import ResponseError

from redisq.errors import InvalidName, read_reply
from redisq.model.counting import batch_counts, messages_through
from redisq.model.keys import KeySpace, dead_letter_topic
from redisq.model.offsets import offset_after, offset_parts
from redisq.model.snapshots import GroupPartition, GroupSnapshot, PartitionSnapshot, TopicSnapshot
from redisq.protocol import Command, Operation, Step, optional_text, text
from redisq.protocol.admin import count_range
from redisq.protocol.group import parse_lease
from redisq.protocol.topics import fields

COUNT_CAP = 100_000  # entries counted after a position when Redis cannot tell the lag
END = "18446744073709551615-18446744073709551615"  # the greatest stream ID (count_range's end)

__all__ = [
    "COUNT_CAP",
    "count_unknown_lags",
    "group_from_replies",
    "group_step_count",
    "group_steps",
    "start_position",
    "stream_groups",
    "unread_lag",
]


# -- reply helpers (the overview's too) ------------------------------------------------------------
def stream_reply(reply: Any, what: str) -> Any:
    """XINFO STREAM / XINFO GROUPS: a stream deleted under the read (delete_topic between two
    round trips) answers 'no such key', which is nothing there; any other error is ReadFailed."""
    if isinstance(reply, ResponseError) and str(reply) == "no such key":
        return None
    return read_reply(reply, what)


def as_dict(reply: Any) -> dict[str, Any]:
    return {} if reply is None else fields(reply)


def as_int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _hash(reply: Any, what: str) -> dict[str, str]:
    return {k: text(v) for k, v in as_dict(read_reply(reply, what)).items()}


def scored(reply: Any, what: str) -> list[tuple[str, float]]:
    """ZRANGE ... WITHSCORES as (member, score) pairs (RESP2 flat, pairs, or RESP3)."""
    if not read_reply(reply, what):
        return []
    if isinstance(reply[0], list | tuple):
        return [(text(m), float(s)) for m, s in reply]
    it = iter(reply)
    return [(text(m), float(s)) for m, s in zip(it, it, strict=True)]


def stream_groups(reply: Any, topic: str, p: int) -> dict[str, dict[str, Any]]:
    """XINFO GROUPS by group name."""
    reply = stream_reply(reply, f"topic {topic!r} partition {p} (XINFO GROUPS)")
    if not reply:
        return {}
    found = {}
    for entry in reply:
        info = as_dict(entry)
        found[text(info.get("name"))] = info
    return found


def dlq_name(topic: str, group: str) -> str:
    try:
        return dead_letter_topic(topic, group)
    except InvalidName:  # past the length limit: this group cannot have one
        return ""


# -- groups --------------------------------------------------------------------------------------
_PER_PARTITION = 6


def group_step_count(partitions: int) -> int:
    return 2 + _PER_PARTITION * partitions


def group_steps(keys: KeySpace, topic: str, group: str, partitions: int) -> list[Step]:
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


def group_from_replies(
    topic: TopicSnapshot,
    group: str,
    replies: Sequence[Any],
    stream_groups: dict[tuple[str, int], dict[str, dict[str, Any]]],
    topics: dict[str, TopicSnapshot],
    now_ms: int,
) -> GroupSnapshot:
    where = f"group {group!r} of topic {topic.name!r}"
    meta = _hash(replies[0], f"{where} (settings)")
    start_id = start_id_of(meta.get("start_id"))
    members = sorted(
        (name, max(0, now_ms - int(score)))
        for name, score in scored(replies[1], f"{where} (members)")
    )
    partitions = []
    batch = topic.config.entry_format == "batch"
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
        if entry is None:  # the group has not read this partition yet
            lag: int | None = unread_lag(
                start_id, stream.length, stream.first_offset, stream.last_offset
            )
            if batch and stream.length:
                lag = None  # entries: the messages are counted below
            last_delivered = None
            entries_read = None
        else:
            raw_lag = entry.get("lag")
            lag = None if raw_lag is None else int(raw_lag)
            if batch and stream.length:
                lag = None  # XINFO's lag counts entries: the messages are counted below
            last_delivered = optional_text(entry.get("last-delivered-id"))
            read = entry.get("entries-read")
            entries_read = None if read is None else int(read)
        ttl_ms = as_int(ttl, -2) if lease else -2
        blocked_attempts = state.get("blocked_attempts")
        partitions.append(
            GroupPartition(
                partition=p,
                length=stream.length,
                last_delivered=last_delivered,
                entries_read=entries_read,
                lag=lag,
                lag_counted=False,
                pending=as_int(entry.get("pending")) if entry else 0,
                consumers=as_int(entry.get("consumers")) if entry else 0,
                holder=lease[1] if lease else None,
                token=lease[0] if lease else None,
                granted_ms=lease[2] if lease else None,
                lease_left_ms=ttl_ms if ttl_ms >= 0 else None,
                grants=as_int(fence),
                dead_letters=as_int(state.get("dead_letters")),
                malformed=as_int(state.get("malformed")),
                parked=as_int(parked),
                held=as_int(held),
                blocked_offset=state.get("blocked_offset"),
                blocked_error=state.get("blocked_error"),
                blocked_attempts=as_int(blocked_attempts) if blocked_attempts else None,
                takeovers=as_int(state.get("takeovers")),
            )
        )
    dlq = dlq_name(topic.name, group)
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
        start_id=start_id,
    )


def count_unknown_lags(
    keys: KeySpace, groups: list[GroupSnapshot], topics: Mapping[str, TopicSnapshot] | None = None
) -> Operation[list[GroupSnapshot]]:
    """Lags Redis could not tell, counted inside the server (one pipelined round trip; on a
    topic of batch entries, from its counters and the entry holding the position, DESIGN §14.6,
    else counting its messages)."""
    unknown = [
        (i, gp) for i, g in enumerate(groups) for gp in g.partitions if gp.lag is None and gp.length
    ]
    if not unknown:
        return groups
    steps: list[Step] = []
    for i, gp in unknown:  # counted after the position, or where an unread partition starts
        group = groups[i]
        stream = _batch_stream(topics, group.topic, gp.partition)
        start = _position(group, gp, stream)
        if stream is not None:  # the entry holding the position (none: before every entry)
            key = keys.log(group.topic, gp.partition)
            steps.append(Command(("XREVRANGE", key, start, "-", "COUNT", 1)))
            continue
        begin = "-" if offset_parts(start) == (0, 0) else offset_after(start)
        if begin is None:  # the largest stream ID: nothing can follow it (count 0 below)
            steps.append(Command(("ECHO", "0"), lambda _: (0, "")))
            continue
        steps.append(count_range(keys, group.topic, gp.partition, begin, END, COUNT_CAP + 1))
    counts = yield steps
    rebuilt = [list(g.partitions) for g in groups]
    recount: list[tuple[int, GroupPartition, str]] = []
    for (i, gp), result in zip(unknown, counts, strict=True):
        group = groups[i]
        where = f"topic {group.topic!r} partition {gp.partition}: group {group.group!r}'s lag"
        stream = _batch_stream(topics, group.topic, gp.partition)
        if stream is not None:
            lag, begin = _batch_lag(group, gp, stream, read_reply(result, where))
            if lag is None and begin is not None:
                recount.append((i, gp, begin))
            rebuilt[i][gp.partition] = replace(gp, lag=lag)
            continue
        rebuilt[i][gp.partition] = _counted(gp, result, where)
    if recount:  # batch topics whose counters cannot tell: their messages counted instead
        steps = [
            count_range(keys, groups[i].topic, gp.partition, begin, END, COUNT_CAP + 1, True)
            for i, gp, begin in recount
        ]
        counts = yield steps
        for (i, gp, _), result in zip(recount, counts, strict=True):
            where = f"topic {groups[i].topic!r} partition {gp.partition}"
            rebuilt[i][gp.partition] = _counted(
                gp, result, f"{where}: group {groups[i].group!r}'s lag"
            )
    return [replace(g, partitions=parts) for g, parts in zip(groups, rebuilt, strict=True)]


def _counted(gp: GroupPartition, result: Any, where: str) -> GroupPartition:
    """gp with the lag count_range counted (None past COUNT_CAP)."""
    count = int(read_reply(result, where)[0])
    lag = None if count > COUNT_CAP else count
    return replace(gp, lag=lag, lag_counted=lag is not None)


def _batch_stream(
    topics: Mapping[str, TopicSnapshot] | None, topic: str, partition: int
) -> PartitionSnapshot | None:
    """The partition of a topic of batch entries, as the snapshot read it (None otherwise)."""
    snapshot = (topics or {}).get(topic)
    if snapshot is None or snapshot.config.entry_format != "batch":
        return None
    return snapshot.partitions[partition]


def _position(group: GroupSnapshot, gp: GroupPartition, stream: PartitionSnapshot | None) -> str:
    """Where the group is on the partition: its Redis group's last-delivered-id, or where its
    first reader will start (start_position)."""
    if gp.last_delivered is not None:
        return gp.last_delivered
    if stream is None:
        return group.start_id
    return start_position(group.start_id, stream.last_offset)


def _batch_lag(
    group: GroupSnapshot, gp: GroupPartition, stream: PartitionSnapshot, reply: Any
) -> tuple[int | None, str | None]:
    """A batch topic's lag in messages: (its counters' m minus the messages up to the
    position, None) or, where they cannot tell, (None, the offset to count messages from)."""
    position = _position(group, gp, stream)
    # A concurrent group's position, and an unread partition's start, is an entry read whole
    whole = group.mode == "concurrent" or gp.last_delivered is None
    through: int | None
    if not reply:  # before every entry: everything the partition holds is ahead
        through = None if stream.messages is None else (stream.counted or 0) - stream.messages
        begin = "-"
    else:
        entry_id, flat = text(reply[0][0]), reply[0][1]
        through = messages_through(entry_id, flat, position, whole)
        counts = batch_counts(flat)
        skip = counts[0] if whole and counts is not None else 0
        begin = offset_after(position if not skip else entry_id, max(skip, 1)) or "-"
    if through is None or stream.counted is None:
        return None, begin
    return max(0, stream.counted - through), None


# -- the lag of a partition the group has not read -------------------------------------------------
def start_id_of(stored: str | None) -> str:
    """The group's stored start id (join_group.lua: "0", or "<created_ms>-<max seq>"); "0" for one
    that is not a stream ID (not written by redisq)."""
    try:
        return "0" if stored is None or offset_parts(stored) == (0, 0) else stored
    except ValueError:
        return "0"


def start_position(start_id: str, last_entry: str | None) -> str:
    """Where a group that has not read a partition yet starts on it, as its first reader creates
    its Redis consumer group there (ensure_group, lua/includes/group.lua): "0-0" for a group
    that starts at the earliest; for one that starts at the latest ("<created_ms>-<max seq>"),
    that ID, or the newest entry while no entry is newer than that millisecond (XGROUP CREATE
    ... $)."""
    start = offset_parts(start_id)
    if start == (0, 0):
        return "0-0"
    if last_entry is not None and offset_parts(last_entry)[0] <= start[0]:
        return last_entry
    return f"{start[0]}-{start[1]}"


def unread_lag(
    start_id: str, length: int, first_offset: str | None, last_offset: str | None
) -> int | None:
    """The lag of a group on a partition it has not read yet: the entries after its start
    position (start_position), which its first reader will be handed. None: entries lie on
    both sides of it, so the ones after it are counted (count_range, after start_id)."""
    position = offset_parts(start_position(start_id, last_offset))
    if position == (0, 0):
        return length
    if last_offset is None or offset_parts(last_offset) <= position:
        return 0
    if first_offset is not None and offset_parts(first_offset) > position:
        return length
    return None
