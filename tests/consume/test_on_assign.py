"""on_assign runs inside run()/poll(), as Kafka's onPartitionsAssigned runs inside poll():
never before the constructor has returned (the callback may use the consumer it returned),
and nothing of a partition is read before it returns (a seek there decides the first read); a
member closed before it ever polled is told nothing, on_revoke included.

Both APIs (on the asyncio API on_assign is a coroutine function, awaited on the loop), on each
backend."""

from __future__ import annotations

import time
from typing import Any

import redisq
from tests.apis import coroutine_on_asyncio, poll_and_ack
from tests.conftest import wait_until

COUNT = 10


def fill(broker: redisq.Broker) -> list[str]:
    """COUNT messages in a one-partition topic "t"; their offsets."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        return [producer.send("t", str(i).encode()).offset for i in range(COUNT)]


def test_on_assign_waits_for_poll_and_its_seek_decides_the_first_read(
    api: Any, broker: redisq.Broker
) -> None:
    offsets = fill(broker)
    told: list[tuple[list[Any], bool]] = []
    polling: list[bool] = []

    def on_assign(tps: list[tuple[str, int]]) -> None:
        told.append((tps, bool(polling)))
        consumer.seek(0, offsets[5])  # the name is bound only once the constructor returned

    consumer = api.broker.consumer(
        "t", "g", start="earliest", on_assign=coroutine_on_asyncio(api, on_assign)
    )
    try:
        wait_until(lambda: consumer.assignment == [0], what="the lease")
        time.sleep(0.3)  # the grant was taken up: on_assign would have run by now
        assert told == [], "on_assign ran before poll()"
        polling.append(True)
        got = poll_and_ack(consumer, COUNT - 5, timeout=20)
        assert told == [([("t", 0)], True)]
        assert [m.value for m in got] == [str(i).encode() for i in range(5, COUNT)]
    finally:
        consumer.close()


def test_on_assign_before_run_handles_anything(api: Any, broker: redisq.Broker) -> None:
    offsets = fill(broker)
    handled: list[bytes] = []
    told: list[int] = []

    def on_assign(tps: list[tuple[str, int]]) -> None:
        told.append(len(handled))
        consumer.seek(0, offsets[7])

    consumer = api.broker.consumer(
        "t", "g", start="earliest", on_assign=coroutine_on_asyncio(api, on_assign)
    )
    try:
        wait_until(lambda: consumer.assignment == [0], what="the lease")
        time.sleep(0.3)  # the grant was taken up: on_assign would have run by now
        assert told == [], "on_assign ran before run()"
        consumer.run(lambda m: handled.append(m.value), idle_timeout=1.5, timeout=20)
    finally:
        consumer.close()
    assert told == [0]
    assert handled == [str(i).encode() for i in range(7, COUNT)]


def test_no_on_revoke_for_a_partition_never_announced(api: Any, broker: redisq.Broker) -> None:
    """A member that never polled is closed: it was never told of the partition, so it is not
    told it goes either (as a Kafka consumer that never polled)."""
    fill(broker)
    calls: list[str] = []
    consumer = api.broker.consumer(
        "t",
        "g",
        on_assign=coroutine_on_asyncio(api, lambda tps: calls.append("assign")),
        on_revoke=coroutine_on_asyncio(api, lambda tps: calls.append("revoke")),
    )
    wait_until(lambda: consumer.assignment == [0], what="the lease")
    consumer.close()
    assert calls == []
