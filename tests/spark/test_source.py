"""The "redisq" Spark data source: schema, batch reads, offsets, streaming, data loss."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

import redisq  # noqa: E402  (after the importorskip in tests/spark/fixtures.py)
from spark_connector.offsets import next_id
from tests.spark.fixtures import produce, reader, spark, spark_broker, stream_reader  # noqa: F401

pytestmark = pytest.mark.spark


def expected_rows(broker: redisq.Broker, topic: str) -> list[tuple[Any, ...]]:
    """What XRANGE says, partition after partition: the order a batch read must give."""
    rows = []
    for p in range(broker.topic_config(topic).partitions):
        for m in broker.read(topic, p):
            rows.append((m.key, m.value, m.topic, m.partition, m.offset))
    return rows


def as_tuples(rows: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (None if r.key is None else bytes(r.key), bytes(r.value), r.topic, r.partition, r.offset)
        for r in rows
    ]


def test_schema(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("s", partitions=1)
    plain = reader(spark, spark_broker, subscribe="s")
    assert [(f.name, f.dataType.simpleString()) for f in plain.schema.fields] == [
        ("key", "binary"),
        ("value", "binary"),
        ("topic", "string"),
        ("partition", "int"),
        ("offset", "string"),
        ("offset_ms", "bigint"),
        ("offset_seq", "bigint"),
        ("timestamp", "timestamp"),
    ]
    full = reader(spark, spark_broker, subscribe="s", includeHeaders=True, includeMetadata=True)
    assert [(f.name, f.dataType.simpleString()) for f in full.schema.fields][8:] == [
        ("headers", "array<struct<key:string,value:binary>>"),
        ("producer_id", "bigint"),
        ("sequence", "bigint"),
        ("message_id", "binary"),
    ]


def test_batch_read_returns_what_was_produced_in_partition_order(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("orders", partitions=3)
    produce(spark_broker, "orders", 600)
    with spark_broker.producer(idempotence="message_id") as producer:
        producer.send("orders", b"with-headers", key=b"h", headers={"a": b"\x00\xff", "b": "x"})
        producer.send("orders", b"no-key", message_id=b"mid-1")
    df = reader(
        spark,
        spark_broker,
        subscribe="orders",
        includeHeaders=True,
        includeMetadata=True,
        fetchCount=100,  # several Arrow batches per partition
    )
    rows = df.collect()
    assert as_tuples(rows) == expected_rows(spark_broker, "orders")
    assert len(rows) == 602
    by_value = {bytes(r.value): r for r in rows}
    headed = by_value[b"with-headers"]
    assert [(h.key, bytes(h.value)) for h in headed.headers] == [("a", b"\x00\xff"), ("b", b"x")]
    assert by_value[b"no-key"].key is None
    assert bytes(by_value[b"no-key"].message_id) == b"mid-1"
    first = by_value[b"v0"]
    assert first.producer_id is not None and first.sequence is not None
    ms, seq = first.offset.split("-")
    assert (first.offset_ms, first.offset_seq) == (int(ms), int(seq))
    assert int(first.timestamp.timestamp() * 1000) == int(ms)
    # Sequences of one producer on one partition are 0, 1, 2, ... in offset order.
    for p in range(3):
        seqs = [r.sequence for r in rows if r.partition == p and r.producer_id == first.producer_id]
        assert seqs == list(range(len(seqs)))


def test_starting_and_ending_offsets_json(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("j", partitions=2)
    produce(spark_broker, "j", 200)
    p0 = [m.offset for m in spark_broker.read("j", 0)]
    p1 = [m.offset for m in spark_broker.read("j", 1)]
    starting = json.dumps({"j": {"0": p0[10], "1": -2}})
    ending = json.dumps({"j": {"0": p0[20], "1": "latest"}})
    df = reader(spark, spark_broker, subscribe="j", startingOffsets=starting, endingOffsets=ending)
    got = [(r.partition, r.offset) for r in df.collect()]
    # start inclusive, end exclusive
    assert got == [(0, o) for o in p0[10:20]] + [(1, o) for o in p1]

    only = reader(
        spark,
        spark_broker,
        assign=json.dumps({"j": [1]}),
        startingOffsets=json.dumps({"j": {"1": p1[-1]}}),
    )
    assert [r.offset for r in only.collect()] == [p1[-1]]

    # By time: entries of [startingTimestamp, endingTimestamp).
    ms = int(p0[5].split("-")[0])
    timed = reader(spark, spark_broker, subscribe="j", startingTimestamp=ms, endingTimestamp=ms + 1)
    assert {r.offset for r in timed.collect()} == {o for o in p0 + p1 if o.startswith(f"{ms}-")}


def test_min_partitions_splits_by_time_and_keeps_every_row(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("split", partitions=1)
    for start in range(0, 400, 100):  # four appends in different milliseconds at least
        produce(spark_broker, "split", 100, start=start)
        threading.Event().wait(0.01)
    df = reader(spark, spark_broker, subscribe="split", minPartitions=4)
    assert df.rdd.getNumPartitions() >= 2
    assert as_tuples(df.collect()) == expected_rows(spark_broker, "split")


def test_bad_options_are_reported(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("bad", partitions=1)
    with pytest.raises(Exception, match="unknown redisq read option"):
        reader(spark, spark_broker, subscribe="bad", maxOffsetPerTrigger=10).collect()
    with pytest.raises(Exception, match="exactly one of"):
        reader(spark, spark_broker).collect()


def run_stream(
    spark: Any,
    broker: redisq.Broker,
    checkpoint: Path,
    seen: dict[int, list[tuple[int, str]]],
    *,
    fail_on_batch: int | None = None,
    **options: Any,
) -> Any:
    """A query through foreachBatch that records each micro-batch's rows by batch id (a replayed
    batch id replaces its earlier record, as an idempotent foreachBatch sink would)."""
    attempts: list[int] = []

    def record(batch_df: Any, batch_id: int) -> None:
        rows = [(r.partition, r.offset) for r in batch_df.collect()]
        seen[batch_id] = rows
        attempts.append(batch_id)
        if fail_on_batch is not None and batch_id == fail_on_batch:
            raise RuntimeError("injected failure in foreachBatch")

    df = stream_reader(spark, broker, **options)
    query = (
        df.writeStream.foreachBatch(record)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.attempts = attempts
    return query


def test_stream_restart_from_checkpoint_loses_and_repeats_no_row(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    spark_broker.create_topic("st", partitions=3)
    produce(spark_broker, "st", 100)
    checkpoint = tmp_path / "checkpoint"
    seen: dict[int, list[tuple[int, str]]] = {}
    options = {"subscribe": "st", "startingOffsets": "earliest", "maxOffsetsPerTrigger": 30}

    # Run 1 dies in micro-batch 1, after its sink saw the rows but before Spark committed it.
    query = run_stream(spark, spark_broker, checkpoint, seen, fail_on_batch=1, **options)
    with pytest.raises(Exception, match="injected failure"):
        query.awaitTermination(120)
    failed_batch = list(seen[1])
    assert [len(seen[0]), len(seen[1])] == [30, 30]

    produce(spark_broker, "st", 50, start=100)
    # Run 2 restarts from the checkpoint: micro-batch 1 again, with the same rows, then on.
    query = run_stream(spark, spark_broker, checkpoint, seen, **options)
    query.awaitTermination(120)
    assert query.exception() is None
    assert query.attempts[0] == 1 and seen[1] == failed_batch
    assert all(len(rows) <= 30 for rows in seen.values())
    got = [row for batch_id in sorted(seen) for row in seen[batch_id]]
    expected = [(r[3], r[4]) for r in expected_rows(spark_broker, "st")]
    assert len(got) == len(set(got)) == 150
    assert sorted(got) == sorted(expected)
    # Each partition's rows arrive in offset order across micro-batches.
    for p in range(3):
        offsets = [o for q, o in got if q == p]
        assert offsets == [o for q, o in expected if q == p]

    # Offsets in the checkpoint: {topic: {partition: next ID}}, keys sorted.
    last = max(
        (checkpoint / "offsets").iterdir(), key=lambda f: int(f.name) if f.name.isdigit() else -1
    )
    offset = json.loads(last.read_text().splitlines()[-1])
    assert list(offset) == ["st"] and list(offset["st"]) == ["0", "1", "2"]


def test_available_now_reads_what_exists_and_stops(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    spark_broker.create_topic("an", partitions=2)
    produce(spark_broker, "an", 45)
    seen: dict[int, list[tuple[int, str]]] = {}
    query = run_stream(
        spark,
        spark_broker,
        tmp_path / "cp",
        seen,
        subscribe="an",
        startingOffsets="earliest",
        maxOffsetsPerTrigger=20,
    )
    assert query.awaitTermination(120)  # ends by itself
    assert [len(seen[b]) for b in sorted(seen)] == [20, 20, 5]
    # Started again with nothing new: no batch with rows.
    query = run_stream(spark, spark_broker, tmp_path / "cp", seen, subscribe="an")
    assert query.awaitTermination(120)
    assert sum(len(rows) for rows in seen.values()) == 45


@pytest.mark.parametrize("entry_format", ["message", "batch"])
def test_fail_on_data_loss_after_retention_trimmed_past_the_start(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path, entry_format: str
) -> None:
    spark_broker.create_topic("loss", partitions=1, entry_format=entry_format)
    produce(spark_broker, "loss", 50)
    checkpoint = tmp_path / "cp"
    seen: dict[int, list[tuple[int, str]]] = {}
    query = run_stream(
        spark, spark_broker, checkpoint, seen, subscribe="loss", startingOffsets="earliest"
    )
    query.awaitTermination(120)
    assert sum(len(r) for r in seen.values()) == 50

    produce(spark_broker, "loss", 50, start=50)
    offsets = [m.offset for m in spark_broker.read("loss", 0)]
    if entry_format == "message":
        # Retention removes at least 30 unread messages. The cut is placed inside a millisecond
        # (see StreamState.lost_from: a cut exactly at a millisecond boundary is not
        # detectable), which needs one entry a message: several entries in a millisecond.
        cut = next(i for i in range(80, 100) if not offsets[i].endswith("-0"))
        minid = offsets[cut]
    else:
        # Retention trims whole entries, and a batch entry mostly opens its millisecond (ID
        # ms-0), a cut lost_from cannot tell: here it removed every unread message.
        cut = 100
        minid = next_id(offsets[-1])
    spark_broker.client.xtrim(spark_broker.keys.log("loss", 0), minid=minid, approximate=False)
    kept_offsets = [m.offset for m in spark_broker.read("loss", 0)]
    assert kept_offsets == offsets[cut:]
    query = run_stream(spark, spark_broker, checkpoint, seen, subscribe="loss")
    with pytest.raises(Exception, match="DataLossError"):
        query.awaitTermination(120)

    seen.clear()
    query = run_stream(
        spark, spark_broker, checkpoint, seen, subscribe="loss", failOnDataLoss=False
    )
    query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(offset for rows in seen.values() for _, offset in rows) == sorted(kept_offsets)

    # A batch read from an explicit offset that retention removed fails the same way.
    start = json.dumps({"loss": {"0": offsets[0]}})
    with pytest.raises(Exception, match="DataLossError"):
        reader(spark, spark_broker, subscribe="loss", startingOffsets=start).collect()
    kept = reader(
        spark, spark_broker, subscribe="loss", startingOffsets=start, failOnDataLoss=False
    )
    assert kept.count() == len(kept_offsets)
