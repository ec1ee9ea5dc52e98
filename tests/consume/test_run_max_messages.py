"""run(max_messages=N) is a maximum (both APIs, standalone Valkey and Redis): it returns N
having handled exactly N, and what it did not take comes to the next run() once each, nothing
it handled coming again."""

from __future__ import annotations

from typing import Any

import pytest

import redisq
from tests.apis import coroutine_on_asyncio


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fill(broker: redisq.Broker, count: int) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for i in range(count):
            producer.send_async("t", b"%d" % i, key=str(i))
        producer.flush()


def test_run_max_messages_is_a_maximum(api: Any, broker: redisq.Broker) -> None:
    """On the asyncio API the handler is a coroutine function, awaited on the loop."""
    fill(broker, 2000)
    seen: list[tuple[int, str]] = []
    handler = coroutine_on_asyncio(api, lambda m: seen.append((m.partition, m.offset)))
    with api.broker.consumer("t", "g") as consumer:
        returned = consumer.run(handler, max_messages=5, timeout=30)
    assert (returned, len(seen)) == (5, 5)
    # what it did not take comes next, once each; nothing it handled comes again
    with api.broker.consumer("t", "g") as consumer:
        consumer.run(handler, idle_timeout=2.0, timeout=60)
    assert len(seen) == 2000 == len(set(seen))
