"""redisq.metrics: the numbers Redis holds and the clients count, in Prometheus text format,
without the console's web stack."""

from __future__ import annotations

import gc
import re
import time
from typing import Any

import pytest
import redis

import redisq
from redisq import metrics
from tests.servers import ServerProcess


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of a text exposition, checked line by line against the format."""
    samples = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge")
            assert kind != "counter" or name.endswith("_total"), name
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        found = re.fullmatch(r"([a-z_:][a-z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert found, f"not a sample line: {line!r}"
        name, labels, value = found.groups()
        assert name in types, f"{name} has no TYPE line"
        pairs = re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', labels or "")
        samples[(name, frozenset(pairs))] = float(value)
    return samples


def value(samples: dict[Any, float], name: str, **labels: Any) -> float:
    return samples[(name, frozenset((k, str(v)) for k, v in labels.items()))]


def test_exposition_escapes_label_values_and_help() -> None:
    family = metrics.MetricFamily("redisq_x_total", "counter", "help with \\ and\nnewline")
    family.add(3, topic='a"b\\c\nd')
    family.add(None, topic="skipped")
    text = metrics.exposition([family])
    assert text == (
        "# HELP redisq_x_total help with \\\\ and\\nnewline\n"
        "# TYPE redisq_x_total counter\n"
        'redisq_x_total{topic="a\\"b\\\\c\\nd"} 3\n'
    )


def test_collect_reports_what_redis_counts(broker: redisq.Broker) -> None:
    """Every backend: produced and consumed counters, lag, leases and dead letters."""
    broker.create_topic("orders", partitions=2)
    with broker.producer() as producer:
        for i in range(20):
            producer.send_async("orders", b"v", key=f"k{i}")
        producer.flush()

    def handle(message: redisq.Message) -> None:
        if message.key == b"k3":
            raise ValueError("poison")

    options: Any = {"max_attempts": 1, "retry_backoff_ms": 1}
    with broker.consumer("orders", group="billing", name="m1", **options) as consumer:
        consumer.run(handle, idle_timeout=0.5)
    ran = parse(metrics.exposition(metrics.collect(broker, clients=[consumer])))
    assert value(ran, "redisq_consumer_messages_consumed_total", group="billing", member="m1") == 20
    assert value(ran, "redisq_consumer_messages_handled_total", group="billing", member="m1") == 19
    assert value(ran, "redisq_consumer_dead_letters_total", group="billing", member="m1") == 1
    with broker.consumer("orders", group="billing", name="m2") as polling:
        assert polling.poll(timeout=0.5) == []
        held = parse(metrics.exposition(metrics.collect(broker, clients=[polling])))
        assert value(held, "redisq_consumer_lease_grants_total", group="billing", member="m2") == 2
        holders = [k for k in held if k[0] == "redisq_lease_held"]
        assert len(holders) == 2 and all(("holder", "m2") in k[1] for k in holders)
    with broker.producer() as producer:
        producer.send("orders", b"late", key="k0")
    samples = parse(metrics.exposition(metrics.collect(broker, clients=[])))
    # messages, as a reader counts them (on a batch topic, the default, XLEN counts entries)
    lengths = [len(list(broker.read("orders", p))) for p in range(2)]
    assert sum(lengths) == 21
    k0 = redisq.partition_for_key(b"k0", 2)
    k3 = redisq.partition_for_key(b"k3", 2)
    for p in range(2):
        at = {"topic": "orders", "partition": p}
        assert value(samples, "redisq_messages_produced_total", **at) == lengths[p]
        assert value(samples, "redisq_partition_messages", **at) == lengths[p]
        at_group = {**at, "group": "billing"}
        assert value(samples, "redisq_consumer_lag", **at_group) == (1 if p == k0 else 0)
        assert value(samples, "redisq_lease_grants_total", **at_group) == 2  # m1, then m2
        assert value(samples, "redisq_dead_letters_total", **at_group) == (1 if p == k3 else 0)
        assert value(samples, "redisq_partition_blocked", **at_group) == 0
    assert value(samples, "redisq_dead_letter_messages", topic="orders", group="billing") == 1
    assert value(samples, "redisq_topic_partitions", topic="orders") == 2
    assert not [k for k in samples if k[0] == "redisq_lease_held"]  # released on close


def test_a_batch_topic_reports_messages_not_entries(broker: redisq.Broker) -> None:
    """On a batch topic (one entry per producer batch) the messages held and produced and the
    lag are messages, from the partition's counters (DESIGN §14.6); a partition whose counters
    cannot tell (a foreign first entry) has no messages-held sample rather than its entries."""
    broker.create_topic("bt", partitions=2, entry_format="batch")
    broker.client.xadd(broker.keys.log("bt", 1), {"v": "foreign"})
    with broker.consumer("bt", "g", start="earliest") as consumer:
        consumer.poll(timeout=0.2)  # the group exists
    with broker.producer(linger_ms=30_000) as producer:
        for i in range(10):
            producer.send_async("bt", b"m%d" % i, partition=0)
    assert broker.client.xlen(broker.keys.log("bt", 0)) == 1
    samples = parse(metrics.exposition(metrics.collect(broker, clients=[])))
    at = {"topic": "bt", "partition": 0}
    assert value(samples, "redisq_partition_messages", **at) == 10
    assert value(samples, "redisq_messages_produced_total", **at) == 10
    assert value(samples, "redisq_consumer_lag", **at, group="g") == 10
    with pytest.raises(KeyError):
        value(samples, "redisq_partition_messages", topic="bt", partition=1)


def test_clients_are_tracked_from_their_start_until_dropped(broker: redisq.Broker) -> None:
    """The library call for those who embed redisq: producers and consumers count themselves
    into collect() with no track() call, held weakly (a dropped client leaves the metrics)."""
    broker.create_topic("orders")
    producer = broker.producer(name="tracked-producer")
    consumer = broker.consumer("orders", group="g", name="tracked")
    try:
        for i in range(3):
            producer.send("orders", b"v", key=f"k{i}")
        assert len(consumer.poll(timeout=5, max_messages=10)) == 3
        samples = parse(metrics.exposition(metrics.collect(broker, server=False)))
        mine = {"group": "g", "member": "tracked"}
        assert value(samples, "redisq_consumer_messages_consumed_total", **mine) == 3
        assert value(samples, "redisq_consumer_lease_grants_total", **mine) == 1
        sent = {"producer": "tracked-producer"}
        assert value(samples, "redisq_producer_messages_sent_total", **sent) == 3
        assert value(samples, "redisq_producer_messages_acknowledged_total", **sent) == 3
        metrics.untrack(consumer)
        samples = parse(metrics.exposition(metrics.collect(broker, server=False)))
        assert not [k for k in samples if ("member", "tracked") in k[1]]
    finally:
        consumer.close()
        producer.close()
    del producer, consumer
    gc.collect()
    samples = parse(metrics.exposition(metrics.collect(broker, server=False)))
    assert not [k for k in samples if ("producer", "tracked-producer") in k[1]]


def test_asyncio_clients_count_and_are_tracked(valkey_server: ServerProcess) -> None:
    """The asyncio producer and consumer track themselves when they start and count what poll
    and run's handler were given."""
    import asyncio

    import redisq.asyncio as rq

    async def scenario() -> dict[Any, float]:
        broker = await rq.connect(valkey_server.url, namespace="metrics-aio")
        try:
            await broker.create_topic("orders", partitions=2, exist_ok=True)
            async with broker.producer(name="aio-producer") as producer:
                for i in range(6):
                    await producer.send("orders", b"v", key=f"k{i}")
                polling = broker.consumer("orders", "aio-poll", "poller")
                running = broker.consumer("orders", "aio-run", "runner")
                try:
                    got: list[Any] = []
                    deadline = time.monotonic() + 15
                    while len(got) < 6 and time.monotonic() < deadline:
                        got += await polling.poll(timeout=1.0)
                    await running.run(lambda m: None, idle_timeout=1.0)
                    return parse(metrics.exposition(metrics.collect(broker, server=False)))
                finally:
                    await polling.close()
                    await running.close()
        finally:
            for key in await broker.client.keys("metrics-aio:*"):
                await broker.client.delete(key)
            await broker.close()

    samples = asyncio.run(scenario())
    polled = {"group": "aio-poll", "member": "poller"}
    assert value(samples, "redisq_consumer_messages_consumed_total", **polled) == 6
    ran = {"group": "aio-run", "member": "runner"}
    assert value(samples, "redisq_consumer_messages_consumed_total", **ran) == 6
    assert value(samples, "redisq_consumer_messages_handled_total", **ran) == 6
    assert (
        value(samples, "redisq_producer_messages_acknowledged_total", producer="aio-producer") == 6
    )


def test_transactions_and_schedules_are_exported(broker: redisq.Broker) -> None:
    """Transaction outcomes (the producer's counters, the registry by state, unresolved half
    messages) and delayed messages per partition with the next due time."""
    broker.create_topic("orders", partitions=2)
    with broker.producer(name="tx-metrics", transactional=True) as producer:
        with producer.transaction() as tx:
            tx.send("orders", b"paid", key="k1")
        with pytest.raises(ValueError), producer.transaction() as tx:
            tx.send("orders", b"refund", key="k1")
            raise ValueError("changed my mind")
        meta = producer.send("orders", b"later", key="k2", delay_ms=600_000)
        samples = parse(metrics.exposition(metrics.collect(broker, clients=[producer])))
    counted = {"producer": "tx-metrics"}
    assert value(samples, "redisq_producer_transactions_committed_total", **counted) == 1
    assert value(samples, "redisq_producer_transactions_aborted_total", **counted) == 1
    [(_, due)] = broker.client.zrange(
        broker.keys.scheduled("orders", meta.partition), 0, -1, withscores=True
    )
    at = {"topic": "orders", "partition": meta.partition}
    assert value(samples, "redisq_scheduled_messages", **at) == 1
    assert value(samples, "redisq_scheduled_next_due_timestamp_seconds", **at) == due / 1000
    other = {"topic": "orders", "partition": 1 - meta.partition}
    assert value(samples, "redisq_scheduled_messages", **other) == 0
    assert value(samples, "redisq_transactions_registered") == 0

    unknown = lambda tx_id, messages: redisq.TxState.UNKNOWN  # noqa: E731
    options: Any = {"check_first_ms": 50, "check_interval_ms": 50, "max_checks": 1}
    with broker.producer(transactional_group="svc", check=unknown, **options) as producer:
        producer.send_in_transaction("orders", b"half", key="k3", local=unknown)
        open_now = parse(metrics.exposition(metrics.collect(broker, clients=[])))
        deadline = time.monotonic() + 15
        while broker.client.zcard(broker.keys.transactions()):
            assert time.monotonic() < deadline, "check-back did not give up"
            time.sleep(0.05)
    assert value(open_now, "redisq_transactions", state="open") == 1
    assert value(open_now, "redisq_transactions_registered") == 1
    assert value(open_now, "redisq_transaction_open_oldest_age_seconds") >= 0
    given_up = parse(metrics.exposition(metrics.collect(broker, clients=[])))
    assert value(given_up, "redisq_unresolved_messages", group="svc") == 1
    assert value(given_up, "redisq_transactions", state="open") == 0
    assert not [k for k in given_up if k[0] == "redisq_scheduled_messages" and
                ("topic", "svc~unresolved") in k[1]]  # fmt: skip


def test_collect_fails_when_the_server_is_down() -> None:
    """A scrape of a dead server must fail, not report zeros."""
    server = ServerProcess().start()
    broker = redisq.connect(server.url, namespace="metrics-down", socket_timeout=2)
    try:
        server.stop()
        with pytest.raises(redis.ConnectionError):
            metrics.collect(broker)
    finally:
        server.stop()
        broker.close()
