"""A server that stops answering (SIGSTOP), thread and asyncio APIs, Valkey and Redis, servers
of the test's own: sends keep their delivery timeout, and close(timeout=...) its timeout.

After a send fails with DeliveryTimeout the producer takes a new epoch and fences it before it
sends again; while the server is silent that round trip waits for the client's socket timeout
(30 s), and the sends made meanwhile must still fail at their own delivery timeout, not stay
pending until the server answers.

What a user checks of close(): it returns within about its timeout (not after a socket timeout of
30 s or a delivery timeout of a minute); a send that was not acknowledged by then fails with
ProducerClosed at once (stored or not: unknown), never left pending; a consumer closed this way
loses nothing: once the server answers again, a new member of the group gets every message that
was not committed (at least once), the leases not handed back having run out.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from redisq.errors import DeliveryTimeout, ProducerClosed
from tests.aio import aio
from tests.conftest import wait_until
from tests.servers import ServerProcess, binary_for, start_cluster

pytestmark = pytest.mark.fault

TIMEOUT_S = 0.5
# close(timeout=0.5) took 5 to 90 s here before it was bounded; the margin is for a loaded host.
LIMIT_S = 3.0
TOPIC, DELAYED = "orders", "later"
FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    server = ServerProcess(binary_for(request.param)).start()
    yield server
    server.kill(signal.SIGCONT)
    server.stop()


@pytest.fixture
def broker(server: ServerProcess) -> Iterator[redisq.Broker]:
    broker = redisq.connect(server.url, namespace=f"cs{uuid.uuid4().hex[:8]}")
    broker.create_topic(TOPIC, partitions=2)
    broker.create_topic(DELAYED, partitions=2)
    yield broker
    broker.close()


@contextmanager
def silent(server: ServerProcess) -> Iterator[None]:
    server.kill(signal.SIGSTOP)
    try:
        yield
    finally:
        server.kill(signal.SIGCONT)


def check_closed_in_time(started: float) -> None:
    elapsed = time.monotonic() - started
    assert elapsed < LIMIT_S, f"close(timeout={TIMEOUT_S}) took {elapsed:.1f} s"


def check_failed_closed(future: Any) -> None:
    assert future.done(), "a send left pending after close()"
    assert isinstance(future.exception(), ProducerClosed), future.exception()


def delay_of(delayed: bool) -> dict[str, Any]:
    return {"delay_ms": 200} if delayed else {}


# -- delivery timeouts ---------------------------------------------------------------------------

DELIVERY_TIMEOUT_MS = 1500
# A send fails at its delivery timeout, not after the socket timeout (30 s); margin for load.
DELIVERY_LIMIT_S = 6.0


def check_delivery_timeout(error: BaseException | None, elapsed: float) -> None:
    assert isinstance(error, DeliveryTimeout), f"{error!r} after {elapsed:.1f} s"
    assert DELIVERY_TIMEOUT_MS / 1000 * 0.9 <= elapsed < DELIVERY_LIMIT_S, f"after {elapsed:.1f} s"


def outcome(future: Any) -> BaseException | None:
    """What a send's future ended with within DELIVERY_LIMIT_S (None: acknowledged)."""
    try:
        future.result(timeout=DELIVERY_LIMIT_S)
    except Exception as exc:
        return exc
    return None


async def async_producer(
    url: str, namespace: str, topic: str, delayed: bool, delivery_timeout_ms: int
) -> tuple[Any, Any]:
    """An asyncio client and producer whose first send (to topic) was acknowledged."""
    client = await rq.connect(url, namespace=namespace)
    producer = client.producer(delivery_timeout_ms=delivery_timeout_ms)
    await producer.send(topic, b"warm", key=b"k", timeout=10, **delay_of(delayed))
    return client, producer


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_sends_after_a_delivery_timeout_fail_in_time(
    server: ServerProcess, broker: redisq.Broker, delayed: bool
) -> None:
    topic = DELAYED if delayed else TOPIC
    producer = broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS)
    producer.send(topic, b"warm", key=b"k", timeout=10, **delay_of(delayed))
    with silent(server):
        for i in range(3):  # the first fails; a new epoch is pending for the others
            started = time.monotonic()
            future = producer.send_async(topic, b"x%d" % i, key=b"k", **delay_of(delayed))
            check_delivery_timeout(outcome(future), time.monotonic() - started)
    after = producer.send(topic, b"after", key=b"k", timeout=30, **delay_of(delayed))
    assert not after.duplicate
    producer.close(timeout=10)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@aio
async def test_async_sends_after_a_delivery_timeout_fail_in_time(
    server: ServerProcess, broker: redisq.Broker, delayed: bool
) -> None:
    topic = DELAYED if delayed else TOPIC
    client, producer = await async_producer(
        server.url, broker.namespace, topic, delayed, DELIVERY_TIMEOUT_MS
    )
    with silent(server):
        for i in range(3):
            started = time.monotonic()
            future = producer.send_async(topic, b"x%d" % i, key=b"k", **delay_of(delayed))
            done, _ = await asyncio.wait({future}, timeout=DELIVERY_LIMIT_S)
            error = future.exception() if done else None
            check_delivery_timeout(error, time.monotonic() - started)
    after = await producer.send(topic, b"after", key=b"k", timeout=30, **delay_of(delayed))
    assert not after.duplicate
    await producer.close(timeout=10)
    await client.close()


# -- producers: close ----------------------------------------------------------------------------


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_producer_close_on_silent_server(
    server: ServerProcess, broker: redisq.Broker, delayed: bool
) -> None:
    topic = DELAYED if delayed else TOPIC
    producer = broker.producer(delivery_timeout_ms=60_000)
    producer.send(topic, b"warm", key=b"k", timeout=10, **delay_of(delayed))
    with silent(server):
        future = producer.send_async(topic, b"late", key=b"k", **delay_of(delayed))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="unacknowledged"):
            producer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)
        check_failed_closed(future)


def test_producer_close_with_idle_scheduler_on_silent_server(
    server: ServerProcess, broker: redisq.Broker
) -> None:
    """The delayed sends' scheduler hands its leases back at close: bounded too."""
    producer = broker.producer(delivery_timeout_ms=60_000)
    producer.send(DELAYED, b"due", key=b"k", timeout=10, delay_ms=100)
    wait_until(
        lambda: any(m.value == b"due" for p in (0, 1) for m in broker.read(DELAYED, p)),
        timeout=20,
        what="the delayed message delivered",
    )
    with silent(server):
        started = time.monotonic()
        producer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@aio
async def test_async_producer_close_on_silent_server(
    server: ServerProcess, broker: redisq.Broker, delayed: bool
) -> None:
    topic = DELAYED if delayed else TOPIC
    client, producer = await async_producer(server.url, broker.namespace, topic, delayed, 60_000)
    with silent(server):
        future = producer.send_async(topic, b"late", key=b"k", **delay_of(delayed))
        await asyncio.sleep(0.1)  # on the wire
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="unacknowledged"):
            await producer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)
        check_failed_closed(future)
    await client.close()


# -- consumers -----------------------------------------------------------------------------------


def produce_ten(broker: redisq.Broker) -> set[bytes]:
    with broker.producer() as producer:
        for i in range(10):
            producer.send(TOPIC, b"m%d" % i, key=b"k%d" % i)
    return {b"m%d" % i for i in range(10)}


def drain(broker: redisq.Broker, group: str, mode: str, wanted: set[bytes]) -> set[bytes]:
    """A new member of the group, after the server answers again: what it handles until every
    wanted message was handled by it or is committed (it stops at wanted or after 30 s)."""
    seen: set[bytes] = set()
    with broker.consumer(TOPIC, group, mode=mode, **FAST) as consumer:
        deadline = time.monotonic() + 30
        while not wanted <= seen and time.monotonic() < deadline:
            messages = consumer.poll(timeout=0.5)
            seen |= {m.value for m in messages}
            if messages:
                consumer.ack(messages)
    return seen


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
def test_consumer_close_on_silent_server(
    server: ServerProcess, broker: redisq.Broker, mode: str
) -> None:
    sent = produce_ten(broker)
    consumer = broker.consumer(TOPIC, "g", mode=mode, **FAST)
    handled: set[bytes] = set()
    wait_until(lambda: handled.update(m.value for m in consumer.poll(timeout=0.2)) or handled)
    with silent(server):
        started = time.monotonic()
        consumer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)
    # Nothing lost: what the closed member did not commit comes to the next one.
    assert sent <= handled | drain(broker, "g", mode, sent - handled)


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
@aio
async def test_async_consumer_close_on_silent_server(
    server: ServerProcess, broker: redisq.Broker, mode: str
) -> None:
    sent = produce_ten(broker)
    client = await rq.connect(server.url, namespace=broker.namespace)
    consumer = client.consumer(TOPIC, "g", mode=mode, **FAST)
    await consumer.__aenter__()
    handled: set[bytes] = set()
    deadline = time.monotonic() + 30
    while not handled and time.monotonic() < deadline:
        handled |= {m.value for m in await consumer.poll(timeout=0.2)}
    assert handled
    with silent(server):
        started = time.monotonic()
        await consumer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)
    wanted = sent - handled
    assert sent <= handled | await asyncio.to_thread(drain, broker, "g", mode, wanted)
    await client.close()


# -- close() from on_revoke ----------------------------------------------------------------------


def test_close_from_on_revoke_during_close_returns(
    server: ServerProcess, broker: redisq.Broker
) -> None:
    """close() hands the partitions back and calls on_revoke; an on_revoke that calls close()
    (to be sure the consumer stops) must not wait for the close it runs in."""
    produce_ten(broker)
    revoked: list[Any] = []

    def on_revoke(partitions: list[tuple[str, int]]) -> None:
        revoked.append(partitions)
        consumer.close()

    consumer = broker.consumer(TOPIC, "g", on_revoke=on_revoke, **FAST)
    wait_until(lambda: consumer.poll(timeout=0.2) or consumer.assignment, what="an assignment")
    closing = threading.Thread(target=consumer.close, daemon=True)
    closing.start()
    closing.join(20)
    assert not closing.is_alive(), "close() waits for itself"
    assert revoked


# -- a cluster node stops answering --------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[list[ServerProcess]]:
    nodes = start_cluster(None, masters=3)
    yield nodes
    for node in nodes:
        node.kill(signal.SIGCONT)
        node.stop()


def stopped_node_partition(broker: redisq.Broker, node: ServerProcess) -> int:
    partitions = broker.describe_topic(TOPIC).partitions
    return next(p.partition for p in partitions if p.node == f"127.0.0.1:{node.port}")


@pytest.mark.cluster
def test_send_to_a_silent_cluster_node_fails_in_time(cluster: list[ServerProcess]) -> None:
    """After a connection error the slot map is read again; when the node asked first is the
    silent one that read waits for the client's socket timeout (30 s), and the sender used to
    wait with it: a send to the silent node failed after 32 s with delivery_timeout_ms=1500."""
    broker = redisq.connect(f"redis://127.0.0.1:{cluster[0].port}", namespace="sn")
    broker.create_topic(TOPIC, partitions=6)
    partition = stopped_node_partition(broker, cluster[0])
    with broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS) as producer:
        producer.send(TOPIC, b"warm", partition=partition, timeout=10)
        with silent(cluster[0]):
            for i in range(2):
                started = time.monotonic()
                future = producer.send_async(TOPIC, b"x%d" % i, partition=partition)
                check_delivery_timeout(outcome(future), time.monotonic() - started)
        assert not producer.send(TOPIC, b"after", partition=partition, timeout=30).duplicate
    broker.close()


@pytest.mark.cluster
@aio
async def test_async_send_to_a_silent_cluster_node_fails_in_time(
    cluster: list[ServerProcess],
) -> None:
    url = f"redis://127.0.0.1:{cluster[0].port}"
    sync = redisq.connect(url, namespace="sn")
    sync.create_topic(TOPIC, partitions=6)
    partition = stopped_node_partition(sync, cluster[0])
    sync.close()
    client = await rq.connect(url, namespace="sn")
    producer = client.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS)
    await producer.send(TOPIC, b"warm", partition=partition, timeout=10)
    with silent(cluster[0]):
        for i in range(2):
            started = time.monotonic()
            future = producer.send_async(TOPIC, b"x%d" % i, partition=partition)
            done, _ = await asyncio.wait({future}, timeout=DELIVERY_LIMIT_S)
            check_delivery_timeout(future.exception() if done else None, time.monotonic() - started)
    assert not (await producer.send(TOPIC, b"after", partition=partition, timeout=30)).duplicate
    await producer.close(timeout=10)
    await client.close()
