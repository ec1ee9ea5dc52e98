"""Planning and reading ranges of partition streams: one Spark partition per topic partition
(split by time with minPartitions), each read with XRANGE over [start, end) into Arrow batches.

Every plain command goes to its key's node with raw replies (spark_connector.raw), so the same
code reads standalone servers, Sentinel and Redis Cluster; count_range.lua goes through redisq's
Scripts, which are cluster-safe.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

import redisq
from redisq.errors import PartitionOutOfRange, RedisqError
from redisq.model.batches import MAX_COUNT, parse_offset
from redisq.model.offsets import MAX_STREAM_ID, MAX_STREAM_ID_PART, offset_before
from redisq.model.records import parse_id_field
from redisq.protocol import Command
from spark_connector.arrow_rows import MalformedCount, arrow_schema, to_record_batch
from spark_connector.offsets import END_OF_IDS, StreamState, id_less, id_parts, upper_bound
from spark_connector.options import ReadOptions
from spark_connector.raw import REDIRECTS, RawNodes, pairs

log = logging.getLogger("redisq.spark.source")


class DataLossError(RedisqError):
    """Retention (or XDEL) removed messages the query has not read yet (failOnDataLoss=true)."""


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def xinfo_stream(key: str) -> Command[StreamState]:
    """XINFO STREAM, decoded from the raw reply (first entry and last generated ID)."""

    def decode(reply: Any) -> StreamState:
        info = pairs(reply)
        first = info.get("first-entry")
        return StreamState(
            first_id=_decode(first[0]) if first else None,
            last_generated_id=_decode(info.get("last-generated-id") or b"0-0"),
            last_offset=_last_offset(info.get("last-entry")),
        )

    return Command(("XINFO", "STREAM", key), decode)


def _last_offset(entry: Any) -> str | None:
    """The last message offset of a batch entry ms-s of n messages, ms-(s+n-1); None for any
    other entry (or none)."""
    if not entry or len(entry) != 2:
        return None
    entry_id, fields = entry
    if not isinstance(fields, list) or not fields or fields[0] != b"b" or b"v" in fields[0::2]:
        return None
    found = dict(zip(fields[0::2], fields[1::2], strict=False))
    n = parse_id_field(found.get(b"n"))
    at = parse_offset(entry_id)
    if n is None or at is None or not 1 <= n <= MAX_COUNT or at[1] + n - 1 > MAX_STREAM_ID_PART:
        return None
    return f"{at[0]}-{at[1] + n - 1}"


def xrange(key: str, start: str, end: str, count: int, reverse: bool = False) -> Command[Any]:
    """XRANGE start end COUNT count (XREVRANGE end start when reverse): raw [[id, [f, v, ...]]].
    start and end are XRANGE's bounds as given ("(" for exclusive)."""
    if reverse:
        return Command(("XREVRANGE", key, end, start, "COUNT", count))
    return Command(("XRANGE", key, start, end, "COUNT", count))


def stream_states(broker: redisq.Broker, parts: Sequence[tuple[str, int]]) -> list[StreamState]:
    """XINFO STREAM of many partitions, one round trip per node."""
    keys = [broker.keys.log(topic, p) for topic, p in parts]
    return RawNodes(broker.client).run_all([(key, xinfo_stream(key)) for key in keys])


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
    upper = upper_bound(end)
    first, last = RawNodes(broker.client).run_all(
        [(key, xrange(key, start, upper, 1)), (key, xrange(key, start, upper, 1, True))]
    )
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


def reader_broker(url: str, namespace: str) -> redisq.Broker:
    """A broker per worker process (Python workers are reused between tasks)."""
    cached = _PROCESS_CLIENTS.get((url, namespace))
    if cached is not None and cached[0] == os.getpid():
        return cached[1]
    broker = redisq.connect(url, namespace=namespace)
    _PROCESS_CLIENTS[(url, namespace)] = (os.getpid(), broker)
    return broker


def holding_entry(client: Any, key: str, start: str) -> list[Any]:
    """The batch entry that holds the message offset `start` but begins before it, as [entry]
    ([] when there is none): a range's first read resumes inside it (DESIGN §14.10), as
    Broker.read does, since XRANGE from `start` begins at the entry after it.

    An entry begins and ends in one millisecond, so no entry holds an offset <ms>-0 but the one
    with that ID (which XRANGE gives): then nothing is asked."""
    if start == END_OF_IDS or id_parts(start)[1] == 0:
        return []
    (reply,) = RawNodes(client).run_all([(key, xrange(key, "-", start, 1, reverse=True))])
    if not reply:
        return []
    entry_id, fields = reply[0]
    if _decode(entry_id) == start or not fields or fields[0] != b"b":
        return []  # the entry at start (XRANGE gives it), or an entry of one offset before it
    return [reply[0]]


def read_range(opts: ReadOptions, part: RangePartition) -> Iterator[pa.RecordBatch]:
    """Messages [start, end) in fetch_count-entry chunks, one Arrow batch per chunk. start and
    end are message offsets: the first chunk begins with the batch entry holding start, if one
    begins before it, cut there; a batch entry holding end is cut before it."""
    broker = reader_broker(opts.url, opts.namespace)
    key = broker.keys.log(part.topic, part.partition)
    schema = arrow_schema(opts.include_headers, opts.include_metadata)
    checked = False
    malformed = MalformedCount()
    head = holding_entry(broker.client, key, part.start)
    after = offset_before(part.start) if head else None
    upto = None if part.end == END_OF_IDS else part.end
    for entries in _xrange_chunks(broker.client, key, part.start, part.end, opts.fetch_count):
        if not checked:
            # After the first read: anything trimmed before it is visible to this check.
            _check_data_loss(broker, opts, part)
            checked = True
        if head:
            entries = head + list(entries)
            head = []
        if entries:
            batch = to_record_batch(
                entries,
                part.topic,
                part.partition,
                opts.include_headers,
                opts.include_metadata,
                schema,
                malformed,
                after=after,
                upto=upto,
            )
            after = None
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

    The next XRANGE is sent before the current chunk is handed on: the server and the network
    work while this process builds the Arrow batch. The next cursor is known from the raw
    reply's last ID, so nothing waits for the conversion. If the cluster's slots move, the
    scan goes on from the last ID it handed on, at the slot's new node."""
    nodes = RawNodes(client)
    upper = upper_bound(end)
    cursor = start
    redirects = 0
    while True:

        def following(entries: Any) -> tuple[Any, ...] | None:
            if len(entries) < count or _decode(entries[-1][0]) == MAX_STREAM_ID:
                return None  # (nothing follows the largest ID, and no range starts after it)
            return ("XRANGE", key, "(" + _decode(entries[-1][0]), upper, "COUNT", count)

        try:
            for entries in nodes.stream(
                key, ("XRANGE", key, cursor, upper, "COUNT", count), following
            ):
                if entries:
                    cursor = "(" + _decode(entries[-1][0])
                yield entries
            return
        except REDIRECTS:
            redirects += 1
            if redirects > 3:
                raise
            nodes.refresh()


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
