"""on_assign runs inside run()/poll(), as Kafka's onPartitionsAssigned runs inside poll():
never before the constructor has returned (the callback may use the consumer it returned),
and nothing of a partition is read before it returns (a seek there decides the first read).

Both APIs, on each backend."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import redisq
import redisq.asyncio as rq
from tests.aio import Env, aio
from tests.aio import wait_until as async_wait_until
from tests.conftest import wait_until

COUNT = 10


def fill(broker: redisq.Broker) -> list[str]:
    """COUNT messages in a one-partition topic "t"; their offsets."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        return [producer.send("t", str(i).encode()).offset for i in range(COUNT)]


def test_on_assign_waits_for_poll_and_its_seek_decides_the_first_read(
    broker: redisq.Broker,
) -> None:
    offsets = fill(broker)
    told: list[tuple[list[Any], bool]] = []
    polling = threading.Event()

    def on_assign(tps: list[tuple[str, int]]) -> None:
        told.append((tps, polling.is_set()))
        consumer.seek(0, offsets[5])  # the name is bound only once the constructor returned

    consumer = broker.consumer("t", "g", start="earliest", on_assign=on_assign)
    try:
        wait_until(lambda: consumer.assignment == [0], what="the lease")
        time.sleep(0.3)  # the grant was taken up: on_assign would have run by now
        assert told == [], "on_assign ran before poll()"
        polling.set()
        got = []
        deadline = time.monotonic() + 20
        while len(got) < COUNT - 5 and time.monotonic() < deadline:
            messages = consumer.poll(timeout=0.2)
            consumer.ack(messages)
            got.extend(messages)
        assert told == [([("t", 0)], True)]
        assert [m.value for m in got] == [str(i).encode() for i in range(5, COUNT)]
    finally:
        consumer.close()


def test_on_assign_before_run_handles_anything(broker: redisq.Broker) -> None:
    offsets = fill(broker)
    handled: list[bytes] = []
    told: list[int] = []

    def on_assign(tps: list[tuple[str, int]]) -> None:
        told.append(len(handled))
        consumer.seek(0, offsets[7])

    consumer = broker.consumer("t", "g", start="earliest", on_assign=on_assign)
    wait_until(lambda: consumer.assignment == [0], what="the lease")
    time.sleep(0.3)
    assert told == [], "on_assign ran before run()"
    consumer.run(lambda m: handled.append(m.value), idle_timeout=1.5, timeout=20)
    assert told == [0]
    assert handled == [str(i).encode() for i in range(7, COUNT)]


def test_no_on_revoke_for_a_partition_never_announced(broker: redisq.Broker) -> None:
    """A member that never polled is closed: it was never told of the partition, so it is not
    told it goes either (as a Kafka consumer that never polled)."""
    fill(broker)
    calls: list[str] = []
    consumer = broker.consumer(
        "t",
        "g",
        on_assign=lambda tps: calls.append("assign"),
        on_revoke=lambda tps: calls.append("revoke"),
    )
    wait_until(lambda: consumer.assignment == [0], what="the lease")
    consumer.close()
    assert calls == []


@aio
async def test_asyncio_on_assign_waits_for_poll_and_its_seek_decides_the_first_read(
    env: Env,
) -> None:
    offsets = fill(env.sync)
    told: list[tuple[list[Any], bool]] = []
    polling: list[bool] = []
    async with env.connect() as broker:
        consumer: rq.Consumer

        async def on_assign(tps: list[tuple[str, int]]) -> None:
            told.append((tps, bool(polling)))
            consumer.seek(0, offsets[5])

        consumer = broker.consumer("t", "g", start="earliest", on_assign=on_assign)
        async with consumer:
            await async_wait_until(lambda: consumer.assignment == [0], what="the lease")
            await asyncio.sleep(0.3)
            assert told == [], "on_assign ran before poll()"
            polling.append(True)
            got: list[redisq.Message] = []
            deadline = time.monotonic() + 20
            while len(got) < COUNT - 5 and time.monotonic() < deadline:
                messages = await consumer.poll(timeout=0.2)
                await consumer.ack(messages)
                got.extend(messages)
            assert told == [([("t", 0)], True)]
            assert [m.value for m in got] == [str(i).encode() for i in range(5, COUNT)]


@aio
async def test_asyncio_on_assign_before_run_handles_anything(env: Env) -> None:
    offsets = fill(env.sync)
    handled: list[bytes] = []
    told: list[int] = []
    async with env.connect() as broker:
        consumer: rq.Consumer

        async def on_assign(tps: list[tuple[str, int]]) -> None:
            told.append(len(handled))
            consumer.seek(0, offsets[7])

        consumer = broker.consumer("t", "g", start="earliest", on_assign=on_assign)
        await consumer.start()
        await async_wait_until(lambda: consumer.assignment == [0], what="the lease")
        assert told == [], "on_assign ran before run()"
        await consumer.run(lambda m: handled.append(m.value), idle_timeout=1.5, timeout=20)
    assert told == [0]
    assert handled == [str(i).encode() for i in range(7, COUNT)]
