"""Resetting a consumer group's committed offsets (Kafka's kafka-consumer-groups
--reset-offsets), written once as a protocol operation that both brokers run
(`Broker.reset_offsets`; the CLI's `group reset-offsets` and the console's Reset call it).

A group's committed position on a partition is its Redis consumer group's last-delivered-id: the
last entry counted as handled, the next read starts after it. A reset reads every selected
partition (pipelined), computes its new position, then writes each with reset_position.lua,
which refuses while the partition's lease is held, or when the position moved since it was
read, in the same step as its write. A member that joins while a reset runs therefore either
loads the new position when it is granted the lease, or makes the reset fail with GroupInUse:
it can never undo a reset that returned (it used to, writing back the old position it had
loaded with its next commit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redisq.errors import GroupInUse, InvalidConfig, PartitionOutOfRange, read_reply
from redisq.model.counting import batch_counts
from redisq.model.groups import OffsetReset
from redisq.model.keys import KeySpace
from redisq.model.offsets import (
    MAX_STREAM_ID,
    offset_after,
    offset_before,
    offset_parts,
)
from redisq.protocol import Command, Operation, ScriptCall, Step, optional_text, text
from redisq.protocol.admin import count_range
from redisq.protocol.group_view import (
    COUNT_CAP,
    start_id_of,
    start_position,
    stream_groups,
    unread_lag,
)
from redisq.protocol.groups import lease_holders, live_members, refuse_if_live, require_group
from redisq.protocol.topics import fields, topic_config

log = logging.getLogger("redisq.group")

__all__ = ["OffsetReset", "PositionWrite", "reset_offsets", "reset_position"]


# -- the script ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PositionWrite:
    """reset_position.lua's answer: applied, or refused because a lease is held (holder: its
    lease value) or because the position is no longer the one the reset was computed from
    (moved_to: the position found, "" for no consumer group)."""

    applied: bool
    pending_dropped: int = 0
    holder: str | None = None
    moved_to: str | None = None


def _position_write(reply: Any) -> PositionWrite:
    status, detail = int(reply[0]), reply[1]
    if status == 1:
        return PositionWrite(True, pending_dropped=int(detail))
    if status == 0:
        return PositionWrite(False, holder=text(detail))
    return PositionWrite(False, moved_to=text(detail))


def reset_position(
    keys: KeySpace,
    topic: str,
    partition: int,
    group: str,
    expected: str | None,
    position: str,
    entries_read: int | None,
) -> ScriptCall[PositionWrite]:
    """reset_position.lua: set the group's position on one partition to `position`, unless a
    lease is held or the position is no longer `expected` (None: the group had no Redis
    consumer group on the stream). TopicNotFound when the partition stream is gone."""
    return ScriptCall(
        "reset_position",
        (
            keys.log(topic, partition),
            keys.lease(topic, partition, group),
            keys.group_partition_state(topic, partition, group),
            keys.held_messages(topic, partition, group),
            keys.settled_messages(topic, partition, group),
        ),
        (
            group,
            expected or "",
            position,
            "" if entries_read is None else entries_read,
        ),
        _position_write,
        topic,
        retry_safe=False,  # a second run after the first applied answers that the position moved
    )


# -- the operation -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Partition:
    """What the reset read of one partition, and what it computed."""

    partition: int
    info: dict[str, Any]
    before: str | None  # the committed position (None: the group never read the partition)
    base: str  # where the group stands: before, or where it would start
    last: str  # the stream's last-generated-id
    lag_before: int | None = None
    lag_known: bool = False
    after: str = "0-0"
    lag_after: int | None = None
    pending: int = 0


def reset_offsets(
    keys: KeySpace,
    topic: str,
    group: str,
    *,
    to_earliest: bool = False,
    to_latest: bool = False,
    to_datetime: datetime | int | None = None,
    to_offset: str | None = None,
    shift_by: int | None = None,
    partitions: Sequence[int] | None = None,
    dry_run: bool = False,
) -> Operation[list[OffsetReset]]:
    """Move a group's committed position on its partitions (Kafka's kafka-consumer-groups
    --reset-offsets); exactly one target:

    to_earliest   read every retained message again
    to_latest     skip to the end: only messages appended from now on are read
    to_datetime   read from the first message appended at or after it (a datetime, naive =
                  local time, or epoch milliseconds)
    to_offset     read from this stream ID on (the first entry at or after it)
    shift_by      move by N entries: +N skips N, -N reads the last N handled again

    On a topic of batch entries (entry_format="batch") a position lands at the end of an
    entry, so that a batch is read whole or not at all: to_offset and to_datetime start at
    the batch that holds the offset, shift_by moves by whole batches, and the lags count
    messages.

    Targets are clamped to the partition (before the first entry, after the last). The new
    position is the whole truth afterwards, as a Kafka offset is: a concurrent group's pending
    entries are dropped (those after the new position are delivered again, those before it
    count as done), and held messages (park_key) at or before it are dropped; parked keys stay
    parked. partitions picks some (default: all). dry_run computes and changes nothing.

    Refused with GroupInUse while the group has live members or a partition lease is held,
    as Kafka refuses for an active group; the lease is checked again by the write itself, so
    a member that takes a partition while the reset runs makes it fail rather than undo it
    (the partitions written before that keep their new position: the error names them).
    TopicNotFound / GroupNotFound / PartitionOutOfRange."""
    targets = {
        "to_earliest": to_earliest or None,
        "to_latest": to_latest or None,
        "to_datetime": to_datetime,
        "to_offset": to_offset,
        "shift_by": shift_by,
    }
    chosen = [name for name, value in targets.items() if value is not None]
    if len(chosen) != 1:
        raise InvalidConfig(
            "reset_offsets needs exactly one of to_earliest, to_latest, to_datetime, "
            f"to_offset, shift_by (got {', '.join(chosen) or 'none'})"
        )
    if to_offset is not None:
        to_offset = _check_offset(to_offset)
    if shift_by is not None and (isinstance(shift_by, bool) or not isinstance(shift_by, int)):
        raise TypeError(f"shift_by must be an int, not {type(shift_by).__name__}")
    time_ms = _epoch_ms(to_datetime) if to_datetime is not None else None
    count = yield from require_group(keys, topic, group)
    batch = (yield from topic_config(keys, topic)).entry_format == "batch"
    selected = sorted(set(partitions)) if partitions is not None else list(range(count))
    for p in selected:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < count:
            raise PartitionOutOfRange(topic, p, count)
    if not dry_run:
        yield from refuse_if_live(keys, topic, group, count, "reset its offsets")
    read = yield from _read_partitions(keys, topic, group, selected, batch)

    bound = f"{time_ms}-0" if time_ms is not None else to_offset
    finish: list[Callable[[Any], str]] = []
    steps: list[Step] = []
    for part in read:
        stream = keys.log(topic, part.partition)
        if to_earliest:
            step, done = None, _fixed("0-0")
        elif to_latest:
            step, done = None, _fixed(part.last)
        elif bound is not None:
            step, done = _last_before(stream, bound)
        else:
            step, done = _shift(stream, part.base, shift_by or 0, int(part.info.get("length", 0)))
        if step is not None:
            steps.append(step)
        finish.append(done)
    replies = iter((yield steps) if steps else [])
    for part, done in zip(read, finish, strict=True):
        part.after = done(replies)
    yield from _count_lags(keys, topic, read, batch)

    if dry_run:
        return [_result(part) for part in read]
    writes = yield [
        reset_position(
            keys,
            topic,
            part.partition,
            group,
            part.before,
            part.after,
            None if batch else _entries_read(part),  # a batch topic's lags count messages
        )
        for part in read
    ]
    yield from _check_writes(keys, topic, group, count, read, writes)
    log.info("reset %s of %s (%s): %s", group, topic, chosen[0], [_result(p) for p in read])
    return [_result(part) for part in read]


def _read_partitions(
    keys: KeySpace, topic: str, group: str, selected: list[int], batch: bool
) -> Operation[list[_Partition]]:
    """The group's start, and per partition XINFO STREAM and XINFO GROUPS (one round trip).
    batch: XINFO's lags count entries, so only an empty partition's is taken (0)."""
    steps: list[Step] = [Command(("HGET", keys.group_meta(topic, group), "start_id"))]
    for p in selected:
        steps += [
            Command(("XINFO", "STREAM", keys.log(topic, p))),
            Command(("XINFO", "GROUPS", keys.log(topic, p))),
        ]
    replies = yield steps
    where = f"group {group!r} of topic {topic!r}"
    start_id = start_id_of(optional_text(read_reply(replies[0], f"{where} (settings)")))
    read = []
    for i, p in enumerate(selected):
        info = fields(read_reply(replies[1 + 2 * i], f"topic {topic!r} partition {p}"))
        entry = stream_groups(replies[2 + 2 * i], topic, p).get(group)
        first, last = info.get("first-entry"), info.get("last-entry")
        first_offset = optional_text(first[0]) if first else None
        last_offset = optional_text(last[0]) if last else None
        before = optional_text(entry.get("last-delivered-id")) if entry else None
        part = _Partition(
            partition=p,
            info=info,
            before=before,
            base=before if before is not None else start_position(start_id, last_offset),
            last=optional_text(info.get("last-generated-id")) or "0-0",
            pending=int(entry.get("pending") or 0) if entry else 0,
        )
        length = int(info.get("length", 0))
        if batch and length:  # counted in messages (_count_lags), unless at the end
            part.lag_known = part.base == part.last
            part.lag_before = 0 if part.lag_known else None
        elif entry is not None and entry.get("lag") is not None:
            part.lag_before, part.lag_known = int(entry["lag"]), True
        elif entry is None:
            part.lag_before = unread_lag(start_id, length, first_offset, last_offset)
            part.lag_known = part.lag_before is not None
        read.append(part)
    return read


# -- targets: each a step to send (or None) and what its reply makes the new position -----------
Target = tuple[Step | None, Callable[[Any], str]]


def _fixed(position: str) -> Callable[[Any], str]:
    return lambda _replies: position


def _entry_id(entry: Any) -> str:
    """A position at this entry: its ID, or a batch entry's last offset (read whole or not)."""
    entry_id = optional_text(entry[0]) or "0-0"
    counts = batch_counts(entry[1]) if len(entry) > 1 else None
    if counts is None or counts[0] < 2:
        return entry_id
    return offset_after(entry_id, counts[0] - 1) or entry_id


def _last_before(stream: str, offset: str) -> Target:
    """The position from which the next read starts at the first entry at or after offset."""
    before = offset_before(offset) if offset_parts(offset) != (0, 0) else None
    if before is None:  # nothing comes before it ("(0-0" is no valid bound)
        return None, _fixed("0-0")

    def done(replies: Any) -> str:
        entries = read_reply(next(replies), f"{stream} (XREVRANGE)")
        if entries and offset_parts(_entry_id(entries[0])) >= offset_parts(offset):
            entries = entries[1:]  # a batch entry holding offset: it is read whole
        return _entry_id(entries[0]) if entries else "0-0"

    return Command(("XREVRANGE", stream, before, "-", "COUNT", 2)), done


def _shift(stream: str, base: str, by: int, length: int) -> Target:
    # Clamped to the partition: a COUNT beyond it is refused by the server (int64).
    by = max(min(by, length + 1), -(length + 1))
    if by > 0:
        first = offset_after(base)
        if first is None:  # base is the largest stream ID: nothing comes after it
            return None, _fixed(base)

        def forward(replies: Any) -> str:
            entries = read_reply(next(replies), f"{stream} (XRANGE)")
            return _entry_id(entries[-1]) if entries else base

        return Command(("XRANGE", stream, first, "+", "COUNT", by)), forward
    if by < 0:  # the entries at or before base, newest first: base's own entry comes first

        def back(replies: Any) -> str:
            entries = read_reply(next(replies), f"{stream} (XREVRANGE)")
            return _entry_id(entries[-by]) if len(entries) > -by else "0-0"

        return Command(("XREVRANGE", stream, base, "-", "COUNT", -by + 1)), back
    return None, _fixed(base)


# -- lags ----------------------------------------------------------------------------------------
def _count_lags(keys: KeySpace, topic: str, read: list[_Partition], batch: bool) -> Operation[None]:
    """lag_before where Redis could not tell it, and lag_after, counted inside the server up to
    the stream's last ID as read (count_range takes an exclusive end: the ID after the last),
    one round trip; None past COUNT_CAP. No ID comes after the largest: an entry at it is
    looked up apart. batch: messages are counted, not entries."""
    steps: list[Step] = []
    wanted: list[tuple[_Partition, str, int]] = []  # (partition, "before"/"after", its steps)
    for part in read:
        for which, after in (("before", part.base), ("after", part.after)):
            if which == "before" and part.lag_known:
                continue
            first = offset_after(after)
            if first is None:  # nothing can come after the largest stream ID
                wanted.append((part, which, 0))
                continue
            end = offset_after(part.last)
            call = count_range(
                keys, topic, part.partition, first, end or MAX_STREAM_ID, COUNT_CAP + 1, batch
            )
            steps.append(ScriptCall(call.script, call.keys, call.args, _counted, topic))
            if end is None:
                stream = keys.log(topic, part.partition)
                steps.append(Command(("XRANGE", stream, MAX_STREAM_ID, MAX_STREAM_ID), len))
            wanted.append((part, which, 1 if end is not None else 2))
    replies = iter((yield steps) if steps else [])
    for part, which, used in wanted:
        where = f"topic {topic!r} partition {part.partition} (counting its lag)"
        counted = sum(read_reply(next(replies), where) for _ in range(used))
        lag = None if counted > COUNT_CAP else counted
        if which == "before":
            part.lag_before = lag
        else:
            part.lag_after = lag


def _counted(reply: Any) -> int:
    return int(reply[0])


def _entries_read(part: _Partition) -> int | None:
    """ENTRIESREAD for the new position, so that XINFO GROUPS shows the lag at once: known when
    the entries after it were counted and the stream never had an entry deleted (XDEL) since
    entries-added counts them."""
    added = part.info.get("entries-added")
    deleted = optional_text(part.info.get("max-deleted-entry-id"))
    if part.lag_after is None or added is None or deleted not in (None, "0-0"):
        return None
    return max(int(added) - part.lag_after, 0)


def _result(part: _Partition) -> OffsetReset:
    return OffsetReset(
        part.partition, part.before, part.after, part.lag_before, part.lag_after, part.pending
    )


def _check_writes(
    keys: KeySpace,
    topic: str,
    group: str,
    count: int,
    read: list[_Partition],
    writes: list[Any],
) -> Operation[None]:
    """GroupInUse, naming what was and was not reset, when a write was refused; what the
    writes dropped is the truth of pending_dropped."""
    refused: list[int] = []
    holders: set[str] = set()
    for part, write in zip(read, writes, strict=True):
        if isinstance(write, Exception):
            raise write
        if write.applied:
            part.pending = write.pending_dropped
            continue
        refused.append(part.partition)
        holders.update(lease_holders(write.holder))
    if not refused:
        return
    if not holders:  # the position moved under the reset: whoever moved it may have left
        holders.update((yield from live_members(keys, topic, group, count)))
    done = [p.partition for p in read if p.partition not in refused]
    note = (
        f"a member took or moved {_partitions(refused)} while the reset ran: not reset there; "
        + (f"{_partitions(done)} reset" if done else "nothing reset")
    )
    members = sorted(holders) or ["a member that has left"]
    raise GroupInUse(topic, group, members, "reset its offsets", note)


def _partitions(numbers: list[int]) -> str:
    return ("partition " if len(numbers) == 1 else "partitions ") + ", ".join(map(str, numbers))


# -- arguments -----------------------------------------------------------------------------------
def _check_offset(offset: object) -> str:
    """A stream ID as "<ms>-<seq>" ("<ms>" means "<ms>-0")."""
    if not isinstance(offset, str):
        raise TypeError(f"to_offset must be a stream ID str, not {type(offset).__name__}")
    try:
        ms, seq = offset_parts(offset)
    except ValueError:
        raise InvalidConfig(f"to_offset={offset!r}: expected a stream ID <ms>-<seq>") from None
    return f"{ms}-{seq}"


def _epoch_ms(when: datetime | int) -> int:
    if isinstance(when, datetime):
        ms = int(when.timestamp() * 1000)  # a naive datetime is local time, as in Kafka
        if ms < 0:  # stream IDs start at 1970-01-01T00:00:00Z
            raise InvalidConfig(f"to_datetime={when.isoformat()}: before 1970-01-01T00:00:00Z")
        return ms
    if isinstance(when, bool) or not isinstance(when, int) or when < 0:
        raise InvalidConfig(f"to_datetime={when!r}: a datetime or epoch milliseconds >= 0")
    return when
