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
import redisq.model.offsets


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
                consumer.seek(p, redisq.model.offsets.offset_after(last))
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


def test_close_inside_handler(broker: redisq.Broker) -> None:
    """A handler that decides to stop calls consumer.close(): run() returns, the message it
    handled is committed (a new member of the group does not get it again)."""
    fill(broker, "t", 20, partitions=1)
    consumer = broker.consumer("t", group="g", start="earliest")
    handled: list[bytes] = []
    errors: list[BaseException] = []

    def handler(message: Any) -> None:
        handled.append(message.value)
        if len(handled) == 5:
            try:
                consumer.close()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

    bounded(lambda: consumer.run(handler, timeout=20), 30, "run() with close() in the handler")
    assert not errors, errors
    assert consumer.closed
    again: list[bytes] = []
    with broker.consumer("t", group="g") as second:
        bounded(lambda: second.run(lambda m: again.append(m.value), idle_timeout=2), 30, "run 2")
    assert handled[:5] == [f"{i}".encode() for i in range(5)]
    assert not set(again) & set(handled[:5]), f"handled again: {set(again) & set(handled[:5])}"
    assert len(handled) + len(again) >= 20


def test_close_inside_on_revoke_and_on_assign(broker: redisq.Broker) -> None:
    """close() from a rebalance callback (Kafka: close() from a callback is refused or
    immediate, never a hang): the consumer ends up closed and its thread stopped."""
    fill(broker, "t", 5, partitions=1)
    box: dict[str, Any] = {}
    errors: list[BaseException] = []

    def on_assign(tps: Any) -> None:
        try:
            box["c"].close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    consumer = broker.consumer("t", group="g", start="earliest", on_assign=on_assign)
    box["c"] = consumer

    def run() -> None:
        try:
            consumer.run(lambda m: None, timeout=10)
        except redisq.errors.ConsumerClosed:  # on_assign ran (and closed) before run() started
            pass

    bounded(run, 30, "run() with close() in on_assign")
    assert consumer.closed
    deadline = time.monotonic() + 10
    while consumer._coordinator.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not consumer._coordinator.is_alive(), "coordinator thread still running"
    assert not errors, errors


def test_commit_and_position_inside_on_revoke(broker: redisq.Broker) -> None:
    """on_revoke calls commit() and position() (Kafka users commit in onPartitionsRevoked)."""
    fill(broker, "t", 10, partitions=1)
    box: dict[str, Any] = {}
    errors: list[BaseException] = []
    revoked: list[Any] = []

    def on_revoke(tps: Any) -> None:
        try:
            box["c"].commit()
            revoked.append([box["c"].position(p) for _, p in tps])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    consumer = broker.consumer("t", group="g", start="earliest", on_revoke=on_revoke)
    box["c"] = consumer
    handled: list[bytes] = []
    bounded(
        lambda: consumer.run(lambda m: handled.append(m.value), max_messages=10),
        30,
        "run() with commit() in on_revoke",
    )
    assert not errors, errors
    assert revoked
    assert len(handled) == 10


def test_poll_from_two_threads(broker: redisq.Broker) -> None:
    """poll() from two threads at once (Kafka refuses this: ConcurrentModificationException):
    never the same message given twice without an ack in between, nothing lost."""
    fill(broker, "t", 300, partitions=2)
    consumer = broker.consumer("t", group="g", start="earliest")
    got: list[bytes] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = time.monotonic() + 15

    def poller() -> None:
        try:
            while time.monotonic() < stop:
                with lock:
                    if len(set(got)) >= 300:
                        return
                messages = consumer.poll(timeout=0.2, max_messages=7)
                with lock:
                    got.extend(m.value for m in messages)
                consumer.ack(messages)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=poller, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    bounded(lambda: consumer.close(), 30, "close")
    assert not errors, errors
    assert len(set(got)) == 300
    assert len(got) == 300, f"{len(got) - len(set(got))} given twice"


def test_ack_same_messages_from_two_threads(broker: redisq.Broker) -> None:
    """ack() of the same messages from two threads at once: counted once, committed once."""
    fill(broker, "t", 200, partitions=1)
    consumer = broker.consumer("t", group="g", start="earliest")
    try:
        total = 0
        while total < 200:
            messages = bounded(lambda: consumer.poll(timeout=2, max_messages=50), 10, "poll")
            assert messages
            counts: list[int] = []
            barrier = threading.Barrier(2)

            def acker() -> None:
                barrier.wait()  # noqa: B023
                counts.append(consumer.ack(messages))  # noqa: B023

            ts = [threading.Thread(target=acker, daemon=True) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(10)
            assert sorted(counts) == [0, len(messages)] or sum(counts) == len(messages), counts
            total += len(messages)
        bounded(consumer.commit, 10, "commit")
        assert consumer.committed(0) == list(broker.read("t", 0))[-1].offset
    finally:
        bounded(consumer.close, 30, "close")


# -- asyncio --------------------------------------------------------------------------------------
async def _async_values(broker: Any, topic: str, partitions: int) -> list[bytes]:
    values: list[bytes] = []
    for p in range(partitions):
        async for m in broker.read(topic, p):
            values.append(m.value)
    return values


def test_async_cancel_gathered_sends_then_reuse(server_url: str, namespace: str) -> None:
    """Gather 300 send() calls, cancel the gather part way, then use the producer again: the
    next sends and flush() complete, close() leaves no future pending, nothing stored twice."""
    import asyncio

    import redisq.asyncio as rq

    async def body() -> None:
        broker = await rq.connect(server_url, namespace=namespace)
        try:
            await broker.create_topic("t", partitions=2)
            producer = broker.producer(linger_ms=1)
            await producer.send("t", b"warm", key="k1")  # the stampede: its own test
            gathered = asyncio.gather(
                *(producer.send("t", f"a{i}".encode(), key=f"k{i % 3}") for i in range(300))
            )
            await asyncio.sleep(0.01)
            gathered.cancel()
            try:
                await gathered
            except asyncio.CancelledError:
                pass
            futures = [producer.send_async("t", f"b{i}".encode(), key="k0") for i in range(50)]
            meta = await asyncio.wait_for(producer.send("t", b"last", key="k0"), 20)
            assert meta.offset
            await asyncio.wait_for(producer.flush(), 20)
            assert all(f.done() for f in futures)
            closes = [asyncio.ensure_future(producer.close()) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*closes), 20)
            values = await _async_values(broker, "t", 2)
            assert len(values) == len(set(values)), "stored twice"
            b_values = [v for v in values if v.startswith(b"b")]
            assert b_values == [f"b{i}".encode() for i in range(50)]
        finally:
            await broker.delete_topic("t", force=True)
            await broker.close()

    bounded(lambda: asyncio.run(asyncio.wait_for(body(), 60)), 90, "asyncio body")


def test_async_cancel_poll_then_poll_again(server_url: str, namespace: str) -> None:
    """Cancel a task blocked in poll() at random points, then poll again: every message is
    given (none skipped by the cancelled read), in order per partition."""
    import asyncio
    import random

    import redisq.asyncio as rq

    async def body() -> None:
        broker = await rq.connect(server_url, namespace=namespace)
        try:
            await broker.create_topic("t", partitions=1)
            async with broker.producer() as producer:
                for i in range(200):
                    producer.send_async("t", f"{i}".encode(), key="k")
                await producer.flush()
            consumer = broker.consumer("t", group="g", start="earliest")
            got: list[bytes] = []
            rng = random.Random(7)
            deadline = time.monotonic() + 30
            while len(got) < 200 and time.monotonic() < deadline:
                task = asyncio.ensure_future(consumer.poll(timeout=0.5, max_messages=9))
                await asyncio.sleep(rng.random() * 0.01)
                if rng.random() < 0.5:
                    task.cancel()
                try:
                    messages = await task
                except asyncio.CancelledError:
                    continue
                got.extend(m.value for m in messages)
                await consumer.ack(messages)
            await asyncio.wait_for(consumer.close(), 20)
            assert got == [f"{i}".encode() for i in range(200)], (len(got), got[:20])
        finally:
            await broker.delete_topic("t", force=True)
            await broker.close()

    bounded(lambda: asyncio.run(asyncio.wait_for(body(), 60)), 90, "asyncio body")


def test_async_gather_many_first_sends(server_url: str, namespace: str) -> None:
    """asyncio.gather of 300 send() calls on a new producer (a common asyncio pattern): all are
    acknowledged; the topic's metadata is read once, not once per waiting send (300 reads at
    once ran out of redis-py's 100 pooled connections: MaxConnectionsError)."""
    import asyncio

    import redisq.asyncio as rq

    async def body() -> None:
        broker = await rq.connect(server_url, namespace=namespace)
        try:
            await broker.create_topic("t", partitions=2)
            async with broker.producer(linger_ms=1) as producer:
                metas = await asyncio.wait_for(
                    asyncio.gather(
                        *(producer.send("t", f"a{i}".encode(), key=f"k{i % 3}") for i in range(300))
                    ),
                    30,
                )
            assert len(metas) == 300
            values = await _async_values(broker, "t", 2)
            assert sorted(values) == sorted(f"a{i}".encode() for i in range(300))
        finally:
            await broker.delete_topic("t", force=True)
            await broker.close()

    bounded(lambda: asyncio.run(asyncio.wait_for(body(), 60)), 90, "asyncio body")
