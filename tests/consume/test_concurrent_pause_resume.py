"""Concurrent mode (Redis consumer groups): pause() and resume() in run(), through both APIs
(the `api` fixture) on Valkey and Redis; a pause part-way through a read, on the thread API."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import redisq
from redisq.model.records import Message
from tests.apis import coroutine_on_asyncio
from tests.conftest import wait_until
from tests.consume.test_consumer import run_in_thread


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def send(broker: redisq.Broker, *values: bytes) -> None:
    with broker.producer() as producer:
        for value in values:
            producer.send("t", value, key="k")


AFTER = [f"after-{i}".encode() for i in range(5)]


def test_concurrent_pause_stops_run(api: Any, broker: redisq.Broker) -> None:
    """README: after pause() returns, no further message of the partition starts in run(). On
    the asyncio API the handler is a coroutine function and pause() is called on the loop."""
    broker.create_topic("t", partitions=1)
    send(broker, b"first")
    seen: list[bytes] = []
    consumer = api.broker.consumer("t", "g", mode="concurrent", block_ms=100)
    thread = run_in_thread(consumer, coroutine_on_asyncio(api, lambda m: seen.append(m.value)))
    try:
        wait_until(lambda: seen == [b"first"], what="the first message")
        consumer.pause(0)
        send(broker, *AFTER)
        time.sleep(1.5)  # a window for a wrong delivery to show (block_ms=100: 15 reads)
        assert seen == [b"first"], f"handled while paused: {seen[1:]}"
        consumer.resume(0)
        wait_until(lambda: sorted(seen[1:]) == AFTER, timeout=10, what="the rest after resume")
    finally:
        consumer.close(timeout=5)
        thread.join(10)


def test_concurrent_pause_part_way_through_a_read(broker: redisq.Broker) -> None:
    """A pause while run() is inside the 4th message of a read of 20: nothing more starts; the
    16 left (pending on this member) are handled after resume(), each once."""
    broker.create_topic("t", partitions=1)
    values = [f"m{i}".encode() for i in range(20)]
    send(broker, *values)
    seen: list[bytes] = []
    inside = threading.Event()
    gate = threading.Event()

    def handler(message: Message) -> None:
        seen.append(message.value)
        if message.value == b"m3":
            inside.set()
            assert gate.wait(20)

    consumer = broker.consumer("t", "g", mode="concurrent", block_ms=100)
    thread = threading.Thread(target=consumer.run, args=(handler,))
    thread.start()
    try:
        assert inside.wait(20)
        consumer.pause(0)
        gate.set()
        time.sleep(1.0)
        assert seen == values[:4]
        consumer.resume(0)
        wait_until(lambda: len(seen) >= 20, timeout=10, what="the rest after resume")
        time.sleep(0.5)
        assert sorted(seen) == sorted(values)
    finally:
        gate.set()
        consumer.close(timeout=5)
        thread.join(10)
    pending = broker.client.xpending(broker.keys.log("t", 0), "g")
    assert pending["pending"] == 0
