"""redisq.metrics: the numbers Redis holds and the clients count, in Prometheus text format,
without the console's web stack."""

from __future__ import annotations

import re
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
    lengths = [broker.client.xlen(broker.keys.log("orders", p)) for p in range(2)]
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


def test_tracked_clients_are_collected_until_dropped(broker: redisq.Broker) -> None:
    broker.create_topic("orders")
    consumer = broker.consumer("orders", group="g", name="tracked")
    try:
        metrics.track(consumer)
        samples = parse(metrics.exposition(metrics.collect(broker, server=False)))
        assert value(samples, "redisq_consumer_commits_total", group="g", member="tracked") == 0
        metrics.untrack(consumer)
        assert metrics.collect(broker, server=False) == []
    finally:
        consumer.close()


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
