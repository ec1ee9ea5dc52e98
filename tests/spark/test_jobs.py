"""Analysis jobs: the ordering audit, skew, throughput, consumer lag, `redisq audit`, demo."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import redisq
from redisq.cli import main as cli_main
from tests.spark.fixtures import broker_url, produce, spark, spark_broker  # noqa: F401

pytestmark = pytest.mark.spark


def topic_df(spark: Any, broker: redisq.Broker, topic: str) -> Any:
    from spark_connector import jobs

    return jobs.read_topic(spark, broker_url(broker), broker.namespace, topic)


def two_producers(broker: redisq.Broker, topic: str) -> None:
    produce(broker, topic, 300, keys=9)
    with broker.producer(name="second", linger_ms=1) as producer:
        for i in range(200):
            producer.send_async(topic, b"w%d" % i, key=b"k%d" % (i % 5))
        producer.flush()


def inject(broker: redisq.Broker, topic: str, p: int, pid: int, sequences: list[int]) -> None:
    """Raw XADDs that look like a faulty producer's messages."""
    for s in sequences:
        broker.client.xadd(broker.keys.log(topic, p), {"k": "kx", "v": f"x{s}", "p": pid, "s": s})


def test_audit_reports_zero_on_a_clean_topic(spark: Any, spark_broker: redisq.Broker) -> None:
    from spark_connector import jobs

    spark_broker.create_topic("clean", partitions=3)
    two_producers(spark_broker, "clean")
    result = jobs.run_ordering_audit(topic_df(spark, spark_broker, "clean"))
    assert result.clean, result.verdict("clean")
    assert result.messages == 500
    assert sum(r.messages for r in result.rows) == 500
    assert {r.producer_id for r in result.rows} and len({r.producer_id for r in result.rows}) == 2
    assert all(r.gaps == r.duplicates == r.out_of_order == 0 for r in result.rows)
    assert result.key_rows == []
    assert "CLEAN" in result.verdict("clean")


def test_audit_finds_injected_gaps_duplicates_and_out_of_order(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    from spark_connector import jobs

    spark_broker.create_topic("faulty", partitions=2)
    two_producers(spark_broker, "faulty")
    # 0 1 2 4 3 5 5 8: 6 and 7 missing, 3 late, 5 twice.
    inject(spark_broker, "faulty", 0, 999, [0, 1, 2, 4, 3, 5, 5, 8])
    # A restarted epoch (back to 0) is a new run, not a fault.
    inject(spark_broker, "faulty", 1, 998, [0, 1, 2, 0, 1])
    # A key written to a partition its hash does not pick: order per key is broken.
    wrong = 1 - redisq.partition_for_key(b"k0", 2)
    spark_broker.client.xadd(spark_broker.keys.log("faulty", wrong), {"k": "k0", "v": "stray"})

    result = jobs.run_ordering_audit(topic_df(spark, spark_broker, "faulty"))
    rows = {(r.partition, r.producer_id): r for r in result.rows}
    bad = rows[(0, 999)]
    assert (bad.messages, bad.gaps, bad.duplicates, bad.out_of_order) == (8, 2, 1, 1)
    restarted = rows[(1, 998)]
    assert (restarted.runs, restarted.gaps, restarted.duplicates, restarted.out_of_order) == (
        2,
        0,
        0,
        0,
    )
    others = [r for key, r in rows.items() if key[1] not in (998, 999)]
    assert all(r.gaps == r.duplicates == r.out_of_order == 0 for r in others)
    assert (result.gaps, result.duplicates, result.out_of_order) == (2, 1, 1)
    keys = {bytes(r.key): r for r in result.key_rows}
    assert keys[b"kx"].out_of_order == 1
    assert keys[b"k0"].partitions == 2
    assert not result.clean
    assert "NOT CLEAN" in result.verdict("faulty")


def test_skew_hot_keys_and_throughput(spark: Any, spark_broker: redisq.Broker) -> None:
    from spark_connector import jobs

    spark_broker.create_topic("skew", partitions=4)
    with spark_broker.producer(linger_ms=1) as producer:
        for i in range(400):
            producer.send_async("skew", b"x" * 10, key=b"hot" if i % 2 else b"c%d" % (i % 40))
        producer.flush()
    df = topic_df(spark, spark_broker, "skew")
    skew = jobs.partition_skew(df).collect()
    assert sum(r.messages for r in skew) == 400
    hot_partition = redisq.partition_for_key(b"hot", 4)
    by_p = {r.partition: r for r in skew}
    assert by_p[hot_partition].messages == max(r.messages for r in skew)
    assert by_p[hot_partition].vs_mean > 1.5
    top = jobs.hot_keys(df, 3).collect()
    assert (top[0].key, top[0].messages, top[0].partition) == ("hot", 200, hot_partition)
    assert len(top) == 3
    rates = jobs.throughput(df, bucket_ms=100).collect()
    assert sum(r.messages for r in rates) == 400
    assert sum(r.bytes for r in rates) == sum(r.bytes for r in skew)


def test_consumer_lag_per_group_and_partition(spark: Any, spark_broker: redisq.Broker) -> None:
    from spark_connector import jobs

    # message entries: groups made with XGROUP CREATE read entries, one per message here
    spark_broker.create_topic("lagged", partitions=2, entry_format="message")
    produce(spark_broker, "lagged", 100)
    lengths = [spark_broker.client.xlen(spark_broker.keys.log("lagged", p)) for p in range(2)]
    for p in range(2):
        key = spark_broker.keys.log("lagged", p)
        spark_broker.client.xgroup_create(key, "billing", id="0")
        spark_broker.client.xgroup_create(key, "audit", id="$")
        spark_broker.client.xreadgroup("billing", "c1", {key: ">"}, count=10)
    rows = jobs.consumer_lag(
        spark, broker_url(spark_broker), spark_broker.namespace, "lagged"
    ).collect()
    got = {(r.group, r.partition): (r.lag, r.pending) for r in rows}
    assert got == {
        ("billing", 0): (lengths[0] - 10, 10),
        ("billing", 1): (lengths[1] - 10, 10),
        ("audit", 0): (0, 0),
        ("audit", 1): (0, 0),
    }
    only = jobs.consumer_lag(
        spark, broker_url(spark_broker), spark_broker.namespace, "lagged", group="audit"
    ).collect()
    assert {r.group for r in only} == {"audit"}


def test_consumer_lag_counts_messages_on_a_batch_topic(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    """A batch topic: its group's lag is the messages not read yet, not the entries (batches)."""
    from spark_connector import jobs

    spark_broker.create_topic("blag", partitions=1, entry_format="batch")
    with spark_broker.consumer("blag", group="billing", mode="concurrent") as consumer:
        assert consumer.poll(timeout=0.2) == []  # the group, made by redisq
    with spark_broker.producer(linger_ms=30_000) as producer:
        for _ in range(3):  # three batches of five
            for i in range(5):
                producer.send_async("blag", b"v%d" % i)
            producer.flush()
    rows = jobs.consumer_lag(
        spark, broker_url(spark_broker), spark_broker.namespace, "blag"
    ).collect()
    assert [(r.group, r.lag, r.length) for r in rows] == [("billing", 15, 3)]


def test_cli_audit_commands_print_tables_and_write_plots(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path, capsys: Any
) -> None:
    spark_broker.create_topic("cli", partitions=2)
    two_producers(spark_broker, "cli")
    common = ["--url", broker_url(spark_broker), "--namespace", spark_broker.namespace]
    for kind in ("order", "skew", "throughput", "lag"):
        plot = tmp_path / f"{kind}.png"
        assert cli_main(["audit", kind, "cli", *common, "--plot", str(plot)]) == 0
        assert plot.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "CLEAN" in out and "hot keys" in out and "messages_per_s" in out

    inject(spark_broker, "cli", 0, 999, [0, 2])
    assert cli_main(["audit", "order", "cli", *common, "--plot", str(tmp_path / "o.png")]) == 1
    assert "NOT CLEAN" in capsys.readouterr().out


def test_demo_audit_verdict(spark: Any, spark_broker: redisq.Broker) -> None:
    from spark_connector import demo_audit

    spark_broker.create_topic("demo", partitions=2)
    two_producers(spark_broker, "demo")
    clean, verdict = demo_audit(broker_url(spark_broker), spark_broker.namespace, "demo")
    assert clean and "500 messages" in verdict and "CLEAN" in verdict
    inject(spark_broker, "demo", 1, 999, [0, 0])
    clean, verdict = demo_audit(broker_url(spark_broker), spark_broker.namespace, "demo")
    assert not clean and "1 duplicates" in verdict
