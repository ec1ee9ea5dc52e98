"""A lease grant whose answer is lost (the connection breaks after acquire_lease ran): the
partition must not sit idle until the lease runs out (30 s by default).

Each acquire attempt carries a request id; the instance that got no answer sends the same id
again, and acquire_lease.lua answers it with the grant it made (same lease value, same fencing
token, its ttl restarted). A member that no longer wants the partition (it closes, or a
rebalance moved it) takes that grant with `again` and releases it. The script's rules run on
every backend; the faults are real (a proxy forwards the call, keeps the answer, then resets
the connection), on a private Redis 7.0 and Valkey, thread and asyncio consumers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

import redisq
import redisq.asyncio as rq
from redisq.group import GroupMembership
from redisq.records import Message
from tests.aio import aio
from tests.aio import wait_until as async_wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess, binary_for
from tests.test_consumer import wait_until

VALUES = [f"m{i}".encode() for i in range(5)]
TTL_MS = 30_000  # the default lease ttl: what the partition would wait without the fix
RECOVERED_S = 10.0  # well under TTL_MS: the lost grant is answered again on the next attempt
# No heartbeat or metadata read falls in a test's few seconds (not needed for the trap, which
# only holds an acquire; it keeps the logs of a run short).
QUIET = {"lease_ttl_ms": TTL_MS, "heartbeat_interval_ms": 60_000, "session_timeout_ms": 180_000,
         "metadata_max_age_ms": 120_000}  # fmt: skip


def send(broker: redisq.Broker, *values: bytes) -> None:
    with broker.producer() as producer:
        for value in values:
            producer.send("t", value, key="k")


# -- the script's rules, every backend ------------------------------------------------------------
def member(broker: redisq.Broker, name: str) -> GroupMembership:
    m = GroupMembership(
        broker, "t", "g", name, mode="orderly", start="earliest", policy="dead_letter",
        lease_ttl_ms=TTL_MS, session_timeout_ms=TTL_MS,
    )  # fmt: skip
    m.join()
    return m


def test_the_same_request_is_answered_with_its_grant(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, b = member(broker, "a"), member(broker, "b")
    lease_key = broker.keys.lease("t", 0, "g")
    first = a.acquire_lease(0, "r1")
    assert first is not None and first.takeovers == 0
    broker.client.pexpire(lease_key, 5_000)
    again = a.acquire_lease(0, "r1")  # the answer to the first was lost: sent again
    assert again == first  # the same grant: value, token, position, count
    assert broker.client.pttl(lease_key) > 10_000  # its ttl restarted for the holder
    assert int(broker.client.get(broker.keys.lease_fence("t", 0, "g"))) == first.lease.token
    assert a.acquire_lease(0, "r2") is None  # another attempt of the holder: refused
    assert a.acquire_lease(0) is None  # no request id: refused
    assert b.acquire_lease(0, "r3") is None  # another member: held
    assert a.acquire_lease(0, "r1", again=True) == first
    assert a.release_lease(first.lease, first.position)
    assert a.acquire_lease(0, "r1", again=True) is None  # again never grants anew
    assert broker.client.get(lease_key) is None
    assert b.acquire_lease(0, "r3") is not None


def test_a_request_counts_one_takeover_however_often_granted(broker: redisq.Broker) -> None:
    """A grant of r1 that expired unanswered, then granted anew to r1: one owner, one count."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a = member(broker, "a")
    lease_key = broker.keys.lease("t", 0, "g")
    assert a.acquire_lease(0, "r0") is not None  # an owner that died holding the message
    broker.client.delete(lease_key)  # its lease ran out
    lost = a.acquire_lease(0, "r1")
    assert lost is not None and lost.takeovers == 1
    broker.client.delete(lease_key)  # r1's grant ran out before its answer came
    regranted = a.acquire_lease(0, "r1")
    assert regranted is not None and regranted.lease.token == lost.lease.token + 1
    assert regranted.takeovers == 1  # not 2: the same attempt
    broker.client.delete(lease_key)
    next_owner = a.acquire_lease(0, "r2")
    assert next_owner is not None and next_owner.takeovers == 2


# -- real faults: the answer lost with the connection ---------------------------------------------
@pytest.fixture(params=["valkey", "redis"])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, Proxy]]:
    server = ServerProcess(binary_for(str(request.param))).start()
    proxy = Proxy(server.port).start()
    yield server, proxy
    proxy.stop()
    server.stop()


class Setup:
    """A topic of five messages on the private server, and a foreign holder of the partition's
    lease, so the consumer keeps trying to acquire it (one attempt at a time, every tick)."""

    def __init__(self, server: ServerProcess, proxy: Proxy, namespace: str) -> None:
        self.proxy = proxy
        self.direct = redisq.connect(server.url, namespace=namespace)
        self.direct.create_topic("t", partitions=1)
        send(self.direct, *VALUES)
        self.client: redis.Redis = self.direct.client
        self.lease = self.direct.keys.lease("t", 0, "g")
        self.fence = self.direct.keys.lease_fence("t", 0, "g")
        self.client.set(self.lease, "1:someone-else:0", px=600_000)
        self.client.set(self.fence, 1)
        # As on a server in use, the scripts are loaded: the held EVALSHA runs (no NOSCRIPT).
        self.direct.scripts.load_all()

    def hold_next_acquire(self) -> None:
        """The consumer's next acquire attempt is held by the network (its connection alone)."""
        self.proxy.trap(self.fence.encode())

    def acquire_held(self) -> bool:
        return self.proxy.holds_for_server(self.fence.encode())

    def lose_the_answer(self) -> str:
        """The foreign lease goes, the held acquire runs on the server and is granted; its
        answer is lost with the connection. Returns the lease value it granted. (The consumer
        is waiting for that answer: no other attempt of its can be under way.)"""
        self.client.delete(self.lease)
        assert self.proxy.lose_answers(self.fence.encode()) == 1
        assert self.proxy.wait_released(10), "the server did not answer the acquire"
        self.proxy.reset_all()
        self.proxy.pass_through()
        granted = self.client.get(self.lease)
        assert granted is not None and granted.startswith(b"2:"), granted
        return granted.decode()

    def tokens(self) -> int:
        return int(self.client.get(self.fence) or 0)

    def close(self) -> None:
        self.direct.close()


@pytest.fixture
def setup(proxied: tuple[ServerProcess, Proxy], namespace: str) -> Iterator[Setup]:
    s = Setup(*proxied, namespace)
    yield s
    s.close()


def test_lost_grant_is_answered_again(setup: Setup, namespace: str) -> None:
    """Before: the acquire was refused (the lease held by its own lost grant) until the lease ran
    out, 30 s of an idle partition. Now the next attempt gets that grant at once."""
    with redisq.connect(setup.proxy.url, namespace=namespace) as via:
        consumer = via.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        granted = setup.lose_the_answer()
        lost_at = time.monotonic()
        got: list[Message] = []
        wait_until(lambda: bool(got.extend(consumer.poll(0.2))) or len(got) == len(VALUES),
                   timeout=RECOVERED_S, what="the messages, before the lease ran out")  # fmt: skip
        assert time.monotonic() - lost_at < TTL_MS / 1000
        assert [m.value for m in got] == VALUES
        assert [m.attempt for m in got] == [1] * len(VALUES)
        assert setup.tokens() == 2  # one grant: the lost one, answered again
        assert setup.client.get(setup.lease).decode() == granted
        consumer.close()
    assert setup.client.get(setup.lease) is None


def test_close_releases_a_lost_grant(setup: Setup, namespace: str) -> None:
    """The consumer closes while its acquire is out: the grant it never saw is released (before:
    it held the partition for 30 s after the close)."""
    with redisq.connect(setup.proxy.url, namespace=namespace) as via:
        consumer = via.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        closer = threading.Thread(target=consumer.close)
        closer.start()
        wait_until(lambda: consumer.ownership.stopping, what="close() under way")
        setup.lose_the_answer()
        closer.join(RECOVERED_S)
        assert not closer.is_alive()
    assert setup.client.get(setup.lease) is None
    assert setup.tokens() == 2
    with setup.direct.consumer("t", "g", **QUIET) as next_owner:  # type: ignore[arg-type]
        got: list[Message] = []
        wait_until(lambda: bool(got.extend(next_owner.poll(0.2))) or len(got) == len(VALUES),
                   timeout=RECOVERED_S, what="the messages at the next owner")  # fmt: skip
    assert [m.attempt for m in got] == [1] * len(VALUES)  # the unseen grant was no attempt


@aio
async def test_asyncio_lost_grant_is_answered_again(setup: Setup, namespace: str) -> None:
    broker = await rq.connect(setup.proxy.url, namespace=namespace)
    consumer = broker.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
    try:
        await consumer.poll(0.05)  # started: the coordinator runs
        setup.hold_next_acquire()
        await async_wait_until(setup.acquire_held, what="the consumer's acquire held")
        granted = setup.lose_the_answer()
        lost_at = time.monotonic()
        got: list[Message] = []
        while len(got) < len(VALUES) and time.monotonic() - lost_at < RECOVERED_S:
            got.extend(await consumer.poll(0.2))
        assert [m.value for m in got] == VALUES, "not consumed before the lease ran out"
        assert [m.attempt for m in got] == [1] * len(VALUES)
        assert setup.tokens() == 2
        assert setup.client.get(setup.lease).decode() == granted
    finally:
        await consumer.close()
        await broker.close()
    assert setup.client.get(setup.lease) is None


@aio
async def test_asyncio_close_releases_a_lost_grant(setup: Setup, namespace: str) -> None:
    broker = await rq.connect(setup.proxy.url, namespace=namespace)
    consumer = broker.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
    try:
        await consumer.poll(0.05)
        setup.hold_next_acquire()
        await async_wait_until(setup.acquire_held, what="the consumer's acquire held")
        setup.lose_the_answer()  # blocks the loop: the coordinator cannot try again before...
        await consumer.close()  # ...close() stops it
    finally:
        await broker.close()
    assert setup.client.get(setup.lease) is None
    assert setup.tokens() == 2
