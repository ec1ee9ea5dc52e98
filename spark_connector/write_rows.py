"""The writer's options and its rows: which columns it takes, where each row goes, and each row
encoded once as the produce scripts' arguments (protocol.produce.encode_message).

Columns: value (required; binary or string), key, headers, topic, partition, message_id
(optional); others are ignored. As in Spark's Kafka sink, the topic option overrides the topic
column and a partition column is obeyed: drop it from a DataFrame read from redisq to route its
rows by key again. Rows route like the Python producer: partition column, else
zlib.crc32(key) % partitions, else (idempotence="message_id") zlib.crc32(message_id) %
partitions, else sticky batches that move on round-robin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

from redisq.errors import InvalidConfig, MessageTooLarge, PartitionOutOfRange
from redisq.model.partitioner import partition_for_key
from redisq.model.records import encode_headers
from redisq.model.topic import TopicConfig
from redisq.protocol.produce import LAYOUTS, encode_message
from spark_connector.options import check_known, option, parse_int, resolve_url

WRITE_OPTIONS = (
    "url",
    "namespace",
    "topic",
    "idempotence",
    "batchSize",
    "maxInFlight",
    "transactionTimeoutMs",
    "path",
    "checkpointLocation",
)
IDEMPOTENCE = ("transaction", "message_id", "none")
MAX_MESSAGE_BYTES = 1 << 20
# A task's staged attempt must outlive the slowest job (and, for a streaming epoch, a restart
# of the query): the sweeper aborts an open transaction only past this.
DEFAULT_TX_TIMEOUT_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class WriteOptions:
    """The writer's options and the input columns it uses, checked on the driver."""

    url: str
    namespace: str
    topic: str | None
    idempotence: str
    batch_size: int
    max_in_flight: int
    transaction_timeout_ms: int
    columns: tuple[str, ...]

    @classmethod
    def parse(cls, options: Mapping[str, str], schema: StructType, overwrite: bool) -> WriteOptions:
        check_known(options, WRITE_OPTIONS, "redisq write")
        if overwrite:
            raise InvalidConfig(
                'a topic is a log: mode("overwrite") is not supported, use mode("append")'
            )
        idempotence = (option(options, "idempotence", "transaction") or "transaction").lower()
        if idempotence not in IDEMPOTENCE:
            raise InvalidConfig(f"idempotence={idempotence!r}: choose one of {IDEMPOTENCE}")
        types = {f.name.lower(): f.dataType for f in schema.fields}
        names = {f.name.lower(): f.name for f in schema.fields}
        if "value" not in types:
            raise InvalidConfig("the DataFrame needs a value column (binary or string)")
        _check_type("value", types["value"], (BinaryType, StringType))
        used = ["value"]
        for column, allowed in (
            ("key", (BinaryType, StringType)),
            ("topic", (StringType,)),
            ("partition", (IntegerType, LongType, ShortType)),
            ("message_id", (BinaryType, StringType, LongType, IntegerType)),
        ):
            if column in types:
                _check_type(column, types[column], allowed)
                used.append(column)
        if "headers" in types:
            _check_headers_type(types["headers"])
            used.append("headers")
        topic = option(options, "topic")
        if topic is None and "topic" not in types:
            raise InvalidConfig('name the topic: option("topic", ...) or a topic column')
        if idempotence == "message_id" and "message_id" not in types:
            raise InvalidConfig('idempotence="message_id" needs a message_id column')
        return cls(
            url=resolve_url(options),
            namespace=option(options, "namespace", "rq") or "rq",
            topic=topic,
            idempotence=idempotence,
            batch_size=_bounded("batchSize", option(options, "batchSize"), 1000, 1, 10_000),
            max_in_flight=_bounded("maxInFlight", option(options, "maxInFlight"), 8, 1, 100),
            transaction_timeout_ms=_bounded(
                "transactionTimeoutMs",
                option(options, "transactionTimeoutMs"),
                DEFAULT_TX_TIMEOUT_MS,
                60_000,
                30 * 24 * 3600 * 1000,
            ),
            columns=tuple(names[c] for c in used),
        )


def _bounded(name: str, text: str | None, default: int, low: int, high: int) -> int:
    value = parse_int(name, text, low)
    if value is None:
        return default
    if value > high:
        raise InvalidConfig(f"{name}={value} is out of range: {low}..{high}")
    return value


def _check_type(column: str, data_type: DataType, allowed: tuple[type, ...]) -> None:
    if not isinstance(data_type, allowed):
        names = " or ".join(t.__name__.removesuffix("Type").lower() for t in allowed)
        raise InvalidConfig(f"column {column} is {data_type.simpleString()}; expected {names}")


def _check_headers_type(data_type: DataType) -> None:
    ok = False
    if isinstance(data_type, MapType):
        ok = isinstance(data_type.keyType, StringType) and isinstance(
            data_type.valueType, BinaryType | StringType
        )
    elif isinstance(data_type, ArrayType) and isinstance(data_type.elementType, StructType):
        fields = {f.name: f.dataType for f in data_type.elementType.fields}
        ok = isinstance(fields.get("key"), StringType) and isinstance(
            fields.get("value"), BinaryType | StringType
        )
    if not ok:
        raise InvalidConfig(
            f"column headers is {data_type.simpleString()}; expected map<string,binary|string> "
            "or array<struct<key:string,value:binary|string>> (as the reader gives it)"
        )


def as_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    return bytes(value)


def headers_blob(value: Any) -> bytes | None:
    if not value:
        return None
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = value.items()
    elif isinstance(value[0], tuple):  # a map column in Arrow: [(name, value), ...]
        pairs = value
    else:  # array<struct<key, value>>: [{"key": name, "value": value}, ...]
        pairs = [(h["key"], h["value"]) for h in value]
    return encode_headers({name: (v if v is not None else b"") for name, v in pairs}) or None


@dataclass(slots=True)
class EncodedRow:
    """One row, routed and encoded: its partition, layout letters and RESP pieces."""

    topic: str
    partition: int
    layout: str
    parts: list[bytes]
    size: int


class RowEncoder:
    """Routes and encodes the rows of one task (I/O-free but for the topic configs it asks
    `config` for). Keyless rows stick to a partition for batch_size rows, then move on."""

    def __init__(
        self, opts: WriteOptions, config: Callable[[str], TopicConfig], first_partition: int
    ) -> None:
        self.opts = opts
        self._config = config
        self._keyless = 0
        self._first = first_partition
        self._with_ids = opts.idempotence == "message_id"

    def rows(self, record_batch: pa.RecordBatch) -> Iterator[EncodedRow]:
        opts = self.opts
        lower = {n.lower(): n for n in record_batch.schema.names}

        def column(name: str) -> list[Any] | None:
            real = lower.get(name)
            return record_batch.column(real).to_pylist() if real is not None else None

        values = column("value") or []
        keys = column("key")
        topics = column("topic")
        partitions = column("partition")
        headers = column("headers")
        message_ids = column("message_id")
        for i, raw_value in enumerate(values):
            # As in Spark's Kafka sink, the topic option overrides the topic column.
            topic = opts.topic or (topics[i] if topics is not None else None)
            if topic is None:
                raise InvalidConfig(f"row {i}: no topic (the topic column is null, no option)")
            config = self._config(topic)
            key = as_bytes(keys[i]) if keys is not None else None
            if not key:
                key = None  # the producer refuses empty keys; an empty key is no key
            mid = as_bytes(message_ids[i]) if message_ids is not None else None
            if self._with_ids and not mid:
                raise InvalidConfig(f"row {i}: message_id is null or empty")
            explicit = partitions[i] if partitions is not None else None
            if explicit is not None:
                if not 0 <= explicit < config.partitions:
                    raise PartitionOutOfRange(topic, explicit, config.partitions)
                p = explicit
            elif key is not None:
                p = partition_for_key(key, config.partitions)
            elif self._with_ids and mid:
                # An id's dedup scope is its partition: a keyless row goes where its id goes
                # (as the Python producer routes it), whichever task writes it.
                p = partition_for_key(mid, config.partitions)
            else:
                p = (self._first + self._keyless // opts.batch_size) % config.partitions
                self._keyless += 1
            if raw_value is None:  # the producer refuses None too (no tombstones in a log)
                raise InvalidConfig(f"row {i}: value is null (the value column is required)")
            value = as_bytes(raw_value) or b""
            blob = headers_blob(headers[i]) if headers is not None else None
            size = len(value) + len(key or b"") + len(blob or b"")
            if size > MAX_MESSAGE_BYTES:
                raise MessageTooLarge(size, MAX_MESSAGE_BYTES)
            layout = LAYOUTS[key is not None, blob is not None, mid is not None]
            yield EncodedRow(topic, p, layout, encode_message(key, value, blob, mid), size)
