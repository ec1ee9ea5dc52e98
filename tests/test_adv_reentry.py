"""Adversarial re-entrancy and concurrency tests: the thread and asyncio APIs called the way
Kafka client users call them (from callbacks, handlers, several threads at once). Every call
that could hang runs in a daemon thread with a bound: a hang fails the test."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import redisq


@pytest.fixture(params=["redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """fn() in a daemon thread; fails if it has not returned within timeout seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"bounded-{what}")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{what}: still running after {timeout} s (hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- producer: re-entrancy from a future's callback ------------------------------------------------
def test_send_async_inside_done_callback(broker: redisq.Broker) -> None:
    """Kafka: send() from a Callback is allowed (it runs on the I/O thread and must not block
    for long). Here a callback that calls send_async() must not deadlock the sender."""
    broker.create_topic("t", partitions=1)
    producer = broker.producer()
    chained: list[Any] = []

    def callback(future: Any) -> None:
        chained.append(producer.send_async("t", b"second", key="k"))

    def go() -> None:
        future = producer.send_async("t", b"first", key="k")
        future.add_done_callback(callback)
        producer.flush(timeout=10)
        assert chained, "callback not called"
        chained[0].result(timeout=10)

    try:
        bounded(go, 20, "send_async in callback")
    finally:
        bounded(lambda: producer.close(timeout=5), 15, "close")
    assert [m.value for m in broker.read("t", 0)] == [b"first", b"second"]


def test_eight_senders_flush_then_close(broker: redisq.Broker) -> None:
    """8 threads send_async/send while another flushes then closes: every future resolves
    (acknowledged or ProducerClosed), nothing stored twice, each thread's per-key order kept."""
    broker.create_topic("t", partitions=3)
    producer = broker.producer(linger_ms=2, max_batch_messages=20)
    futures: dict[int, list[tuple[bytes, Any]]] = {i: [] for i in range(8)}
    start = threading.Barrier(9)
    errors: list[BaseException] = []

    def sender(i: int) -> None:
        start.wait()
        for n in range(400):
            value = f"{i}:{n}".encode()
            try:
                if n % 50 == 0:
                    producer.send("t", value, key=f"k{i}", timeout=30)
                    futures[i].append((value, None))
                else:
                    futures[i].append((value, producer.send_async("t", value, key=f"k{i}")))
            except redisq.errors.ProducerClosed:
                return
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=sender, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(0.05)
    bounded(lambda: producer.flush(timeout=30), 40, "flush")
    bounded(lambda: producer.close(timeout=30), 40, "close")
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert not errors, errors
    acked: dict[int, list[bytes]] = {i: [] for i in range(8)}
    for i, sent in futures.items():
        for value, future in sent:
            if future is None:
                acked[i].append(value)
                continue
            assert future.done(), f"{value!r}: future still pending after close()"
            if future.exception(timeout=0) is None:
                acked[i].append(value)
    stored: list[bytes] = []
    for p in range(3):
        stored += [m.value for m in broker.read("t", p)]
    assert len(stored) == len(set(stored)), "a message stored twice"
    for i in range(8):
        mine = [v for v in stored if v.startswith(f"{i}:".encode())]
        assert mine == sorted(mine, key=lambda v: int(v.split(b":")[1])), f"thread {i} order"
        assert set(acked[i]) <= set(mine), f"thread {i}: acknowledged but not stored"


# -- consumer: re-entrancy from callbacks and handlers ---------------------------------------------
def fill(broker: redisq.Broker, topic: str, n: int, partitions: int = 2) -> None:
    broker.create_topic(topic, partitions=partitions)
    with broker.producer() as producer:
        for i in range(n):
            producer.send_async(topic, f"{i}".encode(), key=f"k{i % 7}")


def test_seek_position_in_on_assign(broker: redisq.Broker) -> None:
    """Kafka users seek in onPartitionsAssigned: seek to the end of each partition there, so
    only messages sent afterwards are handled."""
    fill(broker, "t", 40)
    consumer_box: dict[str, Any] = {}
    seen: list[Any] = []
    errors: list[BaseException] = []

    def on_assign(tps: list[tuple[str, int]]) -> None:
        consumer = consumer_box["c"]
        try:
            for _, p in tps:
                last = list(broker.read("t", p))[-1].offset
                consumer.seek(p, redisq.records.offset_after(last))
                seen.append((p, consumer.position(p), list(consumer.assignment)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    # As a Kafka user writes it: the callback uses the consumer the constructor returned.
    consumer = broker.consumer("t", group="g", start="earliest", on_assign=on_assign)
    consumer_box["c"] = consumer
    handled: list[bytes] = []
    runner = threading.Thread(
        target=lambda: consumer.run(lambda m: handled.append(m.value), timeout=8), daemon=True
    )
    runner.start()
    deadline = time.monotonic() + 15
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    with broker.producer() as producer:
        producer.send("t", b"after", key="k0")
    runner.join(30)
    assert not runner.is_alive()
    assert not errors, errors
    assert handled == [b"after"], handled
