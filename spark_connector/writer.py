"""Writing DataFrames to topics, exactly once per row, batch and streaming (DESIGN §5).

    (df.write.format("redisq").option("url", url).option("topic", "orders").mode("append").save())

Columns: value (required; binary or string), key, headers, topic, partition, message_id
(optional); others are ignored. As in Spark's Kafka sink, the topic option overrides the topic
column and a partition column is obeyed: drop it from a DataFrame read from redisq to route
its rows by key again.
Rows route like the Python producer: partition column, else zlib.crc32(key) % partitions, else
(no key) sticky batches that move on round-robin.

Idempotence (default "sequence"): each Spark task writes under a producer id derived from a
name (the write job, or streaming query id, and the Spark partition), so a retried task writes
under the id of its first attempt. Sequences
count the task's rows per topic partition from 0, and batches are cut the same way every time,
so a retried task re-sends the same batches with the same base sequences, which
produce_sequence.lua answers as duplicates. In a streaming query the epoch is the micro-batch id
+ 1: a new micro-batch starts its sequences afresh, and a replayed one (after a restart from the
checkpoint) is recognised batch for batch. This needs the input of a retried task to come in the
same order, as Spark's sources (this one included) give it.

"message_id" instead dedups on a message_id column (your idempotency key) for the topic's dedup
window, whatever Spark replays; "none" appends plainly (a retry may write twice).

Options: url, namespace, topic, idempotence (sequence | message_id | none), batchSize (rows
per produce call, 500), maxInFlight (batches per pipeline round trip, 8). _failAfterRows is a
fault-injection hook for tests: the first attempt of every task fails once that many of its
rows are acknowledged.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import redis
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
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

import redisq
from redisq.errors import InvalidConfig, PartitionOutOfRange, RedisqError, TopicNotFound
from redisq.partitioner import partition_for_key
from redisq.protocol import produce as protocol
from redisq.protocol.produce import ProducerIdentity, encode_message
from redisq.records import encode_headers
from redisq.transport import Redirect, Transport
from spark_connector.source import check_known, option, parse_int, resolve_url

log = logging.getLogger("redisq.spark.writer")

WRITE_OPTIONS = (
    "url",
    "namespace",
    "topic",
    "idempotence",
    "batchSize",
    "maxInFlight",
    "path",
    "checkpointLocation",
    "_failAfterRows",
)
IDEMPOTENCE = ("sequence", "message_id", "none")
WINDOW = 16
SEND_ATTEMPTS = 5


@dataclass(frozen=True)
class WriteOptions:
    """The writer's options and the input columns it uses, checked on the driver."""

    url: str
    namespace: str
    topic: str | None
    idempotence: str
    batch_size: int
    max_in_flight: int
    columns: tuple[str, ...]
    fail_after_rows: int | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str], schema: StructType, overwrite: bool) -> WriteOptions:
        check_known(options, WRITE_OPTIONS, "redisq write")
        if overwrite:
            raise InvalidConfig(
                'a topic is a log: mode("overwrite") is not supported, use mode("append")'
            )
        idempotence = (option(options, "idempotence", "sequence") or "sequence").lower()
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
            batch_size=_bounded("batchSize", option(options, "batchSize"), 500, 1, 10_000),
            max_in_flight=_bounded("maxInFlight", option(options, "maxInFlight"), 8, 1, 100),
            columns=tuple(names[c] for c in used),
            fail_after_rows=parse_int("_failAfterRows", option(options, "_failAfterRows"), 1),
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


@dataclass
class WriteStats(WriterCommitMessage):
    """One task's outcome, sent back to the driver."""

    spark_partition: int
    attempt: int
    written: int = 0
    duplicates: int = 0
    batches: int = 0


# -- one task ----------------------------------------------------------------------------------
def _as_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    return bytes(value)


def _headers_blob(value: Any) -> bytes:
    if not value:
        return b""
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = value.items()
    elif isinstance(value[0], tuple):  # a map column in Arrow: [(name, value), ...]
        pairs = value
    else:  # array<struct<key, value>>: [{"key": name, "value": value}, ...]
        pairs = [(h["key"], h["value"]) for h in value]
    return encode_headers({name: (v if v is not None else b"") for name, v in pairs})


@dataclass
class _Pending:
    """Rows bound for one topic partition, not yet cut into a batch."""

    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    message_ids: list[bytes] = field(default_factory=list)


@dataclass
class _Batch:
    """A sealed batch (protocol.produce.SealedBatch): args are RESP pieces."""

    topic: str
    partition: int
    base_seq: int
    count: int
    layout: str
    args: list[bytes]
    body: bytes | None = None
    body_count: int = 0


class _TaskWriter:
    """Writes one Spark task's rows; see the module docstring for the idempotence scheme."""

    def __init__(self, opts: WriteOptions, job_id: str) -> None:
        from pyspark import TaskContext

        self.opts = opts
        context = TaskContext.get()
        self.spark_partition = context.partitionId() if context else 0
        self.attempt = context.attemptNumber() if context else 0
        batch_id = context.getLocalProperty("streaming.sql.batchId") if context else None
        query_id = context.getLocalProperty("sql.streaming.queryId") if context else None
        self.job = query_id or job_id
        # Streaming: a micro-batch is an epoch, so its sequences start at 0 and a replay of the
        # same micro-batch meets the state it left. Batch jobs write epoch 0.
        self.epoch = int(batch_id) + 1 if batch_id is not None else 0
        self.broker = redisq.connect(opts.url, namespace=opts.namespace)
        self.keys = self.broker.keys
        self.scripts = self.broker.scripts
        self.stats = WriteStats(self.spark_partition, self.attempt)
        self.identity = ProducerIdentity(self._producer_id(), self.epoch)
        self._configs: dict[str, redisq.TopicConfig] = {}
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._next_seq: dict[tuple[str, int], int] = {}
        self._acked_next: dict[tuple[str, int], int] = {}
        self._sealed: list[_Batch] = []
        self._keyless = 0

    def _producer_id(self) -> int:
        if self.opts.idempotence == "none":
            return protocol.random_producer_id()
        # Every attempt of this task derives the same id: its re-sent batches meet the state the
        # first attempt left, and are answered as duplicates.
        return protocol.named_producer_id(f"spark-writer\0{self.job}\0{self.spark_partition}")

    def _config(self, topic: str) -> redisq.TopicConfig:
        config = self._configs.get(topic)
        if config is None:
            config = self._configs[topic] = self.broker.topic_config(topic, refresh=True)
        return config

    def write(self, batches: Iterator[pa.RecordBatch]) -> WriteStats:
        try:
            for record_batch in batches:
                self._add_rows(record_batch)
            for tp in sorted(self._pending):
                self._seal(tp)
            self._send()
        finally:
            self.broker.close()
        log.info(
            "task %d attempt %d: %d written, %d duplicates",
            self.spark_partition,
            self.attempt,
            self.stats.written,
            self.stats.duplicates,
        )
        return self.stats

    def _add_rows(self, record_batch: pa.RecordBatch) -> None:
        opts = self.opts
        names = record_batch.schema.names
        lower = {n.lower(): n for n in names}

        def column(name: str) -> list[Any] | None:
            real = lower.get(name)
            return record_batch.column(real).to_pylist() if real is not None else None

        values = column("value") or []
        keys = column("key")
        topics = column("topic")
        partitions = column("partition")
        headers = column("headers")
        message_ids = column("message_id")
        for i, value in enumerate(values):
            # As in Spark's Kafka sink, the topic option overrides the topic column.
            topic = opts.topic or (topics[i] if topics is not None else None)
            if topic is None:
                raise InvalidConfig(f"row {i}: no topic (the topic column is null, no option)")
            config = self._config(topic)
            key = _as_bytes(keys[i]) if keys is not None else None
            if not key:
                key = None  # the producer refuses empty keys; an empty key is no key
            explicit = partitions[i] if partitions is not None else None
            if explicit is not None:
                if not 0 <= explicit < config.partitions:
                    raise PartitionOutOfRange(topic, explicit, config.partitions)
                p = explicit
            elif key is not None:
                p = partition_for_key(key, config.partitions)
            else:
                # Sticky, and deterministic: a retried task must route every row the same way.
                p = (self.spark_partition + self._keyless // opts.batch_size) % config.partitions
                self._keyless += 1
            pending = self._pending.get((topic, p))
            if pending is None:
                pending = self._pending[(topic, p)] = _Pending()
            pending.keys.append(key)
            pending.values.append(_as_bytes(value) or b"")
            if headers is not None:
                pending.headers.append(_headers_blob(headers[i]))
            if message_ids is not None:
                mid = _as_bytes(message_ids[i])
                if opts.idempotence == "message_id" and not mid:
                    raise InvalidConfig(f"row {i}: message_id is null or empty")
                pending.message_ids.append(mid or b"")
            if len(pending.values) >= opts.batch_size:
                self._seal((topic, p))
                if len(self._sealed) >= opts.max_in_flight:
                    self._send()

    def _seal(self, tp: tuple[str, int]) -> None:
        """Cut the partition's pending rows into one batch, frozen with its base sequence."""
        pending = self._pending.pop(tp, None)
        if pending is None or not pending.values:
            return
        count = len(pending.values)
        all_keys = all(k is not None for k in pending.keys)
        no_keys = all(k is None for k in pending.keys)
        with_headers = any(pending.headers)
        with_ids = self.opts.idempotence == "message_id"
        # The fast layouts (kv, v, kvm, vm) write every argument; mixed batches take the
        # general layout, where an empty key or headers argument leaves the field out.
        if not with_headers and (all_keys or no_keys):
            layout = ("k" if all_keys else "") + "v" + ("m" if with_ids else "")
        else:
            layout = "kvh" + ("m" if with_ids else "")
        args: list[bytes] = []
        for i in range(count):
            args += encode_message(
                (pending.keys[i] or b"") if "k" in layout else None,
                pending.values[i],
                (pending.headers[i] if pending.headers else b"") if "h" in layout else None,
                pending.message_ids[i] if "m" in layout else None,
            )
        base = self._next_seq.get(tp, 0)
        self._next_seq[tp] = base + (count if self.opts.idempotence == "sequence" else 1)
        self._sealed.append(_Batch(tp[0], tp[1], base, count, layout, args))

    def _send(self) -> None:
        """Send the sealed batches in one pipeline, in order. Sending again after an error is
        safe: a batch that was written answers DUP."""
        if not self._sealed:
            return
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                replies = self._send_once()
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if attempt == SEND_ATTEMPTS:
                    raise
                log.warning("send failed (%s), sending again", type(exc).__name__)
                time.sleep(0.1 * 2**attempt)
        for batch, reply in zip(self._sealed, replies, strict=True):
            self._settle(batch, reply)
        self._sealed = []
        fail_after = self.opts.fail_after_rows
        if fail_after is not None and self.attempt == 0 and self.stats.written >= fail_after:
            raise RuntimeError(
                f"_failAfterRows: injected failure of task {self.spark_partition} after "
                f"{self.stats.written} rows were written"
            )

    def _send_once(self) -> list[Any]:
        """One round on the producer's transport (a connection per node, pre-encoded EVALSHA
        commands): works on Redis Cluster, where a pipeline of scripts across slots does not."""
        transport = Transport(self.broker.client)
        try:
            sent: dict[str, list[int]] = {}
            payloads: dict[str, list[bytes]] = {}
            calls = []
            for i, batch in enumerate(self._sealed):
                call = protocol.produce(
                    self.keys,
                    None if self.opts.idempotence == "none" else self.opts.idempotence,
                    self.identity,
                    self._config(batch.topic),
                    batch,
                    acked_next=self._acked_next.get((batch.topic, batch.partition), 0),
                    window=WINDOW,
                )
                calls.append(call)
                node = transport.node_for(call.keys[0])
                sent.setdefault(node, []).append(i)
                payloads.setdefault(node, []).append(self.scripts.pack(call))
            replies: list[Any] = [None] * len(calls)
            for node, parts in payloads.items():
                transport.send(node, b"".join(parts))
            for node, indexes in sent.items():
                for i, reply in zip(indexes, transport.read(node, len(indexes)), strict=True):
                    replies[i] = reply
        finally:
            transport.close()
        if any(isinstance(r, Redirect) for r in replies):
            raise redis.ConnectionError("the cluster's slots moved; sending again")
        if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            # A restarted server: NOSCRIPT means that script did not run. Load and send again.
            for name in ("produce_sequence", "produce_message_id", "produce"):
                self.scripts.load(name)
            raise redis.ConnectionError("scripts were not loaded")
        return [
            reply if isinstance(reply, Exception) else call.decode(reply)
            for call, reply in zip(calls, replies, strict=True)
        ]

    def _settle(self, batch: _Batch, reply: Any) -> None:
        if isinstance(reply, Exception):
            mapped = redisq.errors.from_reply(str(reply), batch.topic)
            raise mapped if mapped is not None else reply
        tp = (batch.topic, batch.partition)
        self._acked_next[tp] = batch.base_seq + (
            batch.count if self.opts.idempotence == "sequence" else 1
        )
        self.stats.batches += 1
        if self.opts.idempotence == "message_id":
            dups = reply.flags.count("1")
            self.stats.duplicates += dups
            self.stats.written += batch.count - dups
        elif self.opts.idempotence == "sequence" and reply.duplicate:
            self.stats.duplicates += batch.count
        else:
            self.stats.written += batch.count


def _summarise(messages: list[WriterCommitMessage | None], what: str) -> None:
    stats = [m for m in messages if isinstance(m, WriteStats)]
    log.info(
        "%s: %d rows written, %d duplicates skipped, %d tasks",
        what,
        sum(s.written for s in stats),
        sum(s.duplicates for s in stats),
        len(stats),
    )


class RedisqBatchWriter(DataSourceArrowWriter):
    """df.write: one PID per (this write job, Spark partition)."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.job_id = f"job-{uuid.uuid4().hex[:16]}"  # made on the driver: retries share it
        self._check_topic()

    def _check_topic(self) -> None:
        if self.opts.topic is None:
            return
        with redisq.connect(self.opts.url, namespace=self.opts.namespace) as broker:
            try:
                broker.topic_config(self.opts.topic, refresh=True)
            except TopicNotFound:
                raise
            except RedisqError:  # pragma: no cover - reported by the tasks instead
                pass

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteStats:
        return _TaskWriter(self.opts, self.job_id).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _summarise(messages, f"write {self.job_id}")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _summarise(messages, f"aborted write {self.job_id} (rows written stay written)")


class RedisqStreamWriter(DataSourceStreamArrowWriter):
    """writeStream: one PID per (query id, Spark partition), epoch = micro-batch id + 1."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.job_id = f"stream-{uuid.uuid4().hex[:16]}"  # used only if no query id is visible

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteStats:
        return _TaskWriter(self.opts, self.job_id).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _summarise(messages, f"micro-batch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _summarise(messages, f"aborted micro-batch {batchId} (a replay writes no row twice)")
