"""pause() while run() hands out messages a `redisq dlq release` freed (park_key policy), through
both APIs (the `api` fixture) on Valkey and Redis."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import redisq
from redisq.consume.deadletter import release_key
from redisq.model.records import Message
from tests.conftest import wait_until
from tests.consume.test_consumer import run_in_thread


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Started:
    """bad-0 fails (its key is parked); every other message is recorded when it starts, and
    bad-1 then waits for `gate`. `handle` is the same as a coroutine function (the asyncio API
    awaits it on its loop; the wait for the gate does not hold the loop)."""

    def __init__(self) -> None:
        self.started: list[tuple[float, bytes]] = []
        self.gate = threading.Event()
        self.inside = threading.Event()

    def _start(self, message: Message) -> bool:
        """Record the start; True for the message that must wait for the gate."""
        if message.value == b"bad-0":
            raise RuntimeError("poison")
        self.started.append((time.monotonic(), message.value))
        if message.value == b"bad-1":
            self.inside.set()
            return True
        return False

    def __call__(self, message: Message) -> None:
        if self._start(message):
            assert self.gate.wait(20)

    async def handle(self, message: Message) -> None:
        if self._start(message):
            assert await asyncio.to_thread(self.gate.wait, 20)


def test_pause_stops_released_held_messages(api: Any, broker: redisq.Broker) -> None:
    """README: after pause() returns, no further message of the partition starts in run()
    (key_concurrency=1). Here the messages start after pause() are the held ones of a key
    that was just released."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for i in range(6):
            producer.send("t", f"bad-{i}".encode(), key="bad")
        producer.send("t", b"ok", key="ok")
    handler = Started()
    consumer = api.broker.consumer(
        "t", "g", failure_policy="park_key", max_attempts=1, retry_backoff_ms=10
    )
    thread = run_in_thread(consumer, handler.handle if api.name == "async" else handler)
    started = handler.started
    try:
        wait_until(lambda: any(v == b"ok" for _, v in started), what="ok handled, bad parked")
        wait_until(lambda: release_key(broker, "t", "g", "bad") == 1, what="bad parked")
        assert handler.inside.wait(20), "bad-1 (released) started"
        consumer.pause(0)
        paused_at = time.monotonic()
        handler.gate.set()
        time.sleep(1.5)  # a window for a wrong start to show
        after = [v for t, v in started if t > paused_at]
        assert after == [], f"started after pause() returned: {after}"
        consumer.resume(0)
        wait_until(
            lambda: [v for _, v in started][-4:] == [b"bad-2", b"bad-3", b"bad-4", b"bad-5"],
            what="the rest after resume()",
        )
    finally:
        handler.gate.set()
        consumer.close(timeout=5)
        thread.join(10)
