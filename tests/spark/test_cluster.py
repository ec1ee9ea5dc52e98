"""The "redisq" data source on a three-master Redis Cluster: batch and streaming reads and
writes (a topic's partitions, each write's record and each task's transaction sit on different
nodes; no pipelined script crosses a slot)."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import redisq
from tests.conftest import drop_namespace
from tests.spark.fixtures import broker_url, fail_first_attempts, produce, spark, transaction_states  # noqa: F401

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


@pytest.fixture
def cluster_broker(valkey_cluster3: Any) -> Iterator[redisq.Broker]:
    url = f"redis://127.0.0.1:{valkey_cluster3[0].port}"
    broker = redisq.connect(url, namespace=f"k{uuid.uuid4().hex[:10]}")
    yield broker
    drop_namespace(broker)
    broker.close()


def options(broker: redisq.Broker, **extra: Any) -> dict[str, str]:
    return {
        "url": broker_url(broker),
        "namespace": broker.namespace,
        **{k: str(v) for k, v in extra.items()},
    }


def content(broker: redisq.Broker, topic: str) -> Counter[tuple[bytes | None, bytes]]:
    n = broker.topic_config(topic).partitions
    return Counter((m.key, m.value) for p in range(n) for m in broker.read(topic, p))


def test_batch_read_on_a_cluster_matches_xrange(spark: Any, cluster_broker: redisq.Broker) -> None:
    cluster_broker.create_topic("orders", partitions=6)
    produce(cluster_broker, "orders", 900, keys=31)
    nodes = {
        cluster_broker.client.get_node_from_key(cluster_broker.keys.log("orders", p)).name
        for p in range(6)
    }
    assert len(nodes) >= 2  # the partitions really are spread over the masters
    df = (
        spark.read.format("redisq")
        .options(**options(cluster_broker, subscribe="orders", fetchCount=100, minPartitions=9))
        .load()
    )
    rows = df.collect()
    expected = [
        (m.partition, m.offset, m.key, m.value)
        for p in range(6)
        for m in cluster_broker.read("orders", p)
    ]
    got = sorted((r.partition, r.offset, bytes(r.key), bytes(r.value)) for r in rows)
    assert got == sorted(expected) and len(got) == 900


def test_batch_write_with_failed_attempts_on_a_cluster(
    spark: Any, cluster_broker: redisq.Broker
) -> None:
    cluster_broker.create_topic("out", partitions=6)
    source = spark.range(0, 3000, numPartitions=2).selectExpr(
        "cast(id % 53 as string) as key",
        "cast(concat('v', id, ':', repeat('x', 1000)) as binary) as value",
    )
    df = fail_first_attempts(source.repartition(2, "key"), 600, cluster_broker)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        df.write.format("redisq").options(
            **options(cluster_broker, topic="out", batchSize=20, maxInFlight=1)
        ).mode("append").save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    expected = Counter((r.key.encode(), bytes(r.value)) for r in source.collect())
    assert content(cluster_broker, "out") == expected
    assert Counter(transaction_states(cluster_broker).values()) == Counter(
        {"committed": 2, "aborted": 2}
    )


def test_streaming_copy_on_a_cluster_restarts_without_loss_or_repeat(
    spark: Any, cluster_broker: redisq.Broker, tmp_path: Path
) -> None:
    cluster_broker.create_topic("src", partitions=4)
    cluster_broker.create_topic("dst", partitions=3)
    produce(cluster_broker, "src", 400, keys=13)
    checkpoint = tmp_path / "cp"

    def run() -> None:
        query = (
            spark.readStream.format("redisq")
            .options(
                **options(
                    cluster_broker,
                    subscribe="src",
                    startingOffsets="earliest",
                    maxOffsetsPerTrigger=150,
                )
            )
            .load()
            .select("key", "value")
            .writeStream.format("redisq")
            .options(**options(cluster_broker, topic="dst"))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(180)
        assert query.exception() is None

    run()
    produce(cluster_broker, "src", 100, keys=13, start=400)
    # Replay the last micro-batch as well, as after a crash before Spark's commit log.
    last = max(int(f.name) for f in (checkpoint / "commits").iterdir() if f.name.isdigit())
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    run()
    assert content(cluster_broker, "dst") == content(cluster_broker, "src")
    assert sum(content(cluster_broker, "dst").values()) == 500
