"""Adversarial tests: retention, trimming, expiry of dedup and producer state, growing topics."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import pytest

import redisq
import redisq.asyncio as rq
from redisq.errors import PartitionGone, ProducerFenced
from tests.conftest import broker_in, wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess
from tests.txhelp import values_of

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def rbroker() -> Iterator[redisq.Broker]:
    """The shared Redis 7.0, in a namespace of this test's own."""
    with broker_in(REDIS_URL, f"advret{uuid.uuid4().hex[:10]}") as broker:
        yield broker


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
        assert values_of(direct, "orders").count(b"PAYLOAD-ONCE") == 1
        time.sleep(1.6)  # the producer state (TTL 1 s) expires; retries are held meanwhile
        proxy.reset_all()  # the lost answer goes with its connection
        proxy.heal()
        meta = future.result(timeout=30)
    finally:
        proxy.heal()
        producer.close(timeout=10)
        broker.close()
    stored = values_of(direct, "orders")
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
    stored = values_of(rbroker, "orders")
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
            for p in (2, 3):
                deadline = time.monotonic() + 5
                while True:
                    try:
                        old.send("orders", f"zombie-{p}".encode(), partition=p)
                    except redisq.errors.PartitionOutOfRange:
                        assert time.monotonic() < deadline, "metadata never refreshed"
                        time.sleep(0.1)
                        continue
                    except ProducerFenced:
                        break
                    raise AssertionError(f"the zombie wrote to partition {p}")
            deadline = time.monotonic() + 8
            for p in range(4):
                while True:
                    try:
                        assert not new.send("orders", f"new-{p}".encode(), partition=p).duplicate
                        break
                    except redisq.errors.PartitionOutOfRange:  # metadata_max_age_ms 5 s
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
    finally:
        old.close(timeout=5)
    stored = values_of(rbroker, "orders")
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
    # at least 50 (in whole entries on a batch topic), and trimmed past the group's position
    assert len(remaining) >= 50 and remaining[0] > b"m0009", remaining[:1]
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
    stored = {(p, m.key.decode(), int(m.value)) for p in range(7) for m in rbroker.read("t", p)}
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


# -- concurrent mode: pending entries trimmed away -----------------------------------------------


def test_concurrent_group_with_pending_entries_trimmed_away(rbroker: redisq.Broker) -> None:
    """A member read entries and died without acking; retention trimmed them. The next member
    claims what is pending: nothing crashes, everything still stored is handled."""
    rbroker.create_topic("t", partitions=1, retention_messages=20)
    with rbroker.producer() as producer:
        for i in range(50):
            producer.send_async("t", f"a{i:03d}", key="k")
        producer.flush()
    first = rbroker.consumer("t", "g", mode="concurrent", start="earliest", lease_ttl_ms=1000)
    got = first.poll(timeout=5, max_messages=30)
    assert got
    # it "dies": no ack, no close; its pending entries stay
    with rbroker.producer() as producer:
        for i in range(100):
            producer.send_async("t", f"b{i:03d}", key="k")
        producer.flush()
    rbroker.trim("t")
    remaining = [m.value for m in rbroker.read("t", 0)]
    seen: list[bytes] = []
    errors: list[BaseException] = []
    second = rbroker.consumer("t", "g", mode="concurrent", start="earliest", lease_ttl_ms=1000)

    def handle(m: redisq.Message) -> None:
        seen.append(m.value)

    try:
        second.run(handle, idle_timeout=4.0, timeout=30)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        try:
            first.close()
        except Exception:
            pass
    assert not errors, errors
    assert set(remaining) <= set(seen), sorted(set(remaining) - set(seen))[:5]


# -- message-id dedup window: at least one window ------------------------------------------------


def test_message_id_resent_inside_the_window_is_always_a_duplicate(rbroker: redisq.Broker) -> None:
    rbroker.create_topic("t", partitions=1, dedup_window_ms=1000)
    with rbroker.producer(idempotence="message_id") as producer:
        for i in range(12):
            first = producer.send("t", b"x", message_id=f"id-{i}")
            assert not first.duplicate
            time.sleep(0.83 + (i % 4) * 0.03)  # under one window
            again = producer.send("t", b"x", message_id=f"id-{i}")
            assert again.duplicate and again.offset == first.offset, (i, first, again)


# -- growing and describing groups whose positions were trimmed ----------------------------------


def test_group_tools_after_positions_trimmed_and_topic_grown(rbroker: redisq.Broker) -> None:
    rbroker.create_topic("t", partitions=2, retention_messages=10)
    with rbroker.producer() as producer:
        for i in range(30):
            producer.send_async("t", f"m{i}", key=f"k{i % 5}")
        producer.flush()
    with rbroker.consumer("t", "g", mode="orderly", start="earliest") as consumer:
        consumer.run(lambda m: None, max_messages=5, timeout=20)
    with rbroker.producer() as producer:
        for i in range(200):
            producer.send_async("t", f"n{i}", key=f"k{i % 5}")
        producer.flush()
    rbroker.trim("t")
    rbroker.add_partitions("t", 4)
    description = rbroker.describe_group("t", "g")
    lag = description.total_lag
    stored = sum(len(list(rbroker.read("t", p))) for p in range(4))
    assert lag is None or 0 <= lag <= stored, (lag, stored, description)


# -- a topic deleted and re-created under the same name ------------------------------------------


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_recreated_topic_with_fewer_partitions_and_a_cached_producer(
    rbroker: redisq.Broker, idempotence: str
) -> None:
    rbroker.create_topic("t", partitions=4)
    with rbroker.producer(
        idempotence=idempotence, name="svc" if idempotence == "sequence" else None
    ) as producer:
        for i in range(20):
            producer.send(
                "t",
                f"old{i}",
                key=f"k{i}",
                message_id=f"id{i}" if idempotence == "message_id" else None,
            )
        rbroker.delete_topic("t")
        rbroker.create_topic("t", partitions=2)
        results = []
        errors = []
        for i in range(20):
            try:
                results.append(
                    producer.send(
                        "t",
                        f"new{i}",
                        key=f"k{i}",
                        message_id=f"id{i}" if idempotence == "message_id" else None,
                    )
                )
            except Exception as exc:  # noqa: BLE001
                errors.append((i, repr(exc)))
    stored = values_of(rbroker, "t")

    assert not [r for r in results if r.duplicate], results
    assert not errors, errors
    assert sorted(stored) == sorted(f"new{i}".encode() for i in range(20))


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_recreated_topic_with_fewer_partitions_and_a_cached_producer_asyncio(
    rbroker: redisq.Broker, idempotence: str
) -> None:
    """The asyncio twin: await producer.send() routes again by the new count after the answer
    that the partition is gone (metadata read again); nothing stored twice, nothing lost."""

    def mid(i: int) -> str | None:
        return f"id{i}" if idempotence == "message_id" else None

    async def run() -> tuple[list[redisq.RecordMetadata], list[tuple[int, str]]]:
        broker = await rq.connect(REDIS_URL, namespace=rbroker.namespace)
        results: list[redisq.RecordMetadata] = []
        errors: list[tuple[int, str]] = []
        try:
            await broker.create_topic("t", partitions=4)
            name = "svc" if idempotence == "sequence" else None
            async with broker.producer(idempotence=idempotence, name=name) as producer:
                for i in range(20):
                    await producer.send("t", f"old{i}", key=f"k{i}", message_id=mid(i))
                await broker.delete_topic("t")
                await broker.create_topic("t", partitions=2)
                for i in range(20):
                    try:
                        results.append(
                            await producer.send("t", f"new{i}", key=f"k{i}", message_id=mid(i))
                        )
                    except Exception as exc:  # noqa: BLE001
                        errors.append((i, repr(exc)))
        finally:
            await broker.close()
        return results, errors

    results, errors = asyncio.run(run())
    stored = values_of(rbroker, "t")
    assert not [r for r in results if r.duplicate], results
    assert not errors, errors
    assert sorted(stored) == sorted(f"new{i}".encode() for i in range(20))


def test_recreated_topic_fails_queued_sends_to_a_gone_partition_clearly(
    rbroker: redisq.Broker,
) -> None:
    """send_async futures routed by the old count to a partition the re-created topic lacks fail
    with PartitionGone (a TopicNotFound: nothing of them written), not re-routed behind later
    messages of their keys; sends after that go by the new count."""
    rbroker.create_topic("t", partitions=4)
    gone_keys = [k for k in (f"k{i}" for i in range(40)) if zlib.crc32(k.encode()) % 4 >= 2]
    with rbroker.producer() as producer:
        producer.send("t", b"warm", key="k0")  # metadata cached: 4 partitions
        rbroker.delete_topic("t")
        rbroker.create_topic("t", partitions=2)
        futures = [producer.send_async("t", f"q-{k}", key=k) for k in gone_keys]
        producer.flush()
        outcomes = [f.exception(timeout=30) for f in futures]
        assert all(isinstance(e, PartitionGone) for e in outcomes), outcomes
        assert all(isinstance(e, redisq.TopicNotFound) for e in outcomes)
        later = producer.send_async("t", b"after", key=gone_keys[0]).result(timeout=30)
    assert later.partition == zlib.crc32(gone_keys[0].encode()) % 2
    assert values_of(rbroker, "t") == [b"after"]


def test_recreated_topic_and_a_consumer_holding_its_leases(rbroker: redisq.Broker) -> None:
    """delete_topic(force=True) under a running orderly member, then the topic comes back; the
    old member's stale leases and positions must not hand on or skip the new topic's messages."""
    rbroker.create_topic("t", partitions=2)
    with rbroker.producer() as producer:
        for i in range(10):
            producer.send("t", f"old{i}", key=f"k{i}")
    seen: list[bytes] = []
    consumer = rbroker.consumer("t", "g", mode="orderly", start="earliest", metadata_max_age_ms=200)
    runner = threading.Thread(
        target=consumer.run, args=(lambda m: seen.append(m.value),), daemon=True
    )
    runner.start()
    wait_until(lambda: len(seen) >= 10, what="old handled")
    rbroker.delete_topic("t", force=True)
    rbroker.create_topic("t", partitions=2)
    with rbroker.producer() as producer:
        for i in range(10):
            producer.send("t", f"new{i}", key=f"k{i}")
    time.sleep(3)
    consumer.close()
    runner.join(10)
    # a fresh member of a group of the same name reads the new topic from its start
    seen2: list[bytes] = []
    with rbroker.consumer("t", "g", mode="orderly", start="earliest") as c2:
        c2.run(lambda m: seen2.append(m.value), idle_timeout=2.0, timeout=20)
    new = {f"new{i}".encode() for i in range(10)}
    assert new <= set(seen) | set(seen2), (seen, seen2)


# -- message-id dedup across a topic's growth -----------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="growing moves where an id routes: dedup holds per partition count (now in README)",
)
def test_message_id_resent_after_the_topic_grew_is_a_duplicate(rbroker: redisq.Broker) -> None:
    """README: "A message id ... is written once per dedup window: a repeat answers with the
    first offset and duplicate=True ... the same id routes to the same partition when the message
    has no key". Growing the topic moves where an id routes, and a resend is written again."""
    rbroker.create_topic("t", partitions=2)
    ids = [f"order-{i}" for i in range(20)]
    with rbroker.producer(idempotence="message_id") as producer:
        first = {i: producer.send("t", b"v", message_id=i) for i in ids}
    rbroker.add_partitions("t", 3)
    with rbroker.producer(idempotence="message_id") as producer:
        again = {i: producer.send("t", b"v", message_id=i) for i in ids}
    written_twice = [i for i in ids if not again[i].duplicate]
    stored = values_of(rbroker, "t")
    assert not written_twice, (
        f"{len(written_twice)} of {len(ids)} ids written again after growing: "
        f"{len(stored)} stored; e.g. {first[written_twice[0]]} then {again[written_twice[0]]}"
    )


# -- trimming racing a running orderly consumer --------------------------------------------------


def test_trim_racing_an_orderly_consumer_never_reorders_or_repeats(rbroker: redisq.Broker) -> None:
    rbroker.create_topic("t", partitions=2, retention_messages=30)
    handled: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def handle(m: redisq.Message) -> None:
        handled.append((m.partition, int(m.value)))
        if len(handled) % 7 == 0:
            time.sleep(0.01)

    consumer = rbroker.consumer("t", "g", mode="orderly", start="earliest", ack_interval_ms=20)

    def run() -> None:
        try:
            consumer.run(handle)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    stop = threading.Event()

    def trimmer() -> None:
        while not stop.is_set():
            rbroker.trim("t")
            time.sleep(0.005)

    trimming = threading.Thread(target=trimmer, daemon=True)
    trimming.start()
    with rbroker.producer(linger_ms=1) as producer:
        for i in range(3000):
            producer.send_async("t", str(i).encode(), partition=i % 2)
            if i % 100 == 0:
                time.sleep(0.02)
        producer.flush()
    time.sleep(2.0)
    stop.set()
    trimming.join(5)
    last = {p: max(int(m.value) for m in rbroker.read("t", p)) for p in range(2)}
    wait_until(
        lambda: all((p, last[p]) in set(handled) for p in range(2)), timeout=20, what="the end"
    )
    consumer.close()
    runner.join(10)
    assert not errors, errors
    for p in range(2):
        seq = [n for q, n in handled if q == p]
        assert seq == sorted(set(seq)), f"partition {p}: repeats or reordering"


# -- ids forgotten while the messages they protect are still in the partition --------------------


def test_message_id_is_not_forgotten_while_its_message_is_still_retained(
    broker: redisq.Broker,
) -> None:
    """DESIGN §2: "Dedup and producer state never expire sooner than the messages they
    protect." Retention by age trims on writes with MINID ~ (whole stream nodes), so on a quiet
    partition a message stays long after retention_ms; its id (dedup window = retention_ms,
    remembered one to two windows) is forgotten first, and a resend is stored next to it. Every
    backend (the script's exact trim on Redis Cluster too)."""
    broker.create_topic("t", partitions=1, retention_ms=1000)
    with broker.producer(idempotence="message_id") as producer:
        first = producer.send("t", b"pay", message_id="pay-1")
        time.sleep(2.2)
        again = producer.send("t", b"pay", message_id="pay-1")
    copies = [m.offset for m in broker.read("t", 0) if m.message_id == b"pay-1"]
    assert again.duplicate or len(copies) <= 1, (
        f"message id stored twice, both retained: {copies} ({first}, {again})"
    )
