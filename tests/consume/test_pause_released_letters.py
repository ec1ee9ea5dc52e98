"""pause() while run() hands out messages a `redisq dlq release` freed (park_key policy)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import redisq
import redisq.asyncio as rq
from redisq.consume.deadletter import release_key
from redisq.model.records import Message
from tests.aio import aio, start_running
from tests.aio import wait_until as async_wait_until
from tests.conftest import wait_until


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_pause_stops_released_held_messages(broker: redisq.Broker) -> None:
    """README: after pause() returns, no further message of the partition starts in run()
    (key_concurrency=1). Here the messages start after pause() are the held ones of a key
    that was just released."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"bad-0", key="bad")
        for i in range(1, 6):
            producer.send("t", f"bad-{i}".encode(), key="bad")
        producer.send("t", b"ok", key="ok")
    started: list[tuple[float, bytes]] = []
    gate = threading.Event()
    inside = threading.Event()

    def handler(message: Message) -> None:
        if message.value == b"bad-0":
            raise RuntimeError("poison")
        started.append((time.monotonic(), message.value))
        if message.value == b"bad-1":
            inside.set()
            assert gate.wait(20)

    consumer = broker.consumer(
        "t", "g", failure_policy="park_key", max_attempts=1, retry_backoff_ms=10
    )
    thread = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: any(v == b"ok" for _, v in started), what="ok handled, bad parked")
        wait_until(lambda: release_key(broker, "t", "g", "bad") == 1, what="bad parked")
        assert inside.wait(20), "bad-1 (released) started"
        consumer.pause(0)
        paused_at = time.monotonic()
        gate.set()
        time.sleep(1.5)
        after = [v for t, v in started if t > paused_at]
        assert after == [], f"started after pause() returned: {after}"
        consumer.resume(0)
        wait_until(
            lambda: [v for _, v in started][-4:] == [b"bad-2", b"bad-3", b"bad-4", b"bad-5"],
            what="the rest after resume()",
        )
    finally:
        gate.set()
        consumer.close(timeout=5)
        thread.join(10)


@aio
async def test_asyncio_pause_stops_released_held_messages(
    broker: redisq.Broker, server_url: str, namespace: str
) -> None:
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for i in range(6):
            producer.send("t", f"bad-{i}".encode(), key="bad")
        producer.send("t", b"ok", key="ok")
    started: list[tuple[float, bytes]] = []
    gate = asyncio.Event()
    inside = asyncio.Event()

    async def handler(message: Message) -> None:
        if message.value == b"bad-0":
            raise RuntimeError("poison")
        started.append((time.monotonic(), message.value))
        if message.value == b"bad-1":
            inside.set()
            await asyncio.wait_for(gate.wait(), 20)

    abroker = await rq.connect(server_url, namespace=namespace)
    consumer = abroker.consumer(
        "t", "g", failure_policy="park_key", max_attempts=1, retry_backoff_ms=10
    )
    task = await start_running(consumer, handler)
    try:
        await async_wait_until(lambda: any(v == b"ok" for _, v in started), what="ok handled")

        async def released() -> bool:
            return await asyncio.to_thread(release_key, broker, "t", "g", "bad") == 1

        deadline = time.monotonic() + 20
        while not await released():
            assert time.monotonic() < deadline, "bad parked"
            await asyncio.sleep(0.05)
        await asyncio.wait_for(inside.wait(), 20)
        consumer.pause(0)
        paused_at = time.monotonic()
        gate.set()
        await asyncio.sleep(1.5)
        after = [v for t, v in started if t > paused_at]
        assert after == [], f"started after pause() returned: {after}"
        consumer.resume(0)
        await async_wait_until(
            lambda: [v for _, v in started][-4:] == [b"bad-2", b"bad-3", b"bad-4", b"bad-5"],
            what="the rest after resume()",
        )
    finally:
        gate.set()
        await consumer.close()
        await asyncio.wait_for(task, 30)
        await abroker.close()
