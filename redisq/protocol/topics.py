"""Topic administration, written once as protocol operations (generators of steps) that the
sync Broker and the asyncio broker both drive (see redisq.protocol.run_operation).

Every check that can fail runs before anything is written: an invalid name, a parameter out of
range, a topic that exists (or does not) raise a typed error and leave Redis as it was.
"""

from __future__ import annotations

import secrets
from typing import Any

from redisq.errors import InvalidConfig, TopicExists, TopicInUse, TopicNotFound, check_int
from redisq.model.counting import entries_to_keep, retained_messages
from redisq.model.fields import parse_id_field
from redisq.model.keys import KeySpace, validate_topic
from redisq.model.offsets import MAX_STREAM_ID_PART, offset_after, offset_parts
from redisq.model.topic import (
    DEFAULT_DEDUP_WINDOW_MS,
    DEFAULT_ENTRY_FORMAT,
    DEFAULT_PRODUCER_STATE_TTL_MS,
    ENTRY_FORMATS,
    MAX_TOPIC_SETTING,
    STORED_ENTRY_FORMAT,
    PartitionInfo,
    TopicConfig,
    TopicDescription,
)
from redisq.protocol import Command, Operation, Step, optional_text, text
from redisq.protocol import admin as scripts

MAX_PARTITIONS = 4096


def fields(reply: Any) -> dict[str, Any]:
    """A raw field/value reply (RESP2 flat list or RESP3 map) as a dict with str keys."""
    if isinstance(reply, dict):
        return {text(k): v for k, v in reply.items()}
    it = iter(reply or ())
    return {text(k): v for k, v in zip(it, it, strict=True)}


def server_ms(reply: Any) -> int:
    """A TIME reply in milliseconds."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def read_config(keys: KeySpace, topic: str) -> Operation[TopicConfig | None]:
    """The topic's metadata, or None if it does not exist."""
    raw = yield Command(("HGETALL", keys.topic_meta(topic)))
    raw = raw if isinstance(raw, dict) else dict(zip(raw[0::2], raw[1::2], strict=True))
    return TopicConfig.from_hash(topic, raw) if raw else None


def topic_config(keys: KeySpace, topic: str) -> Operation[TopicConfig]:
    """The topic's metadata; TopicNotFound if it does not exist."""
    validate_topic(topic)
    config = yield from read_config(keys, topic)
    if config is None:
        raise TopicNotFound(topic)
    return config


def check_entry_format(entry_format: object) -> None:
    if entry_format not in ENTRY_FORMATS:
        raise InvalidConfig(
            f"entry_format={entry_format!r}: one of {', '.join(map(repr, ENTRY_FORMATS))}"
        )


def entry_format_for(asked: str | None, fakeredis: bool) -> str:
    """The entry format a new topic gets: the one asked for, else DEFAULT_ENTRY_FORMAT (batch
    entries), message entries on fakeredis, which cannot hold batch entries (its Lua has no
    `struct`, it has no XSETID): asking for them there is an InvalidConfig, before anything
    is written."""
    if asked is None:
        return STORED_ENTRY_FORMAT if fakeredis else DEFAULT_ENTRY_FORMAT
    check_entry_format(asked)
    if asked == "batch" and fakeredis:
        raise InvalidConfig(
            "entry_format='batch': fakeredis cannot hold batch entries (its Lua has no struct "
            "library); use entry_format='message' or a real Redis/Valkey server"
        )
    return asked


def create_topic(
    keys: KeySpace,
    topic: str,
    partitions: int = 1,
    *,
    retention_ms: int = 0,
    retention_messages: int = 0,
    dedup_window_ms: int | None = None,
    producer_state_ttl_ms: int = DEFAULT_PRODUCER_STATE_TTL_MS,
    exist_ok: bool = False,
    entry_format: str = STORED_ENTRY_FORMAT,
) -> Operation[TopicConfig]:
    """Create the partition streams, then the metadata (so a topic that can be described can
    also be written). With exist_ok, an existing topic is returned as it is."""
    validate_topic(topic)
    check_int("partitions", partitions, minimum=1, maximum=MAX_PARTITIONS)
    check_int("retention_ms", retention_ms, 0, MAX_TOPIC_SETTING)
    check_int("retention_messages", retention_messages, 0, MAX_TOPIC_SETTING)
    check_int("producer_state_ttl_ms", producer_state_ttl_ms, 1000, MAX_TOPIC_SETTING)
    if dedup_window_ms is None:
        dedup_window_ms = retention_ms or DEFAULT_DEDUP_WINDOW_MS
    check_int("dedup_window_ms", dedup_window_ms, 1000, MAX_TOPIC_SETTING)
    check_entry_format(entry_format)
    existing = yield from read_config(keys, topic)
    if existing is not None:
        if exist_ok:
            return existing
        raise TopicExists(topic)
    now = yield Command(("TIME",), server_ms)
    config = TopicConfig(
        name=topic,
        partitions=partitions,
        retention_ms=retention_ms,
        retention_messages=retention_messages,
        dedup_window_ms=dedup_window_ms,
        producer_state_ttl_ms=producer_state_ttl_ms,
        created_ms=now,
        topic_id=secrets.token_hex(8),
        entry_format=entry_format,
    )
    created = yield [scripts.create_partition(keys, topic, p) for p in range(partitions)]
    _raise_first(created)
    try:
        yield scripts.create_topic(keys, config)
    except TopicExists:  # created concurrently
        if exist_ok:
            return (yield from topic_config(keys, topic))
        raise
    return config


def add_partitions(keys: KeySpace, topic: str, partitions: int) -> Operation[TopicConfig]:
    """Grow a topic (never shrink): the new streams first, then the count."""
    config = yield from topic_config(keys, topic)
    check_int("partitions", partitions, minimum=1, maximum=MAX_PARTITIONS)
    if partitions <= config.partitions:
        raise InvalidConfig(
            f"partitions={partitions}: topic {topic!r} has {config.partitions}; "
            "partitions can only be added"
        )
    created = yield [
        scripts.create_partition(keys, topic, p) for p in range(config.partitions, partitions)
    ]
    _raise_first(created)
    try:
        yield scripts.grow_topic(keys, topic, partitions)
    except Exception as exc:
        if str(exc).startswith("PARTITIONS_NOT_GREATER"):  # grown concurrently
            raise InvalidConfig(f"topic {topic!r}: {exc}") from None
        raise
    return (yield from topic_config(keys, topic))


def describe_topic(
    keys: KeySpace, topic: str, nodes: dict[int, str] | None = None
) -> Operation[TopicDescription]:
    """Partitions with their lengths and first/last offsets, and their delayed messages (how
    many are scheduled, when the next is due): XINFO STREAM, ZCARD and the first of the
    schedule per partition, pipelined, one round trip in all. nodes: partition -> the cluster
    node serving it."""
    config = yield from topic_config(keys, topic)
    n = config.partitions
    steps: list[Step] = [Command(("XINFO", "STREAM", keys.log(topic, p)), fields) for p in range(n)]
    steps += [Command(("ZCARD", keys.scheduled(topic, p)), int) for p in range(n)]
    steps += [Command(("ZRANGE", keys.scheduled(topic, p), 0, 0, "WITHSCORES")) for p in range(n)]
    batch = config.entry_format == "batch"
    if batch:  # the messages appended, as the produce scripts count them (DESIGN §14.6)
        steps += [Command(("HGET", keys.counts(topic, p), "m"), parse_id_field) for p in range(n)]
    replies = yield steps
    _raise_first(replies)
    infos, scheduled, firsts = replies[:n], replies[n : 2 * n], replies[2 * n : 3 * n]
    partitions = []
    for p, info in enumerate(infos):
        first, last = info.get("first-entry"), info.get("last-entry")
        length = int(info.get("length", 0))
        held = retained_messages(replies[3 * n + p], length, first) if batch else length
        partitions.append(
            PartitionInfo(
                partition=p,
                length=length,
                first_offset=optional_text(first[0]) if first else None,
                last_offset=optional_text(last[0]) if last else None,
                node=(nodes or {}).get(p),
                scheduled=scheduled[p],
                next_due_ms=_first_score(firsts[p]),
                messages=held,
                counted=replies[3 * n + p] if batch else None,
            )
        )
    return TopicDescription(config=config, partitions=partitions)


def _first_score(reply: Any) -> int | None:
    """The score of ZRANGE ... 0 0 WITHSCORES (RESP2 [member, score], RESP3 [[member, score]])."""
    if not reply:
        return None
    pair = reply[0] if isinstance(reply[0], list | tuple) else reply
    return int(float(pair[1]))


READ_OPEN_BOUNDS = ("-", "+")


def check_read(
    start: object, end: object, count: object, batch: object, on_malformed: object
) -> None:
    """The arguments of Broker.read (sync and asyncio), checked before the first XRANGE: start
    and end are "-", "+", a stream ID (offsets.offset_parts; "<ms>" alone is the whole
    millisecond, as XRANGE reads it) or "(" and an ID (exclusive)."""
    if on_malformed not in ("yield", "raise"):
        raise InvalidConfig(f"on_malformed={on_malformed!r}: expected 'yield' or 'raise'")
    _check_read_bound("start", start)
    _check_read_bound("end", end)
    if count is not None:
        check_int("count", count, 0)
    check_int("batch", batch, 1, 100_000)


def read_cuts(start: str, end: str) -> tuple[tuple[str, bool] | None, str | None]:
    """Broker.read's checked bounds as the cuts of batch entries (DESIGN §14.7): (the start
    position and whether it is inclusive, for the entry that may hold it; None from the first
    entry), and the exclusive end offset of the messages to keep (None: to the last)."""
    head: tuple[str, bool] | None = None
    if start not in READ_OPEN_BOUNDS:
        offset = start.removeprefix("(")
        if "-" not in offset:  # "<ms>": the whole millisecond
            head = (f"{offset}-0", True)
        else:
            head = (offset, not start.startswith("("))
    upto: str | None = None
    if end not in READ_OPEN_BOUNDS:
        offset = end.removeprefix("(")
        if end.startswith("("):
            upto = offset if "-" in offset else f"{offset}-0"
        elif "-" not in offset:
            upto = f"{int(offset) + 1}-0"
        else:
            upto = offset_after(offset)
    return head, upto


def _check_read_bound(name: str, bound: object) -> None:
    if not isinstance(bound, str):
        raise TypeError(f"{name} must be a stream ID str, not {type(bound).__name__}")
    if bound in READ_OPEN_BOUNDS:
        return
    offset = bound.removeprefix("(")
    try:
        ms, seq = offset_parts(offset)
    except ValueError:
        raise InvalidConfig(
            f"{name}={bound!r}: expected a stream ID <ms>-<seq>, '-' or '+' (or '(' and an ID, "
            "exclusive)"
        ) from None
    if offset != bound:  # exclusive: XRANGE refuses a bound with no ID on its open side
        nothing = (
            (ms, seq) == (MAX_STREAM_ID_PART, MAX_STREAM_ID_PART)
            if name == "start"
            else (ms, seq) == (0, 0) and "-" in offset
        )
        if nothing:
            raise InvalidConfig(f"{name}={bound!r}: no stream ID lies beyond it")


def list_topics(keys: KeySpace) -> Operation[list[str]]:
    members = yield Command(("SMEMBERS", keys.topics()))
    return sorted(text(m) for m in members)


# A member that beat within this long counts as live for delete_topic (the default session
# timeout is 30 s; a group's own timeout is not stored).
LIVE_MEMBER_MS = 60_000


def topic_groups(keys: KeySpace, topic: str) -> Operation[list[str]]:
    """The names of the topic's consumer groups."""
    members = yield Command(("SMEMBERS", keys.groups(topic)))
    return sorted(text(m) for m in members)


def delete_topic(
    keys: KeySpace, topic: str, *, force: bool = False
) -> Operation[tuple[int, list[str]]]:
    """Remove the metadata (producers are refused from then on) and the topic's groups (their
    settings, members and registry); returns (the partition count, the group names): the caller
    then deletes every key of the partitions (they may sit on every node of a cluster) and the
    groups' dead-letter topics. Refused with TopicInUse while a group has live members, unless
    force: their next read, commit or lease renewal then finds nothing."""
    validate_topic(topic)
    groups = yield from topic_groups(keys, topic)
    if not force and groups:
        now = yield Command(("TIME",), server_ms)
        live = yield [
            Command(("ZRANGEBYSCORE", keys.group_members(topic, g), now - LIVE_MEMBER_MS, "+inf"))
            for g in groups
        ]
        for group, members in zip(groups, live, strict=True):
            if isinstance(members, Exception):
                raise members
            if members:
                raise TopicInUse(topic, group, [text(m) for m in members])
    partitions = yield scripts.delete_topic(keys, topic)
    doomed: list[str] = [keys.groups(topic)]
    for group in groups:
        doomed += [keys.group_meta(topic, group), keys.group_members(topic, group)]
    yield Command(("DEL", *doomed), int)
    return partitions, groups


def trim(keys: KeySpace, topic: str) -> Operation[int]:
    """Apply the topic's retention to every partition now (exact trims); entries removed."""
    config = yield from topic_config(keys, topic)
    for name in ("retention_ms", "retention_messages"):  # stored by another client, or older
        value = getattr(config, name)
        if not 0 <= value <= MAX_TOPIC_SETTING:
            raise InvalidConfig(
                f"topic {topic!r}: {name}={value} is out of range: 0..{MAX_TOPIC_SETTING}"
            )
    now = yield Command(("TIME",), server_ms)
    keep = [config.retention_messages] * config.partitions
    if config.retention_messages and config.entry_format == "batch":
        keep = yield from _batch_entries_to_keep(keys, config)
    steps: list[Step] = []
    for p in range(config.partitions):
        key = keys.log(topic, p)
        if config.retention_messages:
            steps.append(Command(("XTRIM", key, "MAXLEN", keep[p]), int))
        if config.retention_ms and now > config.retention_ms:
            steps.append(Command(("XTRIM", key, "MINID", now - config.retention_ms), int))
    removed = yield steps
    _raise_first(removed)
    return sum(removed)


def _batch_entries_to_keep(keys: KeySpace, config: TopicConfig) -> Operation[list[int]]:
    """A batch topic's entries to keep per partition for about retention_messages messages
    (model.counting.entries_to_keep, as the produce scripts trim): one round trip."""
    steps: list[Step] = []
    for p in range(config.partitions):
        steps += [
            Command(("HGET", keys.counts(config.name, p), "m"), parse_id_field),
            Command(("XINFO", "STREAM", keys.log(config.name, p)), fields),
        ]
    replies = yield steps
    _raise_first(replies[0::2])
    keep = []
    for p in range(config.partitions):
        counted, info = replies[2 * p], replies[2 * p + 1]
        if isinstance(info, Exception):  # no stream (deleted meanwhile): XTRIM removes nothing
            keep.append(config.retention_messages)
            continue
        keep.append(
            entries_to_keep(
                config.retention_messages,
                counted,
                int(info.get("length", 0)),
                info.get("first-entry"),
                info.get("last-entry"),
            )
        )
    return keep


def _raise_first(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, Exception):
            raise result
