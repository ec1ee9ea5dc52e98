# ruff: noqa: F811  (the broker and cluster3 fixtures are imported from tests.test_cluster)
"""The asyncio API on a cluster client that closes connections other tasks are writing on.

redis.asyncio's RedisCluster calls its own aclose() from whichever task meets its every
`reinitialize_steps`-th MOVED (or a CLUSTERDOWN), which disconnects every connection of every
node, checked out or not (see redisq.asyncio.client.closed_mid_write). A live slot migration
makes that happen by chance (tests/test_cluster_migration_tx_delayed.py, asyncio variants);
here one task calls the client's aclose() every few loop iterations, as redis-py would, while
others run redisq's calls on the same client: an operation (a command, then a script), a
pipeline of commands, and the consumer's exchange on a pooled connection. Each call answers or
raises an error redisq retries (redisq.transactions.RETRIABLE_ERRORS), never anything else.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from redisq import tx_ops as ops
from redisq.asyncio.partition import AsyncPartitionIO
from redisq.protocol import Command
from redisq.settings import ConsumerSettings
from redisq.transactions import RETRIABLE_ERRORS
from tests.aio import aio
from tests.servers import ServerProcess
from tests.test_cluster import broker, cluster3  # noqa: F401

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

CALLS = 400  # per caller; unconverted, AttributeError came out of about one call in 30


@aio
async def test_calls_on_connections_the_cluster_client_closes_meanwhile(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
) -> None:
    abroker = await rq.connect(f"redis://127.0.0.1:{cluster3[0].port}", namespace=broker.namespace)
    client, keys = abroker.client, abroker.keys
    io = AsyncPartitionIO(abroker, "g", "m", ConsumerSettings())
    key = keys.transaction_sweeper()
    outcomes: Counter[str] = Counter()
    unexpected: list[BaseException] = []
    done = asyncio.Event()
    closes = 0

    async def caller(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        for _ in range(CALLS):
            try:
                await call()
                outcomes["answered"] += 1
            except RETRIABLE_ERRORS:
                outcomes[f"{name}: retriable"] += 1
            except Exception as exc:
                unexpected.append(exc)

    async def closer() -> None:
        nonlocal closes
        rng = random.Random(7)
        while not done.is_set():
            for _ in range(rng.randrange(1, 60)):
                await asyncio.sleep(0)
            await client.aclose()  # what redis-py does itself on a MOVED storm
            closes += 1

    callers = [
        caller("operation", lambda: abroker.run(ops.take_lease(key, "t", 5000))),
        caller("operation", lambda: abroker.run(ops.take_lease(f"{key}:2", "t", 5000))),
        caller("pipeline", lambda: abroker.scripts.execute([Command(("GET", key))] * 2)),
        caller("exchange", lambda: io._exchange(key, [("EXISTS", key)])),
    ]
    closing = asyncio.ensure_future(closer())
    try:
        await asyncio.gather(*callers)
    finally:
        done.set()
        await closing
        await client.delete(key, f"{key}:2")
        await abroker.close()
    assert not unexpected, f"{len(unexpected)} non-retriable errors, e.g. {unexpected[:3]!r}"
    assert closes > 100 and sum(n for o, n in outcomes.items() if "retriable" in o) > 50, (
        f"the closes ({closes}) did not cut calls short often enough to prove anything: "
        f"{dict(outcomes)}"
    )
