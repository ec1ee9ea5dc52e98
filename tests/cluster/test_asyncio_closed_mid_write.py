# ruff: noqa: F811  (the broker and cluster3 fixtures come from tests.cluster.test_three_masters)
"""The asyncio API on a cluster client that closes connections other tasks are writing on.

redis.asyncio's RedisCluster calls its own aclose() from whichever task meets its every
`reinitialize_steps`-th MOVED (or a CLUSTERDOWN), which disconnects every connection of every
node, checked out or not (see redisq.server.connection_async.closed_mid_write). A live slot
migration
makes that happen by chance (tests/cluster/test_migration_tx_delayed.py, asyncio variants);
here one task calls the client's aclose() every few loop iterations, as redis-py would, while
others run redisq's calls on the same client: an operation (a command, then a script), a
pipeline of commands, and the consumer's exchange on a pooled connection. Each call answers or
raises an error redisq retries (redisq.produce.transactions.RETRIABLE_ERRORS), never anything else,
and none waits out the socket timeout: a connection closed in the middle of its handshake
(between its two CLIENT SETINFO writes) used to reconnect inside it and wait there for a reply
that never came (redisq.server.connection_async._WholeHandshakes); the closes land there more
often on a loaded machine.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
from redisq.consume.partition_io_async import AsyncPartitionIO
from redisq.produce.transactions import RETRIABLE_ERRORS
from redisq.protocol import Command
from redisq.protocol import transaction_ops as ops
from redisq.settings import ConsumerSettings
from tests.aio import aio
from tests.cluster.test_three_masters import broker, cluster3  # noqa: F401
from tests.servers import ServerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

CALLS = 400  # per caller; unconverted, AttributeError came out of about one call in 30
SOCKET_TIMEOUT_S = 10  # a local server answers well within it, even on a loaded machine


@aio
async def test_calls_on_connections_the_cluster_client_closes_meanwhile(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
) -> None:
    abroker = await rq.connect(
        f"redis://127.0.0.1:{cluster3[0].port}",
        namespace=broker.namespace,
        socket_timeout=SOCKET_TIMEOUT_S,
    )
    client, keys = abroker.client, abroker.keys
    io = AsyncPartitionIO(abroker, "g", "m", ConsumerSettings())
    key = keys.transaction_sweeper()
    outcomes: Counter[str] = Counter()
    unexpected: list[BaseException] = []
    timed_out: list[BaseException] = []
    done = asyncio.Event()
    closes = 0

    async def caller(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        for _ in range(CALLS):
            try:
                await call()
                outcomes["answered"] += 1
            except RETRIABLE_ERRORS as exc:
                outcomes[f"{name}: retriable"] += 1
                if isinstance(exc, redis.TimeoutError):
                    timed_out.append(exc)
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
    assert not timed_out, (
        f"{len(timed_out)} calls waited out the {SOCKET_TIMEOUT_S} s socket timeout (a handshake "
        f"wedged by a close), e.g. {timed_out[:3]!r}"
    )
    assert closes > 100 and sum(n for o, n in outcomes.items() if "retriable" in o) > 50, (
        f"the closes ({closes}) did not cut calls short often enough to prove anything: "
        f"{dict(outcomes)}"
    )
