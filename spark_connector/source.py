"""The PySpark data source "redisq": topics as DataFrames, batch and streaming (DESIGN §5).

    spark.read.format("redisq").option("url", url).option("subscribe", "orders").load()

One Spark partition per topic partition (split by time with minPartitions); each reads its
stream with XRANGE over [start, end) and hands Spark Arrow batches whose types match the schema
exactly (spark_connector.scan, spark_connector.arrow_rows). Offsets are stream IDs
(spark_connector.offsets). Writing is spark_connector.writer.

The format is "redisq", not "redis": a JVM data source of that name would win.

A field the query reads but cannot parse (an entry another client wrote) is null, and each task
logs how many such entries it read; with failOnMalformed=true the first one fails the query with
records.MalformedEntry naming the topic, partition and offset.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
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
from redisq.errors import InvalidConfig
from spark_connector.arrow_rows import _id_column, schema_ddl  # noqa: F401 (tests/consume/test_foreign_entries.py)
from spark_connector.offsets import (
    EARLIEST,
    LATEST,
    StreamState,
    canonical,
    check_spec_parts,
    count_end,
    id_less,
    next_id,
    parse_offsets_spec,
    resolve_offsets,
)
from spark_connector.options import ReadOptions, option, parse_bool
from spark_connector.scan import (
    DataLossError,
    RangePartition,
    plan_partitions,
    read_range,
    stream_states,
    topic_partitions,
)
from spark_connector.writer import RedisqBatchWriter, RedisqStreamWriter, WriteOptions

log = logging.getLogger("redisq.spark.source")

FORMAT = "redisq"


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
            check_spec_parts("startingOffsets", start_spec, parts)
            check_spec_parts("endingOffsets", end_spec, parts)
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
        check_spec_parts("startingOffsets", spec, parts)
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
        """End offsets that take at most `rows` messages in all, shared evenly between the
        partitions with data (a partition with less gives the rest to the others). Counting
        runs in the server (count_range.lua, counting the messages of batch entries, so an
        end may fall inside an entry): only a count and an ID come back per call."""
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
                    [ends[tp], count_end(bounds[tp]), quota, "messages"],
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
        opts = ReadOptions.parse(self.options)
        if opts.ending_offsets is not None or opts.ending_timestamp is not None:
            # As Spark's Kafka source: a stream has no end; ignoring it would read past it.
            raise InvalidConfig(
                "endingOffsets and endingTimestamp are for batch queries only, not streams"
            )
        return RedisqStreamReader(opts)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return RedisqBatchWriter(WriteOptions.parse(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return RedisqStreamWriter(WriteOptions.parse(self.options, schema, overwrite))


__all__ = [
    "FORMAT",
    "DataLossError",
    "RangePartition",
    "ReadOptions",
    "RedisqDataSource",
]
