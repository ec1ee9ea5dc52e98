"""After the server drops its clients' connections (a restart, an idle timeout, CLIENT KILL TYPE
normal), a consumer's calls outside a send path recover: a pooled connection the server closed
is replaced before the command is written (it never reached the server), in both APIs.

The asyncio client used to hand redis-py's raw "ConnectionError: Connection closed by server."
to the caller from such a connection (redis-py's own check looks only at what the event loop has
read from the socket, and the loop may not have run since the kill), while the thread API's
pool polls the socket and reconnects (issue 33, item 6). Each round kills every client
connection, then makes one call at once: joining the group (a consumer's start), the
committed position, commit(), ack() of a concurrent member (XACK), poll(), the metadata
(describe_topic); any redis.exceptions error escaping fails the test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
from tests.cluster.test_three_masters import cluster3  # noqa: F401
from tests.servers import ServerProcess

pytestmark = pytest.mark.fault

ROUNDS = 15
FAST = {"lease_ttl_ms": 3000}


def kill_clients(*killers: redis.Redis) -> int:
    return sum(
        int(killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))
        for killer in killers
    )


@pytest.fixture
def server() -> Any:
    process = ServerProcess().start()
    yield process
    process.stop()


def asyncio_calls_after_kills(url: str, killers: list[redis.Redis]) -> None:
    escaped: list[tuple[str, BaseException]] = []

    async def scenario() -> None:
        broker = await rq.connect(url, namespace=f"s{uuid.uuid4().hex[:8]}")
        await broker.create_topic("orders", partitions=2)
        async with broker.producer() as producer:
            for i in range(40):
                await producer.send("orders", b"v%d" % i, key=f"k{i}")
        orderly = broker.consumer("orders", "g", **FAST)
        competing = broker.consumer("orders", "c", mode="concurrent", **FAST)
        await orderly.start()
        await competing.start()
        given = await competing.poll(timeout=5, max_messages=40)
        assert given
        held = await orderly.poll(timeout=5, max_messages=40)
        await orderly.ack(held)

        async def joined() -> None:
            member = broker.consumer("orders", f"j{uuid.uuid4().hex[:6]}", **FAST)
            try:
                await member.start()
            finally:
                await member.close(timeout=5)

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "join": joined,
            "committed": lambda: orderly.committed(0),
            "commit": orderly.commit,
            "ack (XACK)": lambda: competing.ack(given[:1]),
            "poll": lambda: orderly.poll(timeout=0),
            "describe_topic": lambda: broker.describe_topic("orders"),
        }
        try:
            for _ in range(ROUNDS):
                for name, call in calls.items():
                    kill_clients(*killers)  # no await since: the loop has not seen the kill
                    try:
                        await call()
                    except redis.RedisError as exc:
                        escaped.append((name, exc))
        finally:
            await orderly.close(timeout=10)
            await competing.close(timeout=10)
            await broker.delete_topic("orders", force=True)
            await broker.close()

    try:
        asyncio.run(scenario())
    finally:
        for killer in killers:
            killer.close()
    assert not escaped, escaped[:5]


def test_asyncio_calls_recover_from_connections_the_server_dropped(server: ServerProcess) -> None:
    asyncio_calls_after_kills(server.url, [server.client(socket_timeout=5)])


@pytest.mark.cluster
def test_asyncio_calls_recover_on_a_cluster(cluster3: list[ServerProcess]) -> None:  # noqa: F811
    """The same on Redis Cluster: the nodes' connections replace a dropped one as they hand it
    out (redis-py's cluster client otherwise closes every connection and raises)."""
    url = f"redis://127.0.0.1:{cluster3[0].port}"
    asyncio_calls_after_kills(url, [node.client(socket_timeout=5) for node in cluster3])


def test_thread_calls_recover_from_connections_the_server_dropped(server: ServerProcess) -> None:
    killer = server.client(socket_timeout=5)
    escaped: list[tuple[str, BaseException]] = []
    broker = redisq.connect(server.url, namespace=f"s{uuid.uuid4().hex[:8]}")
    broker.create_topic("orders", partitions=2)
    with broker.producer() as producer:
        for i in range(40):
            producer.send("orders", b"v%d" % i, key=f"k{i}")
    orderly = broker.consumer("orders", "g", **FAST)
    competing = broker.consumer("orders", "c", mode="concurrent", **FAST)
    given = competing.poll(timeout=5, max_messages=40)
    assert given
    orderly.ack(orderly.poll(timeout=5, max_messages=40))

    def joined() -> None:
        broker.consumer("orders", f"j{uuid.uuid4().hex[:6]}", **FAST).close(timeout=5)

    calls: dict[str, Callable[[], Any]] = {
        "join": joined,
        "committed": lambda: orderly.committed(0),
        "commit": orderly.commit,
        "ack (XACK)": lambda: competing.ack(given[:1]),
        "poll": lambda: orderly.poll(timeout=0),
        "describe_topic": lambda: broker.describe_topic("orders"),
    }
    try:
        for _ in range(ROUNDS):
            for name, call in calls.items():
                kill_clients(killer)
                try:
                    call()
                except redis.RedisError as exc:
                    escaped.append((name, exc))
    finally:
        orderly.close(timeout=10)
        competing.close(timeout=10)
        broker.delete_topic("orders", force=True)
        killer.close()
    assert not escaped, escaped[:5]
