"""Stream IDs as offsets: parsing the offset options, the canonical streaming offset, and
what XINFO STREAM tells about a partition (its first and next IDs, and data loss).

A streaming offset is {topic: {partition: next stream ID}}, keys sorted (json.dumps(offset) is
compared as a string by Spark, so the order must be canonical).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redisq.errors import InvalidConfig
from redisq.model.offsets import MAX_STREAM_ID_PART, offset_after, offset_parts

# -- stream IDs and offsets -------------------------------------------------------------------
EARLIEST, LATEST = "earliest", "latest"
# One past the largest stream ID: the (exclusive) end of a range that takes an entry another
# client XADDed at the largest ID, after which nothing can be appended. Never sent to Redis as
# an ID: an upper bound says "+" for it (upper_bound, count_end).
END_OF_IDS = f"{MAX_STREAM_ID_PART + 1}-0"


def id_parts(stream_id: str) -> tuple[int, int]:
    """offsets.offset_parts for IDs from options: InvalidConfig, the option error, if invalid."""
    if stream_id == END_OF_IDS:
        return MAX_STREAM_ID_PART + 1, 0
    try:
        return offset_parts(stream_id)
    except ValueError as exc:
        raise InvalidConfig(str(exc)) from None


def upper_bound(end: str) -> str:
    """XRANGE's bound for the exclusive end `end`."""
    return "+" if end == END_OF_IDS else "(" + end


def count_end(end: str) -> str:
    """count_range.lua's end argument for the exclusive end `end` ("+": no end)."""
    return "+" if end == END_OF_IDS else end


def normalize_id(stream_id: str) -> str:
    ms, seq = id_parts(stream_id)
    return f"{ms}-{seq}"


def next_id(stream_id: str) -> str:
    """The smallest stream ID after stream_id (offsets.offset_after: the sequence carries into
    the milliseconds), END_OF_IDS after the largest."""
    id_parts(stream_id)  # InvalidConfig for what is not a stream ID
    return offset_after(stream_id) or END_OF_IDS


def id_less(a: str, b: str) -> bool:
    return id_parts(a) < id_parts(b)


def canonical(offsets: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """{topic: {partition: next-id}} with sorted keys: the form Spark stores and compares."""
    return {t: {p: offsets[t][p] for p in sorted(offsets[t])} for t in sorted(offsets)}


OffsetSpec = str | dict[str, dict[int, str]]


def parse_offsets_spec(name: str, text: str) -> OffsetSpec:
    """earliest | latest | JSON {"topic": {"0": "<ms>-<seq>" | "earliest" | "latest" | -2 | -1}}.

    As in Spark's Kafka source, -2 means earliest and -1 latest."""
    stripped = text.strip()
    if stripped.lower() in (EARLIEST, LATEST):
        return stripped.lower()
    try:
        raw = json.loads(stripped)
    except json.JSONDecodeError:
        raise InvalidConfig(
            f'{name}={text!r}: expected earliest, latest, or JSON like {{"orders": {{"0": '
            '"1700000000000-0"}}'
        ) from None
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{name}={text!r}: expected a JSON object of topics")
    spec: dict[str, dict[int, str]] = {}
    for topic, partitions in raw.items():
        if not isinstance(partitions, dict):
            raise InvalidConfig(f"{name}: topic {topic!r} must map partitions to offsets")
        for p, value in partitions.items():
            try:
                number = int(p)
            except ValueError:
                raise InvalidConfig(
                    f"{name}: partition {p!r} of {topic!r} is not a number"
                ) from None
            if value == -2 or value == EARLIEST:
                resolved = EARLIEST
            elif value == -1 or value == LATEST:
                resolved = LATEST
            elif isinstance(value, str):
                resolved = normalize_id(value)
            else:
                raise InvalidConfig(
                    f"{name}: offset {value!r} of {topic}/{p}: expected a stream ID string, "
                    '"earliest" (-2) or "latest" (-1)'
                )
            spec.setdefault(str(topic), {})[number] = resolved
    return spec


@dataclass(frozen=True)
class StreamState:
    """What XINFO STREAM says about one partition stream."""

    first_id: str | None
    last_generated_id: str
    # The last offset of the last entry when it is a batch entry that claims offsets past the
    # last generated ID (another client XADDed it without moving the ID on, DESIGN §14.1).
    last_offset: str | None = None

    @property
    def earliest(self) -> str:
        return self.first_id or next_id(self.last_generated_id)

    @property
    def latest(self) -> str:
        """The next ID: no append can ever get an ID below it (IDs are chosen atomically);
        past the last entry's last message when that is later."""
        if self.last_offset is not None and id_less(self.last_generated_id, self.last_offset):
            return next_id(self.last_offset)
        return next_id(self.last_generated_id)

    def lost_from(self, start: str) -> bool:
        """Did retention remove entries at or after start?

        Redis records neither trimmed IDs nor a dense offset, so this rests on how IDs are made:
        XADD * and the produce scripts number the entries of one millisecond 0, 1, 2, ... So if
        the first surviving entry is <ms>-<k> with k > 0 and lies after start, <ms>-<k-1> was
        at or after start and is gone: certain loss. An empty stream whose last ID is at or
        after start lost that entry. When the first survivor is <ms>-0, a cut just before it
        cannot be told from one after the last message read; that case is not reported (a
        false alarm would stop healthy queries on slow topics), so detection is exact except
        when retention cuts exactly at a millisecond boundary."""
        if self.first_id is None:
            return not id_less(self.last_generated_id, start) and self.last_generated_id != "0-0"
        if not id_less(start, self.first_id):
            return False
        return id_parts(self.first_id)[1] > 0


def check_spec_parts(name: str, spec: OffsetSpec, parts: Sequence[tuple[str, int]]) -> None:
    """A JSON spec may only name partitions the query reads: anything else is a typo (a
    partition the topic lacks, a topic not subscribed), and ignoring it would read from the
    default offset instead of the one asked for."""
    if not isinstance(spec, dict):
        return
    read = set(parts)
    unknown = sorted((t, p) for t, ps in spec.items() for p in ps if (t, p) not in read)
    if unknown:
        named = ", ".join(f"{t}/{p}" for t, p in unknown)
        topics = sorted({t for t, _ in parts})
        raise InvalidConfig(
            f"{name} names {named}, which the query does not read (it reads "
            f"{', '.join(topics) or 'no topic'}; partitions are 0..partitions-1)"
        )


def resolve_offsets(
    spec: OffsetSpec | None,
    timestamp: int | None,
    default: str,
    parts: Sequence[tuple[str, int]],
    states: Sequence[StreamState],
) -> dict[tuple[str, int], str]:
    """A stream ID for each partition from a spec (a timestamp wins over the spec, as in
    Spark's Kafka source). Partitions the JSON does not name get `default`."""
    resolved = {}
    for (topic, p), state in zip(parts, states, strict=True):
        if timestamp is not None:
            resolved[(topic, p)] = f"{timestamp}-0"
            continue
        if isinstance(spec, dict):
            choice = spec.get(topic, {}).get(p, default)
        else:
            choice = spec or default
        if choice == EARLIEST:
            resolved[(topic, p)] = state.earliest
        elif choice == LATEST:
            resolved[(topic, p)] = state.latest
        else:
            resolved[(topic, p)] = choice
    return resolved
