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
        m.value
        for p in range(broker.topic_config(topic).partitions)
        for m in broker.read(topic, p)
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
