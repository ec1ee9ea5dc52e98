"""The PySpark data source "redisq": topics as DataFrames, batch and streaming (DESIGN §5).

    spark.read.format("redisq").option("url", url).option("subscribe", "orders").load()

One Spark partition per topic partition (split by time with minPartitions); each reads its
stream with XRANGE over [start, end) and hands Spark Arrow batches whose types match the schema
exactly. Offsets are stream IDs. A streaming offset is {topic: {partition: next stream ID}}, keys
sorted (json.dumps(offset) is compared as a string by Spark, so the order must be canonical).

The format is "redisq", not "redis": a JVM data source of that name would win.

Entries that are not redisq messages (written by another client; see redisq/records.py, whose
rules apply here too) do not fail a query: a field the query reads but cannot parse is null
(value when there is no "v", headers for a damaged blob, producer_id / sequence when
they are not decimals below 2**63), and each task logs how many such entries it read. The check
covers the columns the query reads. With failOnMalformed=true the first one fails the query
with records.MalformedEntry naming the topic, partition and offset.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

import redisq
from redisq.errors import InvalidConfig, PartitionOutOfRange, RedisqError
from redisq.records import (
    MalformedEntry,
    decode_entry,
    offset_parts,
    parse_headers,
    parse_id_field,
)

log = logging.getLogger("redisq.spark.source")

FORMAT = "redisq"
DEFAULT_FETCH_COUNT = 10_000

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

READ_OPTIONS = (
    "url",
    "namespace",
    "subscribe",
    "subscribePattern",
    "assign",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "endingTimestamp",
    "maxOffsetsPerTrigger",
    "minPartitions",
    "includeHeaders",
    "includeMetadata",
    "failOnDataLoss",
    "failOnMalformed",
    "fetchCount",
    "path",
    "checkpointLocation",
)


class DataLossError(RedisqError):
    """Retention (or XDEL) removed messages the query has not read yet (failOnDataLoss=true)."""


# -- options ----------------------------------------------------------------------------------
def option(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    """Look an option up case-insensitively on the mapping Spark passed.

    Spark passes options case-insensitively; copying them with dict() lower-cases the keys, so
    a lookup by the camelCase name must go through here, never through a copy."""
    try:
        value = options.get(name)
    except Exception:  # pragma: no cover - any mapping will do
        value = None
    if value is None:
        lowered = name.lower()
        for key, candidate in options.items():
            if key.lower() == lowered:
                value = candidate
                break
    return default if value is None else value


def check_known(options: Mapping[str, str], known: Sequence[str], what: str) -> None:
    """A misspelt option would otherwise be ignored without a word."""
    allowed = {name.lower() for name in known}
    unknown = sorted(k for k in options if k.lower() not in allowed)
    if unknown:
        raise InvalidConfig(f"unknown {what} option(s) {unknown}; known: {', '.join(known)}")


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    lowered = str(value).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise InvalidConfig(f"{name}={value!r}: expected true or false")


def parse_int(name: str, value: str | None, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise InvalidConfig(f"{name}={value!r}: expected an integer") from None
    if number < minimum:
        raise InvalidConfig(f"{name}={number} is out of range: {minimum} or more")
    return number


def resolve_url(options: Mapping[str, str]) -> str:
    """The url option, else REDIS_URL. Never the embedded server: executors run in other
    processes (or machines), and each would start a server of its own."""
    url = option(options, "url") or os.environ.get("REDIS_URL")
    if not url:
        raise InvalidConfig('the "url" option (or REDIS_URL) is required, e.g. redis://host:6379')
    return url


@dataclass(frozen=True)
class ReadOptions:
    """The reader's options, parsed and checked once, on the driver (picklable)."""

    url: str
    namespace: str = "rq"
    subscribe: tuple[str, ...] = ()
    subscribe_pattern: str | None = None
    assign: dict[str, tuple[int, ...]] | None = None
    starting_offsets: str | None = None
    ending_offsets: str | None = None
    starting_timestamp: int | None = None
    ending_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    min_partitions: int | None = None
    include_headers: bool = False
    include_metadata: bool = False
    fail_on_data_loss: bool = True
    fail_on_malformed: bool = False
    fetch_count: int = DEFAULT_FETCH_COUNT

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        check_known(options, READ_OPTIONS, "redisq read")
        subscribe = option(options, "subscribe")
        pattern = option(options, "subscribePattern")
        assign_text = option(options, "assign")
        chosen = [
            n
            for n, v in (
                ("subscribe", subscribe),
                ("subscribePattern", pattern),
                ("assign", assign_text),
            )
            if v
        ]
        if len(chosen) != 1:
            raise InvalidConfig(
                "give exactly one of the options subscribe, subscribePattern, assign "
                f"(got {chosen or 'none'})"
            )
        assign = None
        if assign_text:
            assign = parse_assign(assign_text)
        if pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise InvalidConfig(f"subscribePattern={pattern!r}: {exc}") from None
        starting = option(options, "startingOffsets")
        ending = option(options, "endingOffsets")
        for name, text in (("startingOffsets", starting), ("endingOffsets", ending)):
            if text is not None:
                parse_offsets_spec(name, text)  # fail early, on the driver
        return cls(
            url=resolve_url(options),
            namespace=option(options, "namespace", "rq") or "rq",
            subscribe=tuple(t.strip() for t in subscribe.split(",") if t.strip())
            if subscribe
            else (),
            subscribe_pattern=pattern,
            assign=assign,
            starting_offsets=starting,
            ending_offsets=ending,
            starting_timestamp=parse_int(
                "startingTimestamp", option(options, "startingTimestamp"), 0
            ),
            ending_timestamp=parse_int("endingTimestamp", option(options, "endingTimestamp"), 0),
            max_offsets_per_trigger=parse_int(
                "maxOffsetsPerTrigger", option(options, "maxOffsetsPerTrigger"), 1
            ),
            min_partitions=parse_int("minPartitions", option(options, "minPartitions"), 1),
            include_headers=parse_bool("includeHeaders", option(options, "includeHeaders"), False),
            include_metadata=parse_bool(
                "includeMetadata", option(options, "includeMetadata"), False
            ),
            fail_on_data_loss=parse_bool("failOnDataLoss", option(options, "failOnDataLoss"), True),
            fail_on_malformed=parse_bool(
                "failOnMalformed", option(options, "failOnMalformed"), False
            ),
            fetch_count=parse_int("fetchCount", option(options, "fetchCount"), 1)
            or DEFAULT_FETCH_COUNT,
        )


def parse_assign(text: str) -> dict[str, tuple[int, ...]]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidConfig(f'assign: not JSON like {{"orders": [0, 1]}}: {exc}') from None
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in v)
        for v in raw.values()
    ):
        raise InvalidConfig(f'assign={text!r}: expected JSON like {{"orders": [0, 1]}}')
    return {str(t): tuple(sorted(set(v))) for t, v in raw.items()}


# -- stream IDs and offsets -------------------------------------------------------------------
EARLIEST, LATEST = "earliest", "latest"


def id_parts(stream_id: str) -> tuple[int, int]:
    """records.offset_parts for IDs from options: InvalidConfig, the option error, if invalid."""
    try:
        return offset_parts(stream_id)
    except ValueError as exc:
        raise InvalidConfig(str(exc)) from None


def normalize_id(stream_id: str) -> str:
    ms, seq = id_parts(stream_id)
    return f"{ms}-{seq}"


def next_id(stream_id: str) -> str:
    """The smallest stream ID after stream_id."""
    ms, seq = id_parts(stream_id)
    return f"{ms}-{seq + 1}"


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

    @property
    def earliest(self) -> str:
        return self.first_id or next_id(self.last_generated_id)

    @property
    def latest(self) -> str:
        """The next ID: no append can ever get an ID below it (IDs are chosen atomically)."""
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


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_states(broker: redisq.Broker, parts: Sequence[tuple[str, int]]) -> list[StreamState]:
    """XINFO STREAM of many partitions in one pipeline."""
    pipe = broker.client.pipeline(transaction=False)
    for topic, p in parts:
        pipe.xinfo_stream(broker.keys.log(topic, p))
    states = []
    for info in pipe.execute():
        first = info.get("first-entry")
        states.append(
            StreamState(
                first_id=_decode(first[0]) if first else None,
                last_generated_id=_decode(info.get("last-generated-id", b"0-0")),
            )
        )
    return states


def topic_partitions(broker: redisq.Broker, opts: ReadOptions) -> dict[str, list[int]]:
    """The partitions the options select, topics sorted (checked against the metadata)."""
    if opts.assign is not None:
        chosen: dict[str, list[int]] = {}
        for topic, partitions in sorted(opts.assign.items()):
            config = broker.topic_config(topic, refresh=True)
            for p in partitions:
                if not 0 <= p < config.partitions:
                    raise PartitionOutOfRange(topic, p, config.partitions)
            chosen[topic] = list(partitions)
        return chosen
    if opts.subscribe_pattern is not None:
        pattern = re.compile(opts.subscribe_pattern)
        topics = [t for t in broker.list_topics() if pattern.fullmatch(t)]
    else:
        topics = sorted(set(opts.subscribe))
    result = {}
    for topic in topics:
        try:
            config = broker.topic_config(topic, refresh=True)
        except redisq.TopicNotFound:
            if opts.subscribe_pattern is not None:
                continue  # deleted since it was listed
            raise
        result[topic] = list(range(config.partitions))
    return result


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


# -- partitions and reading ---------------------------------------------------------------------
class RangePartition(InputPartition):
    """Entries [start, end) of one topic partition (end exclusive)."""

    def __init__(self, topic: str, partition: int, start: str, end: str) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


def split_by_time(
    broker: redisq.Broker, topic: str, p: int, start: str, end: str, pieces: int
) -> list[tuple[str, str]]:
    """Split [start, end) into up to `pieces` ranges of equal time span (whole milliseconds
    stay together). The first and last entries of the range bound the span."""
    if pieces <= 1:
        return [(start, end)]
    key = broker.keys.log(topic, p)
    first = broker.client.xrange(key, min=start, max="(" + end, count=1)
    last = broker.client.xrevrange(key, max="(" + end, min=start, count=1)
    if not first or not last:
        return [(start, end)]
    first_ms = id_parts(_decode(first[0][0]))[0]
    last_ms = id_parts(_decode(last[0][0]))[0]
    span = last_ms - first_ms + 1
    pieces = min(pieces, span)
    if pieces <= 1:
        return [(start, end)]
    bounds = [start]
    for i in range(1, pieces):
        cut = f"{first_ms + (span * i) // pieces}-0"
        if id_less(bounds[-1], cut) and id_less(cut, end):
            bounds.append(cut)
    bounds.append(end)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def plan_partitions(
    broker: redisq.Broker,
    ranges: Mapping[tuple[str, int], tuple[str, str]],
    min_partitions: int | None,
) -> list[RangePartition]:
    """One Spark partition per non-empty range, in (topic, partition) order; with
    minPartitions, ranges are split by time until there are at least that many."""
    nonempty = [(tp, r) for tp, r in sorted(ranges.items()) if id_less(r[0], r[1])]
    pieces = 1
    if min_partitions and nonempty and len(nonempty) < min_partitions:
        pieces = math.ceil(min_partitions / len(nonempty))
    planned = []
    for (topic, p), (start, end) in nonempty:
        for s, e in split_by_time(broker, topic, p, start, end, pieces):
            planned.append(RangePartition(topic, p, s, e))
    return planned


_PROCESS_CLIENTS: dict[tuple[str, str], tuple[int, redisq.Broker]] = {}


def _raw_reply(response: Any, **options: Any) -> Any:
    return response


def reader_broker(url: str, namespace: str) -> redisq.Broker:
    """A broker per worker process (Python workers are reused), whose XRANGE replies stay the
    raw nested lists: no per-entry dict is built, which is most of a scan's cost in redis-py."""
    cached = _PROCESS_CLIENTS.get((url, namespace))
    if cached is not None and cached[0] == os.getpid():
        return cached[1]
    broker = redisq.connect(url, namespace=namespace)
    broker.client.set_response_callback("XRANGE", _raw_reply)
    _PROCESS_CLIENTS[(url, namespace)] = (os.getpid(), broker)
    return broker


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
    ms = pc.cast(pc.list_element(parts, 0), pa.int64())
    seq = pc.cast(pc.list_element(parts, 1), pa.int64())
    columns = [
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([topic] * n, pa.string()),
        pa.array([partition] * n, pa.int32()),
        offsets,
        ms,
        seq,
        pc.cast(pc.multiply(ms, 1000), pa.timestamp("us", tz="UTC")),
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


def read_range(opts: ReadOptions, part: RangePartition) -> Iterator[pa.RecordBatch]:
    """XRANGE [start, end) in fetch_count chunks, one Arrow batch per chunk."""
    broker = reader_broker(opts.url, opts.namespace)
    key = broker.keys.log(part.topic, part.partition)
    schema = arrow_schema(opts.include_headers, opts.include_metadata)
    checked = False
    malformed = MalformedCount()
    for entries in _xrange_chunks(broker.client, key, part.start, part.end, opts.fetch_count):
        if not checked:
            # After the first read: anything trimmed before it is visible to this check.
            _check_data_loss(broker, opts, part)
            checked = True
        if entries:
            batch = to_record_batch(
                entries,
                part.topic,
                part.partition,
                opts.include_headers,
                opts.include_metadata,
                schema,
                malformed,
            )
            if malformed.first is not None and opts.fail_on_malformed:
                raise malformed.first
            yield batch
    if malformed.first is not None:
        log.warning(
            "%s/%d [%s, %s): %d malformed entries read with null fields (first %s); "
            "failOnMalformed=true fails the query instead",
            part.topic,
            part.partition,
            part.start,
            part.end,
            malformed.count,
            malformed.first,
        )


def _xrange_chunks(client: Any, key: str, start: str, end: str, count: int) -> Iterator[Any]:
    """Raw XRANGE replies over [start, end), the last one possibly empty.

    On a plain (non-cluster) client the next XRANGE is sent before the current chunk is handed
    on: the server and the network work while this process builds the Arrow batch. The next
    cursor is known from the raw reply's last ID, so nothing waits for the conversion."""
    upper = "(" + end
    if not isinstance(client, redis.Redis):
        cursor = start
        while True:
            entries = client.execute_command("XRANGE", key, cursor, upper, "COUNT", count)
            yield entries
            if len(entries) < count:
                return
            cursor = "(" + _decode(entries[-1][0])
    pool = client.connection_pool
    connection = pool.get_connection()
    outstanding = False
    try:
        connection.send_command("XRANGE", key, start, upper, "COUNT", count)
        outstanding = True
        while True:
            entries = connection.read_response()
            outstanding = False
            more = len(entries) == count
            if more:
                connection.send_command(
                    "XRANGE", key, "(" + _decode(entries[-1][0]), upper, "COUNT", count
                )
                outstanding = True
            yield entries
            if not more:
                return
    finally:
        if outstanding:  # closed early: an unread reply would desynchronise the connection
            connection.disconnect()
        pool.release(connection)


def _check_data_loss(broker: redisq.Broker, opts: ReadOptions, part: RangePartition) -> None:
    (state,) = stream_states(broker, [(part.topic, part.partition)])
    if not state.lost_from(part.start):
        return
    message = (
        f"{part.topic}/{part.partition}: messages from {part.start} on were removed by retention "
        f"before they were read (the partition now starts at {state.first_id or 'its end'})"
    )
    if opts.fail_on_data_loss:
        raise DataLossError(
            message + '; set failOnDataLoss to "false" to read what is left instead'
        )
    log.warning("%s; reading what is left (failOnDataLoss=false)", message)


# -- batch -------------------------------------------------------------------------------------
class RedisqBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        start_spec = parse_offsets_spec("startingOffsets", opts.starting_offsets or EARLIEST)
        end_spec = parse_offsets_spec("endingOffsets", opts.ending_offsets or LATEST)
        if start_spec == LATEST:
            raise InvalidConfig("startingOffsets=latest is not allowed for a batch query")
        if end_spec == EARLIEST:
            raise InvalidConfig("endingOffsets=earliest is not allowed for a batch query")
        with redisq.connect(opts.url, namespace=opts.namespace) as broker:
            chosen = topic_partitions(broker, opts)
            parts = [(t, p) for t, ps in chosen.items() for p in ps]
            if not parts:
                return [RangePartition("", 0, "0-1", "0-1")]
            states = stream_states(broker, parts)
            starts = resolve_offsets(start_spec, opts.starting_timestamp, EARLIEST, parts, states)
            ends = resolve_offsets(end_spec, opts.ending_timestamp, LATEST, parts, states)
            ranges = {tp: (starts[tp], ends[tp]) for tp in parts}
            planned = plan_partitions(broker, ranges, opts.min_partitions)
        # Spark runs at least one task; an empty read still needs a (harmless) partition.
        return planned or [RangePartition("", 0, "0-1", "0-1")]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        if not partition.topic:
            return iter(())
        return read_range(self.opts, partition)


# -- streaming ---------------------------------------------------------------------------------
class RedisqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over stream IDs. The checkpoint holds the truth ({topic: {partition:
    next ID}}); commit() is only a notification, one batch late and maybe never for the last."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._broker: redisq.Broker | None = None
        self._target: dict[str, dict[str, str]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_broker"] = None  # a live connection does not travel to executors
        return state

    @property
    def broker(self) -> redisq.Broker:
        if self._broker is None:
            self._broker = redisq.connect(self.opts.url, namespace=self.opts.namespace)
        return self._broker

    def _parts_and_states(self) -> tuple[list[tuple[str, int]], list[StreamState]]:
        chosen = topic_partitions(self.broker, self.opts)
        parts = [(t, p) for t, ps in chosen.items() for p in ps]
        return parts, stream_states(self.broker, parts) if parts else []

    def initialOffset(self) -> dict:
        opts = self.opts
        spec = parse_offsets_spec("startingOffsets", opts.starting_offsets or LATEST)
        parts, states = self._parts_and_states()
        starts = resolve_offsets(spec, opts.starting_timestamp, LATEST, parts, states)
        offsets: dict[str, dict[str, str]] = {}
        for (topic, p), start in starts.items():
            offsets.setdefault(topic, {})[str(p)] = start
        return canonical(offsets)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def _latest(self) -> dict[str, dict[str, str]]:
        parts, states = self._parts_and_states()
        latest: dict[str, dict[str, str]] = {}
        for (topic, p), state in zip(parts, states, strict=True):
            latest.setdefault(topic, {})[str(p)] = state.latest
        return latest

    def reportLatestOffset(self) -> dict | None:
        return canonical(self._latest())

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        high = self._target if self._target is not None else self._latest()
        begin: dict[tuple[str, str], str] = {}
        for topic, partitions in start.items():
            for p, stream_id in partitions.items():
                begin[(topic, p)] = stream_id
        ends = dict(begin)
        # New partitions (or topics matching the pattern) are read from their start, as the
        # Kafka source does; their first ID is 0-1 at the earliest.
        bounds: dict[tuple[str, str], str] = {}
        for topic, partitions in high.items():
            for p, stream_id in partitions.items():
                begin.setdefault((topic, p), "0-1")
                ends.setdefault((topic, p), begin[(topic, p)])
                if id_less(begin[(topic, p)], stream_id):
                    bounds[(topic, p)] = stream_id
        if isinstance(limit, ReadMaxRows):
            ends.update(self._limited_ends(begin, bounds, limit.max_rows))
        else:
            ends.update(bounds)
        offsets: dict[str, dict[str, str]] = {}
        for (topic, p), stream_id in ends.items():
            offsets.setdefault(topic, {})[p] = stream_id
        return canonical(offsets)

    def _limited_ends(
        self, begin: Mapping[tuple[str, str], str], bounds: Mapping[tuple[str, str], str], rows: int
    ) -> dict[tuple[str, str], str]:
        """End offsets that take at most `rows` entries in all, shared evenly between the
        partitions with data (a partition with less gives the rest to the others). Counting
        runs in the server (count_range.lua): only a count and an ID come back per call."""
        ends = {tp: begin[tp] for tp in bounds}
        active = sorted(bounds)
        remaining = rows
        while remaining > 0 and active:
            share = max(1, remaining // len(active))
            still_active = []
            for tp in active:
                quota = min(share, remaining)
                if quota <= 0:
                    still_active.append(tp)
                    continue
                topic, p = tp
                count, last = self.broker.scripts.call(
                    "count_range",
                    [self.broker.keys.log(topic, int(p))],
                    [ends[tp], bounds[tp], quota],
                    topic=topic,
                )
                count = int(count)
                remaining -= count
                if count:
                    ends[tp] = next_id(_decode(last))
                if count == quota and id_less(ends[tp], bounds[tp]):
                    still_active.append(tp)
            # Each round takes at least one row or retires a partition: the loop ends.
            active = still_active
        return ends

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        ranges: dict[tuple[str, int], tuple[str, str]] = {}
        for topic, partitions in end.items():
            for p, stop in partitions.items():
                begin = start.get(topic, {}).get(p, "0-1")
                ranges[(topic, int(p))] = (begin, stop)
        return plan_partitions(self.broker, ranges, self.opts.min_partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_range(self.opts, partition)

    def commit(self, end: dict) -> None:
        log.debug("micro-batch committed up to %s", end)

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None


# -- the data source ---------------------------------------------------------------------------
class RedisqDataSource(DataSource):
    """Format "redisq": read topics (batch and streaming) and write DataFrames to topics."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return schema_ddl(
            parse_bool("includeHeaders", option(self.options, "includeHeaders"), False),
            parse_bool("includeMetadata", option(self.options, "includeMetadata"), False),
        )

    def reader(self, schema: StructType) -> DataSourceReader:
        return RedisqBatchReader(ReadOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RedisqStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from spark_connector.writer import RedisqBatchWriter, WriteOptions

        return RedisqBatchWriter(WriteOptions.parse(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from spark_connector.writer import RedisqStreamWriter, WriteOptions

        return RedisqStreamWriter(WriteOptions.parse(self.options, schema, overwrite))


__all__ = [
    "FORMAT",
    "DataLossError",
    "RangePartition",
    "ReadOptions",
    "RedisqDataSource",
]
