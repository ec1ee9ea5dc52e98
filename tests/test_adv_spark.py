"""Adversarial tests of the Spark connector's promises (README "Spark: topics as DataFrames"):
each test here is a way found to break one, kept as a regression test."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark_conftest)

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import redisq
from tests.spark_conftest import (  # noqa: F401
    broker_url,
    produce,
    reader,
    spark,
    spark_broker,
    stream_reader,
    transaction_states,
)

pytestmark = pytest.mark.spark


def write(df: Any, broker: redisq.Broker, **options: Any) -> None:
    builder = df.write.format("redisq").mode("append")
    builder = builder.option("url", broker_url(broker)).option("namespace", broker.namespace)
    for name, value in options.items():
        builder = builder.option(name, str(value))
    builder.save()


def values(broker: redisq.Broker, topic: str) -> Counter[bytes]:
    return Counter(
        m.value for p in range(broker.topic_config(topic).partitions) for m in broker.read(topic, p)
    )


def test_two_writes_in_one_foreach_batch_both_land(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    """foreachBatch is the README's streaming pattern; a batch write inside it is a write of its
    own. Two writes of one micro-batch (to two topics, or twice to one) must each land."""
    spark_broker.create_topic("fb-src", partitions=2)
    spark_broker.create_topic("fb-a", partitions=2)
    spark_broker.create_topic("fb-b", partitions=2)
    produce(spark_broker, "fb-src", 40)

    def handle(batch: Any, batch_id: int) -> None:
        rows = batch.select("key", "value")
        write(rows, spark_broker, topic="fb-a")
        write(rows, spark_broker, topic="fb-b")

    query = (
        stream_reader(spark, spark_broker, subscribe="fb-src", startingOffsets="earliest")
        .writeStream.foreachBatch(handle)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    expected = Counter(b"v%d" % i for i in range(40))
    assert values(spark_broker, "fb-a") == expected
    assert values(spark_broker, "fb-b") == expected


MAX_PART = (1 << 64) - 1


def test_a_foreign_entry_at_the_largest_sequence_of_a_millisecond_is_read(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    """Foreign entries never block anything (README): an entry another client XADDs at
    <ms>-18446744073709551615 is a valid stream ID; the next ID carries into the milliseconds
    (records.offset_after), so a batch read (end = latest, exclusive) reads it."""
    spark_broker.create_topic("edge", partitions=1)
    key = spark_broker.keys.log("edge", 0)
    spark_broker.client.xadd(key, {"v": b"foreign"}, id=f"5-{MAX_PART}")
    rows = reader(spark, spark_broker, subscribe="edge").collect()
    assert [(bytes(r.value), r.offset) for r in rows] == [(b"foreign", f"5-{MAX_PART}")]


def test_a_foreign_entry_at_the_largest_sequence_is_read_by_a_rate_limited_stream(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    spark_broker.create_topic("edge-s", partitions=1)
    key = spark_broker.keys.log("edge-s", 0)
    spark_broker.client.xadd(key, {"v": b"foreign"}, id=f"5-{MAX_PART}")
    produce(spark_broker, "edge-s", 3)
    seen: list[bytes] = []
    query = (
        stream_reader(
            spark,
            spark_broker,
            subscribe="edge-s",
            startingOffsets="earliest",
            maxOffsetsPerTrigger=1,
        )
        .writeStream.foreachBatch(lambda b, _: seen.extend(bytes(r.value) for r in b.collect()))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    assert seen == [b"foreign", b"v0", b"v1", b"v2"]


def test_a_foreign_entry_at_the_largest_id_does_not_block_a_batch_read(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("edge-max", partitions=1)
    produce(spark_broker, "edge-max", 2)
    key = spark_broker.keys.log("edge-max", 0)
    spark_broker.client.xadd(key, {"v": b"foreign"}, id=f"{MAX_PART}-{MAX_PART}")
    rows = reader(spark, spark_broker, subscribe="edge-max").collect()
    assert sorted(bytes(r.value) for r in rows) == [b"foreign", b"v0", b"v1"]


def test_a_stream_reads_an_entry_at_the_largest_id_once_and_restarts_after_it(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    spark_broker.create_topic("edge-max-s", partitions=1)
    produce(spark_broker, "edge-max-s", 2)
    key = spark_broker.keys.log("edge-max-s", 0)
    spark_broker.client.xadd(key, {"v": b"foreign"}, id=f"{MAX_PART}-{MAX_PART}")
    seen: list[bytes] = []

    def run() -> None:
        query = (
            stream_reader(
                spark,
                spark_broker,
                subscribe="edge-max-s",
                startingOffsets="earliest",
                maxOffsetsPerTrigger=2,
            )
            .writeStream.foreachBatch(lambda b, _: seen.extend(bytes(r.value) for r in b.collect()))
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(180)
        assert query.exception() is None

    run()
    assert seen == [b"v0", b"v1", b"foreign"]
    run()  # restarted from its checkpoint: nothing again, no error
    assert seen == [b"v0", b"v1", b"foreign"]
