"""The thread API and the asyncio API agree (README, "asyncio": the same guarantees, errors and
results; the asyncio one awaits).

Each test body runs once per API, the asyncio one through tests/apis.py's Bridge. Runs on the
Redis of REDIS_URL (else the machine's 127.0.0.1:6379) in a namespace of its own, emptied
afterwards.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

import redisq
import redisq.consume.consumer
from redisq.errors import (
    ConsumerClosed,
    InvalidConfig,
    InvalidName,
    MessageTooLarge,
    PartitionOutOfRange,
    ProducerClosed,
    TopicExists,
    TopicNotFound,
)
from tests.apis import open_api

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
FAST = {"lease_ttl_ms": 3000}


@pytest.fixture(scope="module")
def redis_available() -> None:
    try:
        redis.Redis.from_url(URL, socket_connect_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {URL}")


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest, redis_available: None) -> Iterator[Any]:
    namespace = f"advpar{uuid.uuid4().hex[:10]}"
    driver = open_api(request.param, URL, namespace)
    try:
        yield driver
    finally:
        try:
            driver.shutdown()
        finally:
            client = redis.Redis.from_url(URL)
            for key in client.scan_iter(match=f"{namespace}:*", count=1000):
                client.delete(key)
            client.close()


def _wait_assigned(consumer: Any, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(consumer.assignment) < count:
        assert time.monotonic() < deadline, "no assignment within 10 s"
        time.sleep(0.05)


# -- what agrees: the admin calls --------------------------------------------------------------
ADMIN_CASES: dict[str, tuple[Callable[[Any], Any], type[BaseException]]] = {
    "create bad name": (lambda b: b.create_topic("bad name"), InvalidName),
    "create 0 partitions": (lambda b: b.create_topic("x", 0), InvalidConfig),
    "create bool partitions": (lambda b: b.create_topic("x", True), TypeError),
    "create existing": (lambda b: b.create_topic("t", 2), TopicExists),
    "create retention -1": (lambda b: b.create_topic("x", retention_ms=-1), InvalidConfig),
    "describe missing": (lambda b: b.describe_topic("nope"), TopicNotFound),
    "delete missing": (lambda b: b.delete_topic("nope"), TopicNotFound),
    "grow missing": (lambda b: b.add_partitions("nope", 3), TopicNotFound),
    "grow bad name": (lambda b: b.add_partitions("bad name", 3), InvalidName),
    "shrink": (lambda b: b.add_partitions("t", 1), InvalidConfig),
    "trim missing": (lambda b: b.trim("nope"), TopicNotFound),
    "consumer bad group": (lambda b: b.consumer("t", "bad group"), InvalidName),
    "consumer bad mode": (lambda b: b.consumer("t", "g", mode="x"), InvalidConfig),
    "producer bad acks": (lambda b: b.producer(acks="x"), InvalidConfig),
    "producer tx without name": (lambda b: b.producer(transactional=True), InvalidConfig),
}


@pytest.mark.parametrize("case", list(ADMIN_CASES))
def test_admin_errors(api: Any, case: str) -> None:
    api.broker.create_topic("t", 2)
    call, error = ADMIN_CASES[case]
    with pytest.raises(error):
        call(api.broker)
    assert api.broker.list_topics() == ["t"]  # nothing written on bad input
    again = api.broker.create_topic("t", 5, exist_ok=True)
    assert again.partitions == 2


# -- what agrees: send() arguments -------------------------------------------------------------
AT = datetime.now(UTC) + timedelta(seconds=30)
SEND_CASES: dict[str, tuple[dict[str, Any], type[BaseException]]] = {
    "value None": ({"value": None}, TypeError),
    "value int": ({"value": 5}, TypeError),
    "key empty": ({"key": b""}, ValueError),
    "key int": ({"key": 5}, TypeError),
    "header value int": ({"headers": {"a": 1}}, TypeError),
    "header name bytes": ({"headers": {b"a": "b"}}, TypeError),
    "partition 2": ({"partition": 2}, PartitionOutOfRange),
    "partition -1": ({"partition": -1}, PartitionOutOfRange),
    "partition bool": ({"partition": True}, TypeError),
    "timestamp -1": ({"timestamp_ms": -1}, ValueError),
    "timestamp float": ({"timestamp_ms": 1.0}, TypeError),
    "timestamp and delay": ({"timestamp_ms": 1, "delay_ms": 100}, InvalidConfig),
    "delay 0": ({"delay_ms": 0}, InvalidConfig),
    "delay nan": ({"delay_ms": float("nan")}, TypeError),
    "delay and deliver_at": ({"delay_ms": 5, "deliver_at": AT}, InvalidConfig),
    "deliver_at naive": ({"deliver_at": datetime.now() + timedelta(seconds=5)}, TypeError),
    "deliver_at 10 days": ({"deliver_at": AT + timedelta(days=10)}, InvalidConfig),
    "oversized": ({"value": b"x" * ((1 << 20) + 1)}, MessageTooLarge),
    "delayed oversized": ({"value": b"x" * ((1 << 20) + 1), "delay_ms": 100}, MessageTooLarge),
    "missing topic": ({"topic": "nope"}, TopicNotFound),
    "bad topic": ({"topic": "bad name"}, InvalidName),
}


@pytest.mark.parametrize("case", list(SEND_CASES))
def test_send_argument_errors(api: Any, case: str) -> None:
    api.broker.create_topic("t", 2)
    producer = api.broker.producer()
    try:
        producer.send("t", b"warm", partition=0)
        arguments, error = SEND_CASES[case]
        arguments = {"topic": "t", "value": b"v", **arguments}
        with pytest.raises(error):
            producer.send(**arguments)
        with pytest.raises(error):
            # The asyncio producer's first send_async() to a topic whose metadata is not loaded
            # yet reports errors about the topic through its future (its module doc says so).
            api.result(producer.send_async(**arguments))
        producer.flush(5)
        assert api.broker.describe_topic("t").total_scheduled == 0
        assert sum(p.length for p in api.broker.describe_topic("t").partitions) == 1
    finally:
        producer.close()


def test_record_metadata_and_messages(api: Any) -> None:
    api.broker.create_topic("t", 2)
    with api.broker.producer(idempotence="message_id") as producer:
        first = producer.send("t", "é", key="k", headers={"h": "1"}, message_id="m1",
                              timestamp_ms=1000)  # fmt: skip
        again = producer.send("t", "é", key="k", message_id="m1")
        delayed = producer.send("t", b"later", key="k", delay_ms=60_000)
        queued = api.result(producer.send_async("t", b"q", partition=1))
    assert (first.topic, first.duplicate) == ("t", False)
    assert first.partition == redisq.partition_for_key(b"k", 2)
    assert (again.offset, again.duplicate) == (first.offset, True)
    assert delayed.offset is None and delayed.schedule_id and delayed.deliver_at_ms
    assert (queued.partition, queued.duplicate) == (1, False)
    consumer = api.broker.consumer("t", "g", "m", **FAST)
    try:
        _wait_assigned(consumer, 2)
        messages = sorted(consumer.poll(5.0), key=lambda m: m.partition)
        got = {m.value: (m.partition, m.key, m.headers, m.message_id, m.attempt) for m in messages}
        assert got["é".encode()] == (first.partition, b"k", {"h": b"1"}, b"m1", 1)
        generated = got[b"q"][3]  # message_id mode: an id is generated when none is given
        assert got[b"q"] == (1, None, {}, generated, 1) and generated
        assert [m.timestamp_ms for m in messages if m.key] == [1000]
        assert consumer.ack(messages) == 2
        consumer.commit()
        last = [m.offset for m in messages if m.partition == first.partition][-1]
        assert consumer.committed(first.partition) == last
    finally:
        consumer.close()


def test_producer_after_close(api: Any) -> None:
    api.broker.create_topic("t", 1)
    producer = api.broker.producer()
    producer.send("t", b"v")
    producer.close()
    for call in (
        lambda: producer.send("t", b"v"),
        lambda: producer.send("t", 5),
        lambda: producer.send_async("t", b"v"),
        lambda: producer.send("t", b"v", delay_ms=100),
        lambda: producer.transaction(),
    ):
        with pytest.raises(ProducerClosed):
            call()
    assert producer.flush() is None
    assert producer.close() is None


def test_consumer_argument_errors(api: Any) -> None:
    api.broker.create_topic("t", 2)
    api.broker.producer().close()
    consumer = api.broker.consumer("t", "g", "m", **FAST)
    try:
        _wait_assigned(consumer, 2)
        with pytest.raises(InvalidConfig):
            consumer.poll(float("nan"))
        with pytest.raises(InvalidConfig):
            consumer.poll(0, 0)
        with pytest.raises(TypeError):
            consumer.poll(0, True)
        with pytest.raises(InvalidConfig):
            consumer.position(5)
        with pytest.raises(PartitionOutOfRange):
            consumer.committed(5)
        with pytest.raises(InvalidConfig):
            consumer.seek(0, "abc")
        with pytest.raises(InvalidConfig):
            consumer.seek(5, "0-1")  # a well-formed offset, a partition the topic lacks
        with pytest.raises(InvalidConfig):
            consumer.seek_to_time(0, -1)
        with pytest.raises(InvalidConfig):
            consumer.pause(5)
        with pytest.raises(TypeError):
            consumer.ack(5)
        with pytest.raises(InvalidConfig):
            consumer.run(lambda m: None, timeout=0.1)  # poll() came first
    finally:
        consumer.close()
    with pytest.raises(ConsumerClosed):
        consumer.poll(0)
    assert consumer.closed and consumer.assignment == []


# -- findings --------------------------------------------------------------------------------------
def test_consumer_close_takes_a_timeout(api: Any) -> None:
    """README: `close(timeout)` (a handler still running keeps its lease). The asyncio
    consumer's close() took no argument: TypeError."""
    api.broker.create_topic("t", 1)
    consumer = api.broker.consumer("t", "g", "m", **FAST)
    _wait_assigned(consumer, 1)
    consumer.close(timeout=2.0)
    assert consumer.closed and consumer.assignment == []
    consumer.close(1.0)  # again: nothing to do


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, "1"])
def test_consumer_close_refuses_a_bad_timeout_before_closing(api: Any, timeout: Any) -> None:
    """As producer.close(timeout): a bad timeout raises (TypeError / InvalidConfig) before
    anything is done, and the consumer stays usable. The thread consumer marked itself closed,
    then failed half-way (ValueError, OverflowError, TypeError) with its coordinator thread
    still running and its leases held."""
    api.broker.create_topic("t", 1)
    consumer = api.broker.consumer("t", "g", "m", **FAST)
    try:
        _wait_assigned(consumer, 1)
        with pytest.raises((TypeError, InvalidConfig)):
            consumer.close(timeout)
        assert not consumer.closed
        assert consumer.poll(0) == []
    finally:
        consumer.close()
    assert consumer.closed


def test_consumer_close_timeout_keeps_a_running_handlers_lease(api: Any) -> None:
    """close(timeout) returns after about timeout while a handler is still running, and the
    partition's lease is kept (another member does not start on it meanwhile)."""
    api.broker.create_topic("t", 1)
    with api.broker.producer() as producer:
        producer.send("t", b"slow")
    started = threading.Event()
    release = threading.Event()

    def handler(message: Any) -> None:
        started.set()
        release.wait(10)

    consumer = api.broker.consumer("t", "g", "m", **FAST)
    runner = threading.Thread(target=lambda: consumer.run(handler, timeout=30), daemon=True)
    runner.start()
    try:
        assert started.wait(10)
        begun = time.monotonic()
        consumer.close(timeout=0.5)
        assert time.monotonic() - begun < 5
        lease = redis.Redis.from_url(URL).get(api.broker.keys.lease("t", 0, "g"))
        assert lease is not None, "the lease of a partition whose handler runs is kept"
        release.set()
        runner.join(15)
        # The handler's worker hands the partition over once it ends (or the lease runs out).
        deadline = time.monotonic() + 10
        while redis.Redis.from_url(URL).get(api.broker.keys.lease("t", 0, "g")) is not None:
            assert time.monotonic() < deadline, "the lease is never handed back"
            time.sleep(0.05)
    finally:
        release.set()
        runner.join(15)


def test_send_positional_timeout(api: Any) -> None:
    """send(topic, value, key, headers, message_id, partition, timeout, ...): the thread API's
    seventh argument is the wait; the asyncio one took it as delay_ms and scheduled the
    message instead of sending it."""
    api.broker.create_topic("t", 1)
    with api.broker.producer() as producer:
        meta = producer.send("t", b"v", None, None, None, 0, 5)
        assert meta.offset is not None and meta.schedule_id is None
        meta = producer.send("t", b"v", timeout=5.0)
        assert meta.offset is not None
        delayed = producer.send("t", b"v", timeout=5.0, delay_ms=60_000)
        assert delayed.offset is None and delayed.schedule_id
        for bad in (float("nan"), -1, "5"):
            with pytest.raises((TypeError, InvalidConfig)):
                producer.send("t", b"not written", timeout=bad)
    assert [m.value for m in _read(api, "t")] == [b"v", b"v"]


def _read(api: Any, topic: str) -> list[Any]:
    with redisq.connect(URL, namespace=api.broker.namespace) as broker:
        return list(broker.read(topic, 0))
