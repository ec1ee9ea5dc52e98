"""Adversarial tests of the Spark connector's promises (README "Spark: topics as DataFrames"):
each test here is a way found to break one, kept as a regression test."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import redisq
from tests.spark.fixtures import (  # noqa: F401
    broker_url,
    produce,
    reader,
    spark,
    spark_broker,
    stream_reader,
    transaction_states,
    write,
)

pytestmark = pytest.mark.spark


def read_available(
    spark: Any, broker: redisq.Broker, topic: str, per_trigger: int, checkpoint: Path
) -> list[bytes]:
    """The values a stream of `topic` reads from its checkpoint (earliest the first time), in
    micro-batches of at most per_trigger entries, until it has read what is there."""
    seen: list[bytes] = []
    query = (
        stream_reader(
            spark, broker, subscribe=topic, startingOffsets="earliest",
            maxOffsetsPerTrigger=per_trigger,
        )
        .writeStream.foreachBatch(lambda b, _: seen.extend(bytes(r.value) for r in b.collect()))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )  # fmt: skip
    query.awaitTermination(180)
    assert query.exception() is None
    return seen


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
    (offsets.offset_after), so a batch read (end = latest, exclusive) reads it."""
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
    seen = read_available(spark, spark_broker, "edge-s", 1, tmp_path / "cp")
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
    seen = read_available(spark, spark_broker, "edge-max-s", 2, tmp_path / "cp")
    assert seen == [b"v0", b"v1", b"foreign"]
    # restarted from its checkpoint: nothing again, no error
    assert read_available(spark, spark_broker, "edge-max-s", 2, tmp_path / "cp") == []


# -- passwords never shown ----------------------------------------------------------------------
SECRET = "adv-Sp4rk-s3cret"


@pytest.fixture(scope="module")
def password_server() -> Any:
    from tests.servers import ServerProcess

    server = ServerProcess().start()
    with server.client() as client:
        client.config_set("requirepass", SECRET)
    yield server
    server.stop()


def _chain(error: BaseException | None) -> list[str]:
    texts = []
    while error is not None:
        texts += [str(error), repr(error)]
        error = error.__cause__ or error.__context__
    return texts


def test_password_in_the_url_option_never_shown(
    spark: Any, password_server: Any, tmp_path: Path
) -> None:
    import uuid

    port = password_server.port
    url = f"redis://default:{SECRET}@127.0.0.1:{port}/0"
    namespace = f"adv{uuid.uuid4().hex[:8]}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic("pw", partitions=1)
        with broker.producer() as producer:
            producer.send("pw", b"v", key=b"k")
    shown: list[str] = []
    df = (
        spark.read.format("redisq")
        .option("url", url)
        .option("namespace", namespace)
        .option("subscribe", "pw")
        .load()
    )
    shown.append(df._jdf.queryExecution().toString())
    for mode in ("extended", "formatted", "cost", "codegen"):
        shown.append(spark._jvm.PythonSQLUtils.explainString(df._jdf.queryExecution(), mode))
    assert df.count() == 1
    stream = (
        spark.readStream.format("redisq")
        .option("url", url)
        .option("namespace", namespace)
        .option("subscribe", "pw")
        .option("startingOffsets", "earliest")
        .load()
    )
    shown.append(stream._jdf.queryExecution().toString())
    query = (
        stream.select("key", "value")
        .writeStream.format("redisq")
        .option("url", url)
        .option("namespace", namespace)
        .option("topic", "pw")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    shown.append(str(query.recentProgress))
    shown.append(query._jsq.toString())
    # Errors: a wrong password, a missing topic, a bad option, each with the secret in the url.
    wrong = url.replace(SECRET, SECRET + "-wrong")
    for options in (
        {"url": wrong, "subscribe": "pw"},
        {"url": url, "subscribe": "missing"},
        {"url": url, "subscribe": "pw", "startingOffsets": "{bad"},
    ):
        builder = spark.read.format("redisq").option("namespace", namespace)
        for k, v in options.items():
            builder = builder.option(k, v)
        with pytest.raises(Exception) as caught:  # noqa: B017
            builder.load().collect()
        shown += _chain(caught.value)
    for options in (
        {"url": wrong, "topic": "pw"},
        {"url": url, "topic": "missing"},
        {"url": url, "topic": "pw", "batchSize": "0"},
    ):
        builder = spark.createDataFrame([("v",)], "value string").write.format("redisq")
        builder = builder.mode("append").option("namespace", namespace)
        for k, v in options.items():
            builder = builder.option(k, v)
        with pytest.raises(Exception) as caught:  # noqa: B017
            builder.save()
        shown += _chain(caught.value)
    leaked = [text[:2000] for text in shown if SECRET in text]
    assert not leaked, leaked


# -- the commit protocol, without Spark ---------------------------------------------------------
def test_a_write_that_fails_incomplete_leaves_none_of_its_rows(valkey_server: Any) -> None:
    """One winner of a write was aborted past its timeout (the sweeper) before the driver's
    commit: the write fails (IncompleteWrite) and Spark aborts it. Its other winners must not
    land later either: a failed job is re-run, and those rows would then be there twice."""
    import uuid

    from redisq.protocol import run_operation
    from redisq.protocol import transaction_ops as tx_ops
    from spark_connector import commit
    from tests.conftest import drop_namespace
    from tests.spark.test_commit_protocol import attempt, topic_values

    broker = redisq.connect(valkey_server.url, namespace=f"adv{uuid.uuid4().hex[:10]}")
    try:
        broker.create_topic("out", partitions=3)

        def run(op: Any) -> Any:
            return run_operation(op, broker.scripts.execute)

        late = attempt(broker, "w-inc", [b"a%d" % i for i in range(9)], 0)
        fine = attempt(broker, "w-inc", [b"b%d" % i for i in range(9)], 1)
        run(tx_ops.abort(broker.keys, late, None, []))  # the sweeper, past its timeout
        with pytest.raises(commit.IncompleteWrite):
            run(commit.commit_write(broker.keys, "w-inc", [late, fine]))
        aborted = run(commit.abort_write(broker.keys, "w-inc", [late, fine]))  # Spark's abort
        assert fine in aborted
        # Later, a sweeper finds the decided transactions due (as past their deadline).
        registry = broker.keys.transactions()
        for member in broker.client.zrange(registry, 0, -1):
            broker.client.zadd(registry, {member: 0})
        broker.sweep_transactions()
        assert topic_values(broker) == Counter()
    finally:
        drop_namespace(broker)
        broker.close()


# -- bad options and bad rows -------------------------------------------------------------------
def test_offsets_for_a_partition_or_topic_not_read_are_refused(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    """startingOffsets naming a partition the topic lacks, or a topic the query does not read,
    is a typo: silently reading from the default instead reads what the user excluded."""
    spark_broker.create_topic("offs", partitions=2)
    produce(spark_broker, "offs", 10)
    last = list(spark_broker.read("offs", 0))[-1].offset
    for spec in (json.dumps({"offs": {"5": last}}), json.dumps({"ofs": {"0": last}})):
        with pytest.raises(Exception, match="InvalidConfig|PartitionOutOfRange") as caught:
            reader(spark, spark_broker, subscribe="offs", startingOffsets=spec).collect()
        assert "offs" in str(caught.value)


def test_ending_offsets_on_a_stream_are_refused(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    """endingOffsets has no meaning for a stream (Spark's Kafka source refuses it): ignoring it
    would run the stream past the end the user asked for."""
    spark_broker.create_topic("se", partitions=1)
    produce(spark_broker, "se", 5)
    with pytest.raises(Exception, match="endingOffsets"):
        query = (
            stream_reader(
                spark,
                spark_broker,
                subscribe="se",
                startingOffsets="earliest",
                endingOffsets="latest",
            )
            .writeStream.foreachBatch(lambda b, _: None)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        raise AssertionError(f"stream ran: {query.exception()}")


def test_a_bad_row_in_one_task_writes_nothing_from_any_task(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("bad-rows", partitions=2)
    rows = [(f"k{i}", f"v{i}", None) for i in range(200)] + [("kx", "vx", 7)]
    df = spark.createDataFrame(rows, "key string, value string, partition int").repartition(
        3, "key"
    )
    with pytest.raises(Exception, match="PartitionOutOfRange"):
        write(df, spark_broker, topic="bad-rows", batchSize=10)
    assert values(spark_broker, "bad-rows") == Counter()
    assert "open" not in set(transaction_states(spark_broker).values())


def test_a_rerun_with_message_ids_and_no_key_writes_nothing_twice(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    """idempotence=message_id: "a re-run of a whole job writes nothing twice" and the dedup
    scope is the partition, so a keyless row must route by its id (as the Python producer
    does), not by the Spark task it happens to run in."""
    spark_broker.create_topic("ids-nokey", partitions=4)
    df = spark.createDataFrame(
        [(f"order-{i}", f"paid-{i}") for i in range(120)], "message_id string, value string"
    )
    write(df.coalesce(1), spark_broker, topic="ids-nokey", idempotence="message_id", batchSize=7)
    # The re-run: the same rows, split over other tasks (another cluster size, a shuffle).
    write(
        df.repartition(3, "value"),
        spark_broker,
        topic="ids-nokey",
        idempotence="message_id",
        batchSize=7,
    )
    assert values(spark_broker, "ids-nokey") == Counter(b"paid-%d" % i for i in range(120))


def test_a_null_value_is_refused_and_writes_nothing(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    """The value is required (the Python producer raises TypeError for None): a null value must
    fail the write, not land as an empty message."""
    spark_broker.create_topic("nulls", partitions=1)
    df = spark.createDataFrame([("k1", "a"), ("k2", None), ("k3", "c")], "key string, value string")
    with pytest.raises(Exception, match="value is null"):
        write(df.coalesce(1), spark_broker, topic="nulls")
    assert values(spark_broker, "nulls") == Counter()
