"""Counting messages on a topic of batch entries (DESIGN §14.6), with no I/O.

XLEN, XINFO's lag and entries-added count stream entries; on a batch topic an entry holds a
producer batch. The produce scripts keep the partition's counters (KeySpace.counts: m, the
messages, and e, the entries redisq appended) and stamp each batch entry with c, the messages
appended before it. From those and one entry:

- messages retained = m - c(first entry);
- messages up to a position P (at or before it): c(E) plus the messages of E up to P, with E the
  entry holding P (XREVRANGE <stream> P - COUNT 1); an entry delivered whole (a concurrent
  group's last-delivered-id, a group's start position) counts all of E's;
- lag = m - the messages up to the group's position.

Where an entry does not say (no c: written before the counters, a delayed message's entry, a
foreign one), these answer None and the caller counts instead (count_range.lua).
"""

from __future__ import annotations

import math
from typing import Any

from redisq.model.fields import parse_id_field
from redisq.model.offsets import offset_parts

__all__ = ["batch_counts", "entries_to_keep", "messages_through", "retained_messages"]


def batch_counts(flat: Any) -> tuple[int, int | None] | None:
    """(n, c) of a batch entry's fields (first field b, no v, a decimal n >= 1; c None when
    absent or not a decimal), or None for any other entry. flat: the fields as a dict or as a
    flat [name, value, ...] list, bytes names."""
    if type(flat) is dict:
        names = list(flat)
        if not names or names[0] != b"b" or b"v" in flat:
            return None
        fields = flat
    elif isinstance(flat, list | tuple) and flat and flat[0] == b"b":
        fields = dict(zip(flat[0::2], flat[1::2], strict=False))
        if b"v" in fields:
            return None
    else:
        return None
    raw = fields.get(b"n")
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 10 or int(raw) < 1:
        return None
    return int(raw), parse_id_field(fields.get(b"c"))


def messages_through(entry_id: str, flat: Any, position: str, whole: bool) -> int | None:
    """The messages appended up to `position` (inclusive), given the entry that holds it (the
    last entry at or before it): None when that entry carries no count. whole: the entry was
    delivered whole (its messages all count, wherever position is inside it)."""
    counts = batch_counts(flat)
    if counts is None:
        return None
    n, before = counts
    if before is None:
        return None
    if whole:
        return before + n
    ms, seq = offset_parts(entry_id)
    at_ms, at_seq = offset_parts(position)
    if at_ms > ms:
        return before + n
    return before + max(0, min(at_seq - seq + 1, n))


def retained_messages(counted: int | None, length: int, first: Any) -> int | None:
    """The messages a batch topic's partition holds: counted (m of its counters) minus the c of
    its first entry; first: (entry ID, fields) as XINFO STREAM gives it. None when it cannot be
    told (nothing counted, or a first entry without c)."""
    if length == 0:
        return 0
    if counted is None or not first:
        return None
    counts = batch_counts(first[1])
    if counts is None or counts[1] is None:
        return None
    return max(0, counted - counts[1])


def entries_to_keep(retention: int, counted: int | None, length: int, first: Any, last: Any) -> int:
    """How many of a batch topic's newest entries hold about `retention` messages, as the
    produce scripts trim (includes/append.lua batch_maxlen): retention over the messages per
    entry the partition holds (counted minus its first entry's c, over length), or over its
    newest entry's size when smaller. first, last: (entry ID, fields). Nothing counted: one
    message per entry (more is kept, never less)."""
    if retention <= 0 or counted is None or counted <= 0 or length <= 0:
        return retention
    per_entry = float(counted)
    first_counts = batch_counts(first[1]) if first else None
    if first_counts is not None and first_counts[1] is not None and first_counts[1] < counted:
        per_entry = (counted - first_counts[1]) / length
    last_counts = batch_counts(last[1]) if last else None
    newest = last_counts[0] if last_counts is not None else 1
    return math.ceil(retention / max(min(per_entry, newest), 1.0))
