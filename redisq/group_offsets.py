"""Resetting a consumer group's committed offsets (Kafka's kafka-consumer-groups
--reset-offsets; re-exported by redisq.group).

A group's committed position on a partition is its Redis consumer group's last-delivered-id: the
last entry counted as handled, the next read starts after it. A reset sets it with XGROUP SETID
(XGROUP CREATE on a partition the group never read), while no member runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from redisq.errors import InvalidConfig, PartitionOutOfRange
from redisq.group_admin import refuse_if_live, require_group, stream_group
from redisq.records import MAX_STREAM_ID, offset_after, offset_before, offset_parts

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.group")

COUNT_CAP = 100_000  # entries counted after a position, per partition

__all__ = ["OffsetReset", "reset_offsets"]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class OffsetReset:
    """What a reset did (or, dry run, would do) on one partition.

    before / after: the committed position, the last entry counted as handled ("0-0": none);
    the next read starts after it. before is None when the group had not read the partition
    yet. lag_before / lag_after: entries after each (None: more than COUNT_CAP, or unknown).
    pending_dropped: a concurrent group's entries delivered but not acknowledged, dropped by
    the reset."""

    partition: int
    before: str | None
    after: str
    lag_before: int | None
    lag_after: int | None
    pending_dropped: int


def reset_offsets(
    broker: Broker,
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
) -> list[OffsetReset]:
    """Move a group's committed position on its partitions (Kafka's kafka-consumer-groups
    --reset-offsets); exactly one target:

    to_earliest   read every retained message again
    to_latest     skip to the end: only messages appended from now on are read
    to_datetime   read from the first message appended at or after it (a datetime, naive =
                  local time, or epoch milliseconds)
    to_offset     read from this stream ID on (the first entry at or after it)
    shift_by      move by N entries: +N skips N, -N reads the last N handled again

    Targets are clamped to the partition (before the first entry, after the last). The new
    position is the whole truth afterwards, as a Kafka offset is: a concurrent group's pending
    entries are dropped (those after the new position are delivered again, those before it
    count as done), and held messages (park_key) at or before it are dropped; parked keys stay
    parked. partitions picks some (default: all). dry_run computes and changes nothing.

    Refused with GroupInUse while the group has live members or a partition lease is held,
    as Kafka refuses for an active group. TopicNotFound / GroupNotFound /
    PartitionOutOfRange."""
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
    count = require_group(broker, topic, group)
    selected = sorted(set(partitions)) if partitions is not None else list(range(count))
    for p in selected:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < count:
            raise PartitionOutOfRange(topic, p, count)
    if not dry_run:
        refuse_if_live(broker, topic, group, count, "reset its offsets")
    meta = broker.client.hget(broker.keys.group_meta(topic, group), "start_id")
    start_id = _text(meta) or "0"
    results = []
    for p in selected:
        stream = broker.keys.log(topic, p)
        info = broker.client.xinfo_stream(stream)
        last = _text(info.get("last-generated-id")) or "0-0"
        entry = stream_group(broker, stream, group)
        before = _text(entry.get("last-delivered-id")) if entry else None
        base = before if before is not None else _start_position(broker, stream, start_id)
        if to_earliest:
            after = "0-0"
        elif to_latest:
            after = last
        elif time_ms is not None:
            after = _last_before(broker, stream, f"{time_ms}-0")
        elif to_offset is not None:
            after = _last_before(broker, stream, to_offset)
        else:
            after = _shift(broker, stream, base, shift_by or 0)
        lag_before = _lag(broker, stream, entry, base, last)
        lag_after = _count_capped(broker, stream, after, last)
        pending = int(entry.get("pending", 0)) if entry else 0
        if not dry_run:
            _set_position(broker, topic, p, group, entry, after, info, lag_after, pending)
        results.append(OffsetReset(p, before, after, lag_before, lag_after, pending))
    if not dry_run:
        log.info("reset %s of %s (%s): %s", group, topic, chosen[0], results)
    return results


def _set_position(
    broker: Broker,
    topic: str,
    p: int,
    group: str,
    entry: dict[str, Any] | None,
    after: str,
    info: dict[str, Any],
    lag_after: int | None,
    pending: int,
) -> None:
    """XGROUP SETID (CREATE when the group never read the partition), with ENTRIESREAD when the
    entries after the position were counted (so XINFO GROUPS shows the lag); pending entries
    are acknowledged first; state tied to the old position goes."""
    client = broker.client
    keys = broker.keys
    stream = keys.log(topic, p)
    added = info.get("entries-added")
    entries_read = None
    if lag_after is not None and added is not None and not info.get("max-deleted-entry-id"):
        entries_read = max(int(added) - lag_after, 0)
    if entry is None:
        client.xgroup_create(stream, group, id=after, entries_read=entries_read)
    else:
        while pending:
            ids = [
                e["message_id"]
                for e in client.xpending_range(stream, group, min="-", max="+", count=1000)
            ]
            if not ids:
                break
            client.xack(stream, group, *ids)
        client.xgroup_setid(stream, group, after, entries_read=entries_read)
    state = keys.group_partition_state(topic, p, group)
    fields = ("blocked_offset", "blocked_error", "blocked_attempts", "takeover_position")
    client.hdel(state, *fields, "takeovers")
    held = keys.held_messages(topic, p, group)
    done = [
        offset
        for offset in (_text(o) for o in client.hkeys(held))
        if offset is not None and offset_parts(offset) <= offset_parts(after)
    ]
    if done:
        client.hdel(held, *done)


def _start_position(broker: Broker, stream: str, start_id: str) -> str:
    """Where a group that has not read the partition yet would start (join_group's start id:
    "0", or "<created_ms>-0" for a group that starts at the latest)."""
    return "0-0" if start_id in ("0", "0-0") else _last_before(broker, stream, start_id)


def _last_before(broker: Broker, stream: str, offset: str) -> str:
    """The position from which the next read starts at the first entry at or after offset."""
    if offset_parts(offset) == (0, 0):  # nothing comes before it ("(0-0" is no valid bound)
        return "0-0"
    before = offset_before(offset)
    if before is None:
        return "0-0"
    entries = broker.client.xrevrange(stream, max=before, min="-", count=1)
    return _entry_id(entries[0]) if entries else "0-0"


def _entry_id(entry: Any) -> str:
    return _text(entry[0]) or "0-0"


def _shift(broker: Broker, stream: str, base: str, by: int) -> str:
    if by:  # clamped to the partition: a COUNT beyond it is refused by the server (int64)
        length = int(broker.client.xlen(stream))
        by = max(min(by, length + 1), -(length + 1))
    if by > 0:
        first = offset_after(base)
        if first is None:  # base is the largest stream ID: nothing comes after it
            return base
        entries = broker.client.xrange(stream, min=first, max="+", count=by)
        return _entry_id(entries[-1]) if entries else base
    if by < 0:  # the entries at or before base, newest first: base's own entry comes first
        entries = broker.client.xrevrange(stream, max=base, min="-", count=-by + 1)
        return _entry_id(entries[-by]) if len(entries) > -by else "0-0"
    return base


def _lag(
    broker: Broker, stream: str, entry: dict[str, Any] | None, base: str, last: str
) -> int | None:
    if entry is not None and entry.get("lag") is not None:
        return int(entry["lag"])
    return _count_capped(broker, stream, base, last)


def _count_capped(broker: Broker, stream: str, after: str, last: str) -> int | None:
    """Entries after `after` up to the stream's last ID, counted inside the server (count_range
    takes an exclusive end: the ID after the last); None past COUNT_CAP. No ID comes after the
    largest: nothing is after it, and an entry at it is counted apart."""
    first = offset_after(after)
    if first is None:
        return 0
    end = offset_after(last)
    count, _last = broker.scripts.call(
        "count_range", [stream], [first, end or MAX_STREAM_ID, COUNT_CAP + 1], topic=stream
    )
    count = int(count)
    if end is None and broker.client.xrange(stream, min=MAX_STREAM_ID, max=MAX_STREAM_ID):
        count += 1
    return None if count > COUNT_CAP else count


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
