"""Raw XRANGE entries as Arrow record batches with exactly the schema's types.

Entries that are not redisq messages (written by another client; see redisq/records.py, whose
rules apply here too) do not fail a query: a field the query reads but cannot parse is null
(value when there is no "v", headers for a damaged blob, producer_id / sequence when they are
not decimals below 2**63), and each such entry is counted (MalformedCount). offset_ms,
offset_seq and timestamp are null where a stream ID's part does not fit them (an ID another
client chose: its parts go up to 2**64 - 1); offset keeps the exact ID.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from redisq.model.records import MalformedEntry, decode_entry, parse_headers, parse_id_field

BASE_COLUMNS = [
    ("key", "binary", pa.binary()),
    ("value", "binary", pa.binary()),
    ("topic", "string", pa.string()),
    ("partition", "int", pa.int32()),
    ("offset", "string", pa.string()),
    ("offset_ms", "bigint", pa.int64()),
    ("offset_seq", "bigint", pa.int64()),
    ("timestamp", "timestamp", pa.timestamp("us", tz="UTC")),
]
HEADER_COLUMNS = [
    (
        "headers",
        "array<struct<key:string,value:binary>>",
        pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
    ),
]
METADATA_COLUMNS = [
    ("producer_id", "bigint", pa.int64()),
    ("sequence", "bigint", pa.int64()),
    ("message_id", "binary", pa.binary()),
]


def arrow_schema(include_headers: bool, include_metadata: bool) -> pa.Schema:
    columns = list(BASE_COLUMNS)
    if include_headers:
        columns += HEADER_COLUMNS
    if include_metadata:
        columns += METADATA_COLUMNS
    return pa.schema([pa.field(name, arrow_type) for name, _, arrow_type in columns])


def schema_ddl(include_headers: bool, include_metadata: bool) -> str:
    columns = list(BASE_COLUMNS)
    if include_headers:
        columns += HEADER_COLUMNS
    if include_metadata:
        columns += METADATA_COLUMNS
    return ", ".join(f"{name} {ddl}" for name, ddl, _ in columns)


class MalformedCount:
    """Entries of one task whose read fields could not be parsed: how many, and the first."""

    def __init__(self) -> None:
        self.count = 0
        self.first: MalformedEntry | None = None

    def add(self, topic: str, partition: int, entry: Any) -> None:
        self.count += 1
        if self.first is None:
            # The shared decoder words the reason, so Spark and the consumer say the same.
            entry_id, fields = entry
            message = decode_entry(topic, partition, entry_id, fields)
            reason = getattr(message, "reason", "") or "a field the query reads is malformed"
            self.first = MalformedEntry(topic, partition, message.offset, reason)


_ID_DIGITS = r"^[0-9]{1,19}$"  # records.parse_id_field's rule, as an RE2 pattern


def _id_column(raw: list[bytes | None]) -> tuple[pa.Array, list[int]]:
    """producer_id / sequence values as int64 under records.parse_id_field's rule: null where
    it fails. Returns the column and the indexes of the values that failed. Vectorised when
    every value passes (the usual case); otherwise parse_id_field decides, value by value."""
    column = pa.array(raw, pa.binary())
    present = len(raw) - column.null_count
    digits = pc.match_substring_regex(column, _ID_DIGITS)
    if (pc.sum(digits).as_py() or 0) == present:
        try:
            return pc.cast(pc.cast(column, pa.string()), pa.int64()), []
        except pa.ArrowInvalid:  # 19 digits above 2**63 - 1
            pass
    parsed = [parse_id_field(v) if v is not None else None for v in raw]
    bad = [i for i, v in enumerate(raw) if v is not None and parsed[i] is None]
    return pa.array(parsed, pa.int64()), bad


_INT64_MAX = (1 << 63) - 1
_MAX_TIMESTAMP_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, Spark's last timestamp


def _bigint(column: pa.Array, largest: int) -> pa.Array:
    """An integer column as int64, null where a value is above `largest`: a stream ID's parts
    go up to 2**64 - 1 (an entry another client XADDed with such an ID), bigint does not."""
    top = pc.max(column).as_py()
    if top is not None and top > largest:
        column = pc.if_else(
            pc.greater(column, pa.scalar(largest, column.type)),
            pa.scalar(None, column.type),
            column,
        )
    return pc.cast(column, pa.int64())


def to_record_batch(
    entries: Sequence[Any],
    topic: str,
    partition: int,
    include_headers: bool,
    include_metadata: bool,
    schema: pa.Schema,
    malformed: MalformedCount | None = None,
) -> pa.RecordBatch:
    """Raw XRANGE entries as one Arrow batch with exactly the schema's types (Spark checks
    them strictly: INT is int32, TIMESTAMP is timestamp[us, tz=UTC]).

    Fields are parsed by records.py's rules; what the query reads but cannot parse is null,
    and each such entry is counted once in `malformed`."""
    n = len(entries)
    ids: list[bytes] = []
    keys: list[bytes | None] = []
    values: list[bytes | None] = []
    details = include_headers or include_metadata
    dicts: list[dict[bytes, bytes]] = []
    bad: set[int] = set()
    for i, (entry_id, fields) in enumerate(entries):
        ids.append(entry_id)
        # The produce scripts write k (if any) and v first: the common shapes skip the dict.
        if not details and len(fields) >= 4 and fields[0] == b"k" and fields[2] == b"v":
            keys.append(fields[1])
            values.append(fields[3])
        elif not details and len(fields) >= 2 and fields[0] == b"v":
            keys.append(None)
            values.append(fields[1])
        else:
            # records.field_map's rule, inlined (this loop is the scan's hot path): the last
            # value of a repeated name counts; no value, or an odd list, is malformed.
            it = iter(fields)
            found = dict(zip(it, it, strict=False))
            if b"v" not in found or len(fields) % 2:
                bad.add(i)
            keys.append(found.get(b"k"))
            values.append(found.get(b"v"))
            if details:
                dicts.append(found)
    offsets = pa.array(ids, pa.string())
    parts = pc.split_pattern(offsets, "-")
    ms = _bigint(pc.cast(pc.list_element(parts, 0), pa.uint64()), _INT64_MAX)
    seq = _bigint(pc.cast(pc.list_element(parts, 1), pa.uint64()), _INT64_MAX)
    columns = [
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([topic] * n, pa.string()),
        pa.array([partition] * n, pa.int32()),
        offsets,
        ms,
        seq,
        pc.cast(pc.multiply(_bigint(ms, _MAX_TIMESTAMP_MS), 1000), pa.timestamp("us", tz="UTC")),
    ]
    if include_headers:
        headers: list[list[dict[str, Any]] | None] = []
        for i, d in enumerate(dicts):
            parsed = parse_headers(d.get(b"h"))
            if parsed is None:
                bad.add(i)
                headers.append(None)
            else:
                headers.append([{"key": k, "value": v} for k, v in parsed.items()])
        columns.append(pa.array(headers, HEADER_COLUMNS[0][2]))
    if include_metadata:
        for name in (b"p", b"s"):
            column, failed = _id_column([d.get(name) for d in dicts])
            bad.update(failed)
            columns.append(column)
        columns.append(pa.array([d.get(b"m") for d in dicts], pa.binary()))
    if malformed is not None:
        for i in sorted(bad):
            malformed.add(topic, partition, entries[i])
    return pa.RecordBatch.from_arrays(columns, schema=schema)
