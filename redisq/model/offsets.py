"""Offsets are stream IDs (`<ms>-<seq>`): the one parser of them, and the IDs after and before
one (an ID is one 128-bit number, so the sequence carries into the milliseconds)."""

from __future__ import annotations

import re

MAX_STREAM_ID_PART = (1 << 64) - 1
MAX_STREAM_ID = f"{MAX_STREAM_ID_PART}-{MAX_STREAM_ID_PART}"  # nothing can be appended after it
_STREAM_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")


def offset_parts(offset: str) -> tuple[int, int]:
    """A stream ID ``<ms>-<seq>`` (or ``<ms>``, meaning ``<ms>-0``) as a sortable pair of
    integers; ValueError for anything else. The one parser of stream IDs."""
    match = _STREAM_ID.fullmatch(offset) if isinstance(offset, str) else None
    if match is None:
        raise ValueError(f"{offset!r} is not a stream ID <ms>-<seq>")
    ms, seq = int(match.group(1)), int(match.group(2) or 0)
    if ms > MAX_STREAM_ID_PART or seq > MAX_STREAM_ID_PART:
        raise ValueError(f"{offset!r} is not a stream ID: a part is above 2**64 - 1")
    return ms, seq


def offset_after(offset: str, count: int = 1) -> str | None:
    """The stream ID `count` IDs after `offset` (count >= 0), or None when none is left: an ID
    is one 128-bit number, so the sequence carries into the milliseconds (as XADD's IDs do past
    <ms>-18446744073709551615), and nothing comes after MAX_STREAM_ID. The one place "the next
    ID" is computed; ValueError for what offset_parts refuses."""
    ms, seq = offset_parts(offset)
    if seq + count <= MAX_STREAM_ID_PART:
        return f"{ms}-{seq + count}"
    ms, seq = divmod((ms << 64) + seq + count, 1 << 64)
    return None if ms > MAX_STREAM_ID_PART else f"{ms}-{seq}"


def offset_before(offset: str) -> str | None:
    """The stream ID just before `offset` (offset_after's inverse: <ms>-0 follows
    <ms-1>-18446744073709551615), or None before 0-0. XREAD waits for IDs after the one given:
    from offset_before(X), it waits for X itself and what follows."""
    ms, seq = offset_parts(offset)
    if seq:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{MAX_STREAM_ID_PART}" if ms else None


def offset_at(first_id: str, index: int) -> str:
    """The ID of message `index` of a batch appended from `first_id` (IDs are consecutive)."""
    ms, _, seq = first_id.partition("-")
    following = int(seq) + index
    if following <= MAX_STREAM_ID_PART:
        return f"{ms}-{following}"
    offset = offset_after(first_id, index)  # the sequence carried into the milliseconds
    if offset is None:
        raise ValueError(f"no stream ID comes {index} after {first_id}")
    return offset
