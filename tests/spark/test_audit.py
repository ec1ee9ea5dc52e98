"""The content audit as a data-quality gate: duplicated and missing content by a hash of key and
value, by message id and against a source table; counts and where; `redisq audit content` exits
0 clean, 1 faults found, 2 could not run."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import redisq
from redisq.cli import main as cli_main
from redisq.model.partitioner import partition_for_key
from tests.spark.fixtures import broker_url, produce, spark, spark_broker  # noqa: F401

pytestmark = pytest.mark.spark


def topic_df(spark: Any, broker: redisq.Broker, topic: str) -> Any:
    from spark_connector import jobs

    return jobs.read_topic(spark, broker_url(broker), broker.namespace, topic)


def copy_entries(broker: redisq.Broker, topic: str, p: int, count: int) -> list[bytes]:
    """Append again the first `count` entries of a partition, as a retrying writer without
    idempotence would (plain XADD: no producer sequence to catch them)."""
    key = broker.keys.log(topic, p)
    entries = broker.client.xrange(key, count=count)
    for _, fields in entries:
        broker.client.xadd(key, fields)
    return [fields[b"v"] for _, fields in entries]


def test_duplicates_without_sequences_are_found_by_content(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    from spark_connector import content_audit

    # Faults made by hand on stream entries (a plain XADD of an entry's v/k fields): one entry a
    # message. On batch entries: tests/spark/test_batch_source.py::test_audits_count_messages_...
    spark_broker.create_topic("dup", partitions=3, entry_format="message")
    produce(spark_broker, "dup", 300, keys=7)
    assert content_audit.run(topic_df(spark, spark_broker, "dup")).clean
    copy_entries(spark_broker, "dup", 1, 5)
    copy_entries(spark_broker, "dup", 2, 2)
    result = content_audit.run(topic_df(spark, spark_broker, "dup"))
    assert not result.clean and result.duplicated == 7 and result.missing == 0
    assert {r.partition: r.duplicated for r in result.partitions} == {1: 5, 2: 2}
    assert all(s.copies == 2 and len(s.offsets) == 2 for s in result.samples)
    assert "NOT CLEAN: 7 duplicated" in result.verdict("dup")
    # The ordering audit alone sees producer sequences only: the CLI says so on such a topic.


def test_against_a_source_table_finds_missing_and_duplicated_rows(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path
) -> None:
    from spark_connector import content_audit

    # Faults made by hand on stream entries (XDEL of single messages found by their raw k field,
    # plain XADD copies): one entry a message.
    spark_broker.create_topic("copy", partitions=4, entry_format="message")
    rows = [(f"k{i % 9}", f"value-{i}") for i in range(400)]
    source = spark.createDataFrame(rows, "key string, value string")
    source.write.format("redisq").option("url", broker_url(spark_broker)).option(
        "namespace", spark_broker.namespace
    ).option("topic", "copy").mode("append").save()
    table = tmp_path / "source.parquet"
    source.write.parquet(str(table))
    assert content_audit.run(topic_df(spark, spark_broker, "copy"), source=source).clean
    # Lose 3 messages of one key, duplicate 4 others.
    lost_key = b"k4"
    p = partition_for_key(lost_key, 4)
    log = spark_broker.keys.log("copy", p)
    lost = [e for e in spark_broker.client.xrange(log) if e[1][b"k"] == lost_key][:3]
    spark_broker.client.xdel(log, *[e[0] for e in lost])
    copy_entries(spark_broker, "copy", (p + 1) % 4, 4)
    result = content_audit.run(topic_df(spark, spark_broker, "copy"), source=source)
    assert (result.expected, result.duplicated, result.missing) == (400, 4, 3)
    assert {r.partition: (r.duplicated, r.missing) for r in result.partitions} == {
        p: (0, 3),
        (p + 1) % 4: (4, 0),
    }
    common = ["--url", broker_url(spark_broker), "--namespace", spark_broker.namespace]
    plot = tmp_path / "content.png"
    code = cli_main(
        ["audit", "content", "copy", *common, "--against", str(table), "--plot", str(plot)]
    )
    assert code == 1 and plot.stat().st_size > 0


def test_cli_content_exit_codes_and_message_ids(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path, capsys: Any
) -> None:
    spark_broker.create_topic("ids", partitions=2)
    with spark_broker.producer(idempotence="message_id") as producer:
        for i in range(50):
            producer.send("ids", b"v%d" % i, message_id=b"id-%d" % i)
    common = ["--url", broker_url(spark_broker), "--namespace", spark_broker.namespace]
    plot = ["--plot", str(tmp_path / "c.png")]
    assert cli_main(["audit", "content", "ids", *common, *plot, "--by", "message_id"]) == 0
    assert "CLEAN" in capsys.readouterr().out
    # Same id, another value: not a duplicate by content, one by message id.
    log = spark_broker.keys.log("ids", 0)
    spark_broker.client.xadd(log, {"v": b"other", "m": b"id-0"})
    assert cli_main(["audit", "content", "ids", *common, *plot]) == 0
    assert cli_main(["audit", "content", "ids", *common, *plot, "--by", "message_id"]) == 1
    assert "1 duplicated" in capsys.readouterr().out
    # A source that cannot be read: the audit could not run.
    missing = ["--against", "no_such_table_anywhere"]
    assert cli_main(["audit", "content", "ids", *common, *plot, *missing]) == 2
