"""Raw XRANGE entries as Arrow record batches with exactly the schema's types.

Entries that are not redisq messages (written by another client; see redisq/records.py, whose
rules apply here too) do not fail a query: a field the query reads but cannot parse is null
(value when there is no "v", headers for a damaged blob, producer_id / sequence when they are
not decimals below 2**63), and each such entry is counted (MalformedCount). offset_ms,
offset_seq and timestamp are null where a stream ID's part does not fit them (an ID another
client chose: its parts go up to 2**64 - 1); offset keeps the exact ID.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from redisq.model import batches
from redisq.model.records import (
    MAX_ID_FIELD,
    MalformedEntry,
    decode_entry,
    decode_headers,
    parse_headers,
    parse_id_field,
)

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
_HEAD = struct.Struct(">BBI")  # model.batches' blob header: version, flags, count
_KNOWN_FLAGS = batches.KEYS | batches.HEADERS | batches.MESSAGE_IDS | batches.TIMESTAMPS
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
    *,
    after: str | None = None,
    upto: str | None = None,
) -> pa.RecordBatch:
    """Raw XRANGE entries (in stream order) as one Arrow batch with exactly the schema's types
    (Spark checks them strictly: INT is int32, TIMESTAMP is timestamp[us, tz=UTC]): one row per
    message, a batch entry (DESIGN §14) giving its n messages at offsets ms-(s+i).

    Fields are parsed by records.py's rules; what the query reads but cannot parse is null,
    and each such entry is counted once in `malformed` (a malformed batch entry is one row at
    its ID, as records.decode_entries gives one MalformedMessage). after / upto: as
    records.decode_entries' cuts, messages at or before `after` and at or after `upto` are left
    out (a range that starts or ends inside a batch entry)."""
    bounds = None
    if after is not None or upto is not None:
        bounds = (
            batches.parse_offset(after) if after is not None else None,
            batches.parse_offset(upto) if upto is not None else None,
        )
    pieces: list[pa.RecordBatch] = []
    start = 0  # the first entry of the current run of entries that are not batch entries
    for i, (entry_id, fields) in enumerate(entries):
        if not fields or fields[0] != b"b":
            continue
        rows = _batch_rows(
            entry_id, fields, topic, partition, include_headers, include_metadata, schema, bounds
        )
        if rows is None:  # malformed (or a "v" entry): the message path decides
            continue
        if start < i:
            pieces.append(
                _message_rows(
                    _bounded(entries[start:i], bounds),
                    topic,
                    partition,
                    include_headers,
                    include_metadata,
                    schema,
                    malformed,
                )
            )
        if rows.num_rows:
            pieces.append(rows)
        start = i + 1
    if start < len(entries) or not pieces:
        run = entries[start:] if start else entries
        pieces.append(
            _message_rows(
                _bounded(run, bounds),
                topic,
                partition,
                include_headers,
                include_metadata,
                schema,
                malformed,
            )
        )
    full = [piece for piece in pieces if piece.num_rows]
    if len(full) <= 1:
        return full[0] if full else pieces[0]
    return pa.Table.from_batches(full, schema).combine_chunks().to_batches()[0]


def _bounded(entries: Sequence[Any], bounds: tuple[Any, Any] | None) -> Sequence[Any]:
    """Entries of one offset each inside the cuts (in stream order: only the ends are looked
    at unless one is outside). An entry whose ID is not a stream ID is kept (it is malformed)."""
    if bounds is None or not entries:
        return entries
    after, upto = bounds

    def inside(entry: Any) -> bool:
        at = batches.parse_offset(entry[0])
        return at is None or ((after is None or at > after) and (upto is None or at < upto))

    if inside(entries[0]) and inside(entries[-1]):
        return entries
    return [e for e in entries if inside(e)]


def _repeat(value: Any, count: int, arrow_type: pa.DataType) -> pa.Array:
    return pa.repeat(pa.scalar(value, arrow_type), count)


def _column(
    blob_buffer: pa.Buffer,
    lengths: np.ndarray,
    at: int,
    start: int,
    stop: int,
    nullable: bool,
) -> pa.Array:
    """Items [start, stop) of one blob column as a binary array over the blob itself: int32
    offsets from the column's u32 lengths (its data begins at byte `at`); with nullable, a
    length of 0 is null (absent)."""
    part = lengths[start:stop]
    offsets = np.empty(len(part) + 1, np.int32)
    offsets[0] = at + int(lengths[:start].sum())
    np.cumsum(part, out=offsets[1:])
    offsets[1:] += offsets[0]
    validity = None
    nulls = 0
    if nullable:
        present = part > 0
        nulls = len(part) - int(present.sum())
        if nulls:
            validity = pa.array(present, pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(
        pa.binary(), len(part), [validity, pa.py_buffer(offsets), blob_buffer], null_count=nulls
    )


_EMPTY_HEADERS = pa.array([], HEADER_COLUMNS[0][2].value_type)


def _batch_rows(
    entry_id: Any,
    fields: Any,
    topic: str,
    partition: int,
    include_headers: bool,
    include_metadata: bool,
    schema: pa.Schema,
    bounds: tuple[Any, Any] | None,
) -> pa.RecordBatch | None:
    """A batch entry's messages inside the bounds as Arrow columns sliced straight from its
    blob (no Python per message but for headers); None when the entry is not a well-formed
    batch entry by records.py's rules (the caller reads it as any other entry: malformed)."""
    if len(fields) % 2:
        return None
    it = iter(fields)
    found = dict(zip(it, it, strict=True))
    if b"v" in found:
        return None
    offset = entry_id.decode() if type(entry_id) is bytes else str(entry_id)
    at = batches.parse_offset(offset)
    n = parse_id_field(found.get(b"n"))
    blob = found.get(b"b")
    if at is None or n is None or not 1 <= n <= batches.MAX_COUNT or type(blob) is not bytes:
        return None
    ms, first = at
    if first + n - 1 > batches.MAX_SEQ:
        return None
    for name in (b"c", b"s"):
        if name in found and parse_id_field(found[name]) is None:
            return None
    pid = None
    if b"p" in found:
        pid = parse_id_field(found[b"p"])
        if pid is None:
            return None
    base_seq = parse_id_field(found[b"s"]) if b"s" in found else None
    if base_seq is not None and base_seq + n - 1 > MAX_ID_FIELD:
        return None
    size = len(blob)
    if size < batches.HEAD_SIZE or size >= 1 << 31:
        return None
    version, flags, count = _HEAD.unpack_from(blob, 0)
    if version != batches.VERSION or flags & ~_KNOWN_FLAGS or count != n:
        return None
    present = [(flag, bool(flags & flag)) for flag in (batches.KEYS, 0, batches.HEADERS)]
    present.append((batches.MESSAGE_IDS, bool(flags & batches.MESSAGE_IDS)))
    columns = 1 + sum(1 for flag, there in present if flag and there)
    data_at = batches.HEAD_SIZE + 4 * n * columns
    if flags & batches.TIMESTAMPS:
        data_at += 8 * n
    if data_at > size:
        return None
    lengths = np.frombuffer(blob, ">u4", n * columns, batches.HEAD_SIZE).astype(np.int64)
    if data_at + int(lengths.sum()) != size:
        return None
    # Each present column's lengths and where its data begins.
    spans: dict[int, tuple[np.ndarray, int]] = {}
    j, pos = 0, data_at
    for flag, there in present:
        if flag and not there:
            continue
        column = lengths[j * n : (j + 1) * n]
        spans[flag] = (column, pos)
        pos += int(column.sum())
        j += 1
    header_maps = None
    if batches.HEADERS in spans:
        column, pos = spans[batches.HEADERS]
        ends = (pos + np.cumsum(column)).tolist()
        try:
            header_maps = [
                decode_headers(blob[a - length : a]) if length else {}
                for a, length in zip(ends, column.tolist(), strict=True)
            ]
        except ValueError:
            return None
    start, stop = 0, n
    if bounds is not None:
        after, upto = bounds
        if after is not None:
            if after[0] > ms:
                start = n
            elif after[0] == ms:
                start = max(0, min(n, after[1] - first + 1))
        if upto is not None:
            if upto[0] < ms:
                stop = 0
            elif upto[0] == ms:
                stop = max(0, min(n, upto[1] - first))
    rows = max(0, stop - start)
    if not rows:
        return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)
    stop = start + rows
    buffer = pa.py_buffer(blob)
    if batches.KEYS in spans:
        keys = _column(buffer, *spans[batches.KEYS], start, stop, nullable=True)
    else:
        keys = pa.nulls(rows, pa.binary())
    seqs = np.arange(first + start, first + stop, dtype=np.uint64)
    seq_array = pa.array(seqs, pa.uint64())
    offsets = pc.binary_join_element_wise(f"{ms}-", pc.cast(seq_array, pa.string()), "")
    ms_value = ms if ms <= _INT64_MAX else None
    stamp = ms * 1000 if ms <= _MAX_TIMESTAMP_MS else None
    arrays = [
        keys,
        _column(buffer, *spans[0], start, stop, nullable=False),
        _repeat(topic, rows, pa.string()),
        _repeat(partition, rows, pa.int32()),
        offsets,
        _repeat(ms_value, rows, pa.int64()),
        _bigint(seq_array, _INT64_MAX),
        _repeat(stamp, rows, pa.timestamp("us", tz="UTC")),
    ]
    if include_headers:
        header_type = HEADER_COLUMNS[0][2]
        if header_maps is None:
            arrays.append(
                pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), _EMPTY_HEADERS)
            )
        else:
            arrays.append(
                pa.array(
                    [
                        [{"key": k, "value": v} for k, v in h.items()]
                        for h in header_maps[start:stop]
                    ],
                    header_type,
                )
            )
    if include_metadata:
        arrays.append(_repeat(pid, rows, pa.int64()))
        if base_seq is None:
            arrays.append(pa.nulls(rows, pa.int64()))
        else:
            arrays.append(pa.array(np.arange(base_seq + start, base_seq + stop, dtype=np.int64)))
        if batches.MESSAGE_IDS in spans:
            arrays.append(_column(buffer, *spans[batches.MESSAGE_IDS], start, stop, nullable=True))
        else:
            arrays.append(pa.nulls(rows, pa.binary()))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _message_rows(
    entries: Sequence[Any],
    topic: str,
    partition: int,
    include_headers: bool,
    include_metadata: bool,
    schema: pa.Schema,
    malformed: MalformedCount | None = None,
) -> pa.RecordBatch:
    """Entries of one message each (and entries that are not redisq messages) as rows."""
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
