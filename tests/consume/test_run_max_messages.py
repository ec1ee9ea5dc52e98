"""run(max_messages=N): is it a maximum? (thread and asyncio)."""

from __future__ import annotations

import pytest

import redisq
import redisq.asyncio as rq
from redisq.model.records import Message
from tests.aio import aio


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fill(broker: redisq.Broker, count: int) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for i in range(count):
            producer.send_async("t", b"%d" % i, key=str(i))
        producer.flush()


def test_run_max_messages_is_a_maximum(broker: redisq.Broker) -> None:
    fill(broker, 2000)
    seen: list[tuple[int, str]] = []
    with broker.consumer("t", "g") as consumer:
        returned = consumer.run(
            lambda m: seen.append((m.partition, m.offset)), max_messages=5, timeout=30
        )
    assert (returned, len(seen)) == (5, 5)
    # what it did not take comes next, once each; nothing it handled comes again
    with broker.consumer("t", "g") as consumer:
        consumer.run(lambda m: seen.append((m.partition, m.offset)), idle_timeout=2.0, timeout=60)
    assert len(seen) == 2000 == len(set(seen))


@aio
async def test_asyncio_run_max_messages_is_a_maximum(
    broker: redisq.Broker, server_url: str, namespace: str
) -> None:
    fill(broker, 2000)
    seen: list[tuple[int, str]] = []

    async def handler(message: Message) -> None:
        seen.append((message.partition, message.offset))

    abroker = await rq.connect(server_url, namespace=namespace)
    try:
        async with abroker.consumer("t", "g") as consumer:
            returned = await consumer.run(handler, max_messages=5, timeout=30)
        assert (returned, len(seen)) == (5, 5)
        async with abroker.consumer("t", "g") as consumer:
            await consumer.run(handler, idle_timeout=2.0, timeout=60)
    finally:
        await abroker.close()
    assert len(seen) == 2000 == len(set(seen))
