"""Adversarial tests: retention, trimming, expiry of dedup and producer state, growing topics."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import redisq
from redisq.errors import ProducerFenced
from tests.conftest import drop_namespace
from tests.history.proxy import Proxy
from tests.servers import ServerProcess

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def rbroker() -> Iterator[redisq.Broker]:
    """The shared Redis 7.0, in a namespace of this test's own."""
    broker = redisq.connect(REDIS_URL, namespace=f"advret{uuid.uuid4().hex[:10]}")
    yield broker
    try:
        drop_namespace(broker)
    except redis.RedisError:
        pass
    broker.close()


def values(broker: redisq.Broker, topic: str) -> list[bytes]:
    config = broker.topic_config(topic, refresh=True)
    out: list[bytes] = []
    for p in range(config.partitions):
        out += [m.value for m in broker.read(topic, p)]
    return out


def wait_until(condition, timeout: float = 20.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- producer state shorter than the producer's retry horizon -----------------------------------


@pytest.mark.parametrize("named", [False, True])
def test_retry_after_producer_state_expired_writes_no_duplicate(
    proxied: tuple[ServerProcess, Proxy], named: bool
) -> None:
    """README: "a retry re-sends the same messages with the same sequence numbers, and the
    broker writes a batch at most once"; DESIGN §3: producer state's expiry "is never shorter
    than the topic's retention or the producer's retry horizon". A batch is written, its answer
    is lost; the producer's retry comes after producer_state_ttl_ms (1 s, delivery_timeout_ms
    120 s): the state is gone and the retry is written a second time."""
    server, proxy = proxied
    ns = f"advst{uuid.uuid4().hex[:8]}"
    broker = redisq.connect(proxy.url, namespace=ns, socket_timeout=0.5)
    direct = redisq.connect(server.url, namespace=ns)
    direct.create_topic("orders", partitions=1, producer_state_ttl_ms=1000)
    producer = broker.producer(name="svc" if named else None, retry_backoff_ms=10)
    try:
        producer.send("orders", b"warm", key="k")
        proxy.trap(b"PAYLOAD-ONCE")
        future = producer.send_async("orders", b"PAYLOAD-ONCE", key="k")
        wait_until(lambda: proxy.holds_for_server(b"PAYLOAD-ONCE"), what="the batch held")
        assert proxy.lose_answers(b"PAYLOAD-ONCE") >= 1  # it runs; its answer is lost
        assert proxy.wait_released(10)
        assert values(direct, "orders").count(b"PAYLOAD-ONCE") == 1
        time.sleep(1.6)  # the producer state (TTL 1 s) expires; retries are held meanwhile
        proxy.reset_all()  # the lost answer goes with its connection
        proxy.heal()
        meta = future.result(timeout=30)
    finally:
        proxy.heal()
        producer.close(timeout=10)
        broker.close()
    stored = values(direct, "orders")
    direct.close()
    assert stored.count(b"PAYLOAD-ONCE") == 1, (
        f"a retried batch was written twice once its producer state expired: {stored} ({meta})"
    )


# -- a named producer idle past its state's expiry ----------------------------------------------


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_named_producer_sends_again_after_its_state_expired(
    rbroker: redisq.Broker, idempotence: str
) -> None:
    """State expired while idle (producer_state_ttl_ms 1 s, delivery timeout 0.5 s): the next
    sends are stored once each, in order, none answered as a duplicate, no fence error."""
    rbroker.create_topic("orders", partitions=2, producer_state_ttl_ms=1000)
    with rbroker.producer(
        name="svc", idempotence=idempotence, delivery_timeout_ms=500, retry_backoff_ms=10
    ) as producer:
        first = [producer.send("orders", f"a{i}", key=f"k{i % 3}") for i in range(20)]
        time.sleep(1.5)
        assert not list(rbroker.client.scan_iter(match=rbroker.keys.pattern() + "pid*"))
        later = [producer.send("orders", f"b{i}", key=f"k{i % 3}") for i in range(20)]
        futures = [producer.send_async("orders", f"c{i}", key=f"k{i % 3}") for i in range(50)]
        producer.flush()
        tail = [f.result() for f in futures]
    assert not any(m.duplicate for m in first + later + tail)
    stored = values(rbroker, "orders")
    expected = [f"{p}{i}".encode() for p in "abc" for i in range(50 if p == "c" else 20)]
    assert sorted(stored) == sorted(expected)


# -- zombie fencing on partitions added later ----------------------------------------------------


def test_fenced_zombie_cannot_write_to_a_partition_added_after_the_fence(
    rbroker: redisq.Broker,
) -> None:
    rbroker.create_topic("orders", partitions=2)
    old = rbroker.producer(name="svc", metadata_max_age_ms=100, delivery_timeout_ms=2000)
    try:
        old.send("orders", b"old", partition=0)
        with rbroker.producer(name="svc") as new:
            new.send("orders", b"new", partition=0)
            rbroker.add_partitions("orders", 4)
            time.sleep(0.3)
            for p in (2, 3):
                with pytest.raises(ProducerFenced):
                    old.send("orders", f"zombie-{p}".encode(), partition=p)
            for p in range(4):
                assert not new.send("orders", f"new-{p}".encode(), partition=p).duplicate
    finally:
        old.close(timeout=5)
    stored = values(rbroker, "orders")
    assert not [v for v in stored if v.startswith(b"zombie")], stored


# -- an orderly group whose committed position was trimmed away ----------------------------------


def test_orderly_group_resumes_after_its_position_was_trimmed(rbroker: redisq.Broker) -> None:
    rbroker.create_topic("t", partitions=1, retention_messages=50)
    with rbroker.producer() as producer:
        for i in range(40):
            producer.send_async("t", f"m{i:04d}", key="k")
        producer.flush()
    seen: list[bytes] = []
    with rbroker.consumer("t", "g", mode="orderly", start="earliest") as consumer:
        consumer.run(lambda m: seen.append(m.value), max_messages=10, timeout=20)
    assert seen == [f"m{i:04d}".encode() for i in range(10)]
    with rbroker.producer() as producer:
        for i in range(40, 400):
            producer.send_async("t", f"m{i:04d}", key="k")
        producer.flush()
    rbroker.trim("t")
    remaining = [m.value for m in rbroker.read("t", 0)]
    assert len(remaining) == 50
    seen2: list[bytes] = []
    with rbroker.consumer("t", "g", mode="orderly", start="earliest") as consumer:
        consumer.run(lambda m: seen2.append(m.value), idle_timeout=2.0, timeout=30)
    assert seen2 == remaining


# -- growing a topic while producers and an orderly group run ------------------------------------


def test_grow_while_producing_and_consuming_keeps_order_per_partition_and_loses_nothing(
    rbroker: redisq.Broker,
) -> None:
    """Messages of a key sent with the same partition count stay in order; every stored message
    is handled, new partitions included (their group position starts at their beginning)."""
    rbroker.create_topic("t", partitions=2)
    handled: list[tuple[int, str, int]] = []
    lock = threading.Lock()

    def handle(m: redisq.Message) -> None:
        key = m.key.decode()
        with lock:
            handled.append((m.partition, key, int(m.value)))

    consumers = [
        rbroker.consumer("t", "g", mode="orderly", start="latest", metadata_max_age_ms=200)
        for _ in range(2)
    ]
    runners = [threading.Thread(target=c.run, args=(handle,), daemon=True) for c in consumers]
    for r in runners:
        r.start()
    time.sleep(1.0)
    counters = {f"k{i}": 0 for i in range(12)}
    with rbroker.producer(metadata_max_age_ms=100, linger_ms=2) as producer:
        for step in range(600):
            if step == 200:
                rbroker.add_partitions("t", 5)
            if step == 400:
                rbroker.add_partitions("t", 7)
            key = f"k{step % 12}"
            producer.send_async("t", str(counters[key]).encode(), key=key)
            counters[key] += 1
            if step % 50 == 0:
                time.sleep(0.05)
        producer.flush()
    total = sum(counters.values())
    stored = {
        (p, m.key.decode(), int(m.value)) for p in range(7) for m in rbroker.read("t", p)
    }
    assert len(stored) == total, f"{len(stored)} stored of {total}"
    try:
        wait_until(lambda: len({h for h in handled}) >= total, timeout=30, what="all handled")
    finally:
        for c in consumers:
            c.close()
        for r in runners:
            r.join(10)
    assert set(handled) == stored
    # order per (partition, key) in handling (first handling of each message)
    firsts: dict[tuple[int, str], list[int]] = {}
    seen: set[tuple[int, str, int]] = set()
    for h in handled:
        if h not in seen:
            seen.add(h)
            firsts.setdefault(h[:2], []).append(h[2])
    for pk, ns in firsts.items():
        assert ns == sorted(ns), f"{pk}: handled out of order {ns}"
    # order per key in each partition's log
    for p in range(7):
        per_key: dict[str, list[int]] = {}
        for m in rbroker.read("t", p):
            per_key.setdefault(m.key.decode(), []).append(int(m.value))
        for key, ns in per_key.items():
            assert ns == sorted(ns), f"partition {p} key {key}: {ns}"
