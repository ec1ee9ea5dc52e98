"""The "redisq" data source on batch topics (entry_format="batch", DESIGN §14.10): batch and
streaming reads give every message once at its own offset ms-(s+i), ranges may start and end
inside an entry, maxOffsetsPerTrigger counts messages, and writes store messages that read back."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import redisq  # noqa: E402  (after the importorskip in tests/spark/fixtures.py)
from spark_connector.raw import RawNodes
from spark_connector.scan import xrange
from tests.spark.fixtures import (  # noqa: F401
    broker_url,
    reader,
    spark,
    spark_broker,
    stream_reader,
    write,
)
from tests.spark.test_source import as_tuples, expected_rows, run_stream

pytestmark = pytest.mark.spark


def produce_batches(broker: redisq.Broker, topic: str, count: int, start: int = 0) -> None:
    """count messages in batches of up to 16 (value v<i>, key k<i % 7>, header i)."""
    with broker.producer(linger_ms=20, max_batch_messages=16) as producer:
        for i in range(start, start + count):
            producer.send_async(topic, b"v%d" % i, key=b"k%d" % (i % 7), headers={"i": str(i)})
        producer.flush()


def entries_of(broker: redisq.Broker, topic: str, p: int) -> list[Any]:
    key = broker.keys.log(topic, p)
    (entries,) = RawNodes(broker.client).run_all([(key, xrange(key, "-", "+", 100_000))])
    return entries


def batch_topic(broker: redisq.Broker, topic: str, partitions: int, count: int) -> None:
    broker.create_topic(topic, partitions=partitions, entry_format="batch")
    produce_batches(broker, topic, count)
    for p in range(partitions):
        entries = entries_of(broker, topic, p)
        assert entries and all(fields[0] == b"b" for _, fields in entries)
        assert len(entries) < len(list(broker.read(topic, p)))  # several messages an entry


def test_batch_read_gives_every_message_once_at_its_offset(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    batch_topic(spark_broker, "b", 2, 300)
    df = reader(
        spark, spark_broker, subscribe="b", includeHeaders=True, includeMetadata=True, fetchCount=3
    )
    rows = df.collect()
    assert as_tuples(rows) == expected_rows(spark_broker, "b")
    assert len(rows) == 300
    assert sorted(bytes(r.value) for r in rows) == sorted(b"v%d" % i for i in range(300))
    for r in rows:
        i = int(bytes(r.value)[1:])
        assert bytes(r.key) == b"k%d" % (i % 7)
        assert [(h.key, bytes(h.value)) for h in r.headers] == [("i", str(i).encode())]
        ms, seq = map(int, r.offset.split("-"))
        assert (r.offset_ms, r.offset_seq) == (ms, seq) and r.producer_id is not None
    # A producer's sequences are s + i, one per message: the ordering audit's input.
    for p in (0, 1):
        seqs = [r.sequence for r in rows if r.partition == p]
        assert seqs == list(range(len(seqs)))


def test_a_range_starting_and_ending_inside_entries(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    batch_topic(spark_broker, "r", 1, 100)
    messages = list(spark_broker.read("r", 0))
    offsets = [m.offset for m in messages]
    entry_ids = {e[0].decode() for e in entries_of(spark_broker, "r", 0)}
    # The first message after an entry's first one, and the last message of some entry.
    start = next(i for i, o in enumerate(offsets) if o not in entry_ids)
    end = next(i for i in range(start + 20, 100) if offsets[i] not in entry_ids)
    df = reader(
        spark,
        spark_broker,
        subscribe="r",
        startingOffsets=json.dumps({"r": {"0": offsets[start]}}),
        endingOffsets=json.dumps({"r": {"0": offsets[end]}}),  # exclusive
        fetchCount=2,
    )
    got = [(r.offset, bytes(r.value)) for r in df.collect()]
    assert got == [(m.offset, m.value) for m in messages[start:end]]
    # With minPartitions the range is split at millisecond boundaries: nothing lost or repeated.
    split = reader(
        spark,
        spark_broker,
        subscribe="r",
        startingOffsets=json.dumps({"r": {"0": offsets[start]}}),
        minPartitions=4,
    )
    assert sorted(r.offset for r in split.collect()) == sorted(offsets[start:])


def test_stream_counts_messages_and_resumes_inside_entries(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    batch_topic(spark_broker, "st", 2, 140)
    checkpoint = tmp_path / "checkpoint"
    seen: dict[int, list[tuple[int, str]]] = {}
    options = {"subscribe": "st", "startingOffsets": "earliest", "maxOffsetsPerTrigger": 25}
    query = run_stream(spark, spark_broker, checkpoint, seen, fail_on_batch=2, **options)
    with pytest.raises(Exception, match="injected failure"):
        query.awaitTermination(120)
    failed_batch = list(seen[2])
    # Micro-batches of 25 messages, not 25 entries (an entry holds up to 16).
    assert [len(seen[b]) for b in (0, 1, 2)] == [25, 25, 25]

    produce_batches(spark_broker, "st", 60, start=140)
    query = run_stream(spark, spark_broker, checkpoint, seen, **options)
    query.awaitTermination(120)
    assert query.exception() is None
    assert query.attempts[0] == 2 and seen[2] == failed_batch
    assert all(len(rows) <= 25 for rows in seen.values())
    got = [row for batch_id in sorted(seen) for row in seen[batch_id]]
    expected = [(r[3], r[4]) for r in expected_rows(spark_broker, "st")]
    assert len(got) == len(set(got)) == 200
    assert sorted(got) == sorted(expected)
    for p in range(2):
        assert [o for q, o in got if q == p] == [o for q, o in expected if q == p]
    # Some micro-batch ended inside an entry (the test is about something).
    entry_ids = {e[0].decode() for p in range(2) for e in entries_of(spark_broker, "st", p)}
    firsts = {rows[0][1] for rows in seen.values() if rows}
    assert firsts - entry_ids


def test_count_range_counts_messages_with_cuts(spark_broker: redisq.Broker) -> None:
    batch_topic(spark_broker, "c", 1, 50)
    offsets = [m.offset for m in spark_broker.read("c", 0)]
    key = spark_broker.keys.log("c", 0)

    def count(start: str, end: str, limit: int) -> tuple[int, str]:
        n, last = spark_broker.scripts.call(
            "count_range", [key], [start, end, limit, "messages"], topic="c"
        )
        return int(n), last.decode() if isinstance(last, bytes) else last

    assert count(offsets[0], "+", 1000) == (50, offsets[-1])
    for a in range(0, 50, 7):
        for b in range(a + 1, 51, 5):
            end = offsets[b] if b < 50 else "+"
            assert count(offsets[a], end, 1000) == (b - a, offsets[b - 1])
            assert count(offsets[a], end, 3) == (min(3, b - a), offsets[min(a + 3, b) - 1])
    # Without the mode, entries are counted (as before, for the other callers).
    n, _ = spark_broker.scripts.call("count_range", [key], [offsets[0], "+", 1000], topic="c")
    assert int(n) == len(entries_of(spark_broker, "c", 0))


@pytest.mark.parametrize("idempotence", ["transaction", "message_id"])
def test_exactly_once_write_into_a_batch_topic(
    spark: Any, spark_broker: redisq.Broker, idempotence: str
) -> None:
    spark_broker.create_topic("out", partitions=2, entry_format="batch")
    rows = [(b"k%d" % (i % 5), b"w%d" % i, b"id%d" % i) for i in range(400)]
    df = spark.createDataFrame(rows, "key binary, value binary, message_id binary").repartition(3)
    write(df, spark_broker, topic="out", idempotence=idempotence, batchSize=50)
    if idempotence == "message_id":
        write(df, spark_broker, topic="out", idempotence=idempotence, batchSize=50)  # no dups
    back = reader(spark, spark_broker, subscribe="out", includeMetadata=True).collect()
    assert sorted(bytes(r.value) for r in back) == sorted(v for _, v, _ in rows)
    for r in back:
        assert bytes(r.key) == b"k%d" % (int(bytes(r.value)[1:]) % 5)
    if idempotence == "message_id":
        assert sorted(bytes(r.message_id) for r in back) == sorted(m for _, _, m in rows)
    # Written as batch entries, the topic's format (transactions: tx_apply.lua appends each
    # staged batch as one entry).
    for p in range(2):
        entries = entries_of(spark_broker, "out", p)
        assert all(fields[0] == b"b" for _, fields in entries)
        assert len(entries) < sum(1 for r in back if r.partition == p)
    assert as_tuples(back) == expected_rows(spark_broker, "out")


def test_audits_count_messages_of_batch_entries(spark: Any, spark_broker: redisq.Broker) -> None:
    from spark_connector import content_audit, jobs

    batch_topic(spark_broker, "au", 2, 200)
    df = jobs.read_topic(spark, broker_url(spark_broker), spark_broker.namespace, "au")
    result = jobs.run_ordering_audit(df)
    assert result.clean and result.messages == 200
    assert sum(int(r.messages) for r in result.rows) == 200
    assert content_audit.run(df).clean
    # A second entry appended again by a writer without idempotence (a plain XADD of its fields):
    # every message of it is a duplicate, counted one by one.
    key = spark_broker.keys.log("au", 1)
    entry_id, fields = entries_of(spark_broker, "au", 1)[1]  # not the first: sequence 0 opens a run
    n = int(dict(zip(fields[0::2], fields[1::2], strict=True))[b"n"])
    assert n > 1
    spark_broker.client.xadd(key, dict(zip(fields[0::2], fields[1::2], strict=True)))
    df = jobs.read_topic(spark, broker_url(spark_broker), spark_broker.namespace, "au")
    result = jobs.run_ordering_audit(df)
    assert result.messages == 200 + n and result.duplicates == n
    content = content_audit.run(df)
    assert content.duplicated == n and {r.partition: r.duplicated for r in content.partitions} == {
        1: n
    }
