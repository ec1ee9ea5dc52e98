"""Writing DataFrames to topics with the "redisq" data source: routing and exactly once (local
mode; the standalone cluster with a killed executor is tests/spark/test_standalone.py)."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import redisq
from redisq.model.partitioner import partition_for_key
from tests.spark.fixtures import (  # noqa: F401
    broker_url,
    fail_first_attempts,
    produce,
    spark,
    spark_broker,
    stream_reader,
    transaction_states,
    write,
)

pytestmark = pytest.mark.spark


def all_messages(broker: redisq.Broker, topic: str) -> list[redisq.Message]:
    return [m for p in range(broker.topic_config(topic).partitions) for m in broker.read(topic, p)]


def content(broker: redisq.Broker, topic: str) -> Counter[tuple[bytes | None, bytes]]:
    """The topic as a multiset of (key, value): what a row-for-row comparison needs."""
    return Counter((m.key, m.value) for m in all_messages(broker, topic))


def test_write_routes_like_the_python_producer(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("out", partitions=4)
    rows = [
        (f"key-{i % 13}" if i % 5 else None, f"value-{i}".encode(), {"n": str(i)})
        for i in range(500)
    ]
    df = spark.createDataFrame(rows, "key string, value binary, headers map<string,string>")
    write(df.repartition(3), spark_broker, topic="out", batchSize=50)
    messages = all_messages(spark_broker, "out")
    assert sorted(m.value for m in messages) == sorted(r[1] for r in rows)
    for m in messages:
        i = int(m.value.split(b"-")[1])
        assert m.headers == {"n": str(i).encode()}
        if m.key is not None:
            assert m.key == f"key-{i % 13}".encode()
            assert m.partition == partition_for_key(m.key, 4)
        else:
            assert i % 5 == 0
    assert all(state == "committed" for state in transaction_states(spark_broker).values())


def test_rows_of_one_task_keep_their_order_per_key(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("ordered", partitions=3)
    df = spark.range(0, 4000, numPartitions=2).selectExpr(
        "cast(id % 17 as string) as key", "cast(id as string) as value"
    )
    write(df, spark_broker, topic="ordered", batchSize=64, maxInFlight=2)
    by_task: dict[tuple[bytes | None, int | None], list[int]] = {}
    for m in all_messages(spark_broker, "ordered"):
        by_task.setdefault((m.key, m.producer_id), []).append(int(m.value))
    assert len({pid for _, pid in by_task}) == 2  # one writer per task
    for values in by_task.values():
        assert values == sorted(values)
    assert sum(len(v) for v in by_task.values()) == 4000


def test_failed_task_attempts_after_a_shuffle_leave_every_row_exactly_once(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("once", partitions=3)
    source = spark.range(0, 6000, numPartitions=3).selectExpr(
        "cast(id % 101 as string) as key",
        "cast(concat('v', id, ':', repeat('x', 1000)) as binary) as value",
    )
    # After the shuffle, each write task's first attempt dies once 600 of its rows went
    # through (by then it has staged batches); Spark retries it (local[2,2]: 2 attempts).
    df = fail_first_attempts(source.repartition(2, "key"), 600, spark_broker)
    context = spark.sparkContext
    context.setJobGroup("fail-once", "writer with injected task failures")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        write(df, spark_broker, topic="once", batchSize=20, maxInFlight=1)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
        context.setLocalProperty("spark.jobGroup.id", None)
    tracker = context.statusTracker()
    stages = [
        s for j in tracker.getJobIdsForGroup("fail-once") for s in tracker.getJobInfo(j).stageIds
    ]
    assert sum(tracker.getStageInfo(s).numFailedTasks for s in stages) == 2  # both retried
    expected = Counter((bytes(r.key, "ascii"), bytes(r.value)) for r in source.collect())
    assert content(spark_broker, "once") == expected
    # The failed attempts had staged rows: their transactions were aborted, not committed.
    states = Counter(transaction_states(spark_broker).values())
    assert states == Counter({"committed": 2, "aborted": 2})


def test_message_id_column_dedups_a_second_write(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("ids", partitions=2)
    df = spark.createDataFrame(
        [(f"order-{i}", f"paid-{i}", f"k{i % 3}") for i in range(200)],
        "message_id string, value string, key string",
    )
    write(df, spark_broker, topic="ids", idempotence="message_id")
    write(df, spark_broker, topic="ids", idempotence="message_id")  # a re-run job
    messages = all_messages(spark_broker, "ids")
    assert sorted(m.message_id for m in messages) == sorted(
        f"order-{i}".encode() for i in range(200)
    )


def test_bad_write_options_are_reported(spark: Any, spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("w", partitions=1)
    df = spark.createDataFrame([("a",)], "text string")
    with pytest.raises(Exception, match="needs a value column"):
        write(df, spark_broker, topic="w")
    df = spark.createDataFrame([("a",)], "value string")
    with pytest.raises(Exception, match="choose one of"):
        write(df, spark_broker, topic="w", idempotence="sequence")
    with pytest.raises(Exception, match="overwrite"):
        (
            df.write.format("redisq")
            .mode("overwrite")
            .option("url", broker_url(spark_broker))
            .option("namespace", spark_broker.namespace)
            .option("topic", "w")
            .save()
        )


def test_stream_copy_with_a_replayed_micro_batch_writes_nothing_twice(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    spark_broker.create_topic("src", partitions=3)
    spark_broker.create_topic("dst", partitions=2)
    produce(spark_broker, "src", 300, keys=11)
    checkpoint = tmp_path / "cp"

    def run() -> None:
        query = (
            stream_reader(
                spark,
                spark_broker,
                subscribe="src",
                startingOffsets="earliest",
                maxOffsetsPerTrigger=100,
            )
            .select("key", "value", "topic")  # the topic option wins over the topic column
            .writeStream.format("redisq")
            .option("url", broker_url(spark_broker))
            .option("namespace", spark_broker.namespace)
            .option("topic", "dst")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(180)
        assert query.exception() is None

    run()
    assert len(all_messages(spark_broker, "dst")) == 300
    # Forget that the last micro-batch was committed: the restarted query runs it again,
    # with the same offsets, as after a crash between the sink's write and the commit log.
    commits = sorted((checkpoint / "commits").iterdir(), key=lambda f: f.name)
    last = [f for f in commits if f.name.isdigit()][-1]
    last.unlink()
    (checkpoint / "commits" / f".{last.name}.crc").unlink(missing_ok=True)
    run()
    copied = all_messages(spark_broker, "dst")
    assert sorted(m.value for m in copied) == sorted(b"v%d" % i for i in range(300))
    for m in copied:
        assert m.partition == partition_for_key(m.key or b"", 2)
    # The replay's own attempts were aborted; nothing is left open.
    assert "open" not in set(transaction_states(spark_broker).values())
    assert "aborted" in set(transaction_states(spark_broker).values())
