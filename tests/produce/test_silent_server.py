"""A server that stops answering (SIGSTOP), Valkey and Redis, servers of the test's own: sends
keep their delivery timeout, and close(timeout=...) its timeout. Sends and close() are written
once and run through both APIs (tests/apis.py; a local `api` fixture on that server); the
producer's scheduler at close and close() from on_revoke, on the thread API.

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
from redisq.errors import DeliveryTimeout, ProducerClosed
from tests.apis import open_api
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


@pytest.fixture(params=["sync", "async"])
def api(
    request: pytest.FixtureRequest, server: ServerProcess, broker: redisq.Broker
) -> Iterator[Any]:
    """Both APIs (tests/apis.py) on the test's own server, in the `broker` fixture's namespace."""
    driver = open_api(str(request.param), server.url, broker.namespace)
    try:
        yield driver
    finally:
        driver.shutdown()


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


async def within(future: Any, seconds: float) -> Any:
    return await asyncio.wait_for(asyncio.shield(future), seconds)


def outcome(api: Any, future: Any) -> BaseException | None:
    """What a send's future (either API's) ended with within DELIVERY_LIMIT_S (None:
    acknowledged; a TimeoutError: still pending then)."""
    try:
        if api.name == "async":
            api.broker.await_(within(future, DELIVERY_LIMIT_S))
        else:
            future.result(timeout=DELIVERY_LIMIT_S)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_sends_after_a_delivery_timeout_fail_in_time(
    api: Any, server: ServerProcess, delayed: bool
) -> None:
    topic = DELAYED if delayed else TOPIC
    producer = api.broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS)
    producer.send(topic, b"warm", key=b"k", timeout=10, **delay_of(delayed))
    with silent(server):
        for i in range(3):  # the first fails; a new epoch is pending for the others
            started = time.monotonic()
            future = producer.send_async(topic, b"x%d" % i, key=b"k", **delay_of(delayed))
            check_delivery_timeout(outcome(api, future), time.monotonic() - started)
    after = producer.send(topic, b"after", key=b"k", timeout=30, **delay_of(delayed))
    assert not after.duplicate
    producer.close(timeout=10)


# -- producers: close ----------------------------------------------------------------------------


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_producer_close_on_silent_server(api: Any, server: ServerProcess, delayed: bool) -> None:
    topic = DELAYED if delayed else TOPIC
    producer = api.broker.producer(delivery_timeout_ms=60_000)
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
    api: Any, server: ServerProcess, broker: redisq.Broker, mode: str
) -> None:
    sent = produce_ten(broker)
    consumer = api.broker.consumer(TOPIC, "g", mode=mode, **FAST)
    handled: set[bytes] = set()
    wait_until(
        lambda: handled.update(m.value for m in consumer.poll(timeout=0.2)) or handled,
        timeout=30,
        what="a first poll",
    )
    with silent(server):
        started = time.monotonic()
        consumer.close(timeout=TIMEOUT_S)
        check_closed_in_time(started)
    # Nothing lost: what the closed member did not commit comes to the next one.
    assert sent <= handled | drain(broker, "g", mode, sent - handled)


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


@pytest.fixture(params=["sync", "async"])
def cluster_api(request: pytest.FixtureRequest, cluster: list[ServerProcess]) -> Iterator[Any]:
    """Both APIs (tests/apis.py) on the cluster, namespace "sn"."""
    driver = open_api(str(request.param), f"redis://127.0.0.1:{cluster[0].port}", "sn")
    try:
        yield driver
    finally:
        driver.shutdown()


def stopped_node_partition(broker: Any, node: ServerProcess) -> int:
    partitions = broker.describe_topic(TOPIC).partitions
    return next(p.partition for p in partitions if p.node == f"127.0.0.1:{node.port}")


@pytest.mark.cluster
def test_send_to_a_silent_cluster_node_fails_in_time(
    cluster: list[ServerProcess], cluster_api: Any
) -> None:
    """After a connection error the slot map is read again; when the node asked first is the
    silent one that read waits for the client's socket timeout (30 s), and the sender used to
    wait with it: a send to the silent node failed after 32 s with delivery_timeout_ms=1500."""
    api = cluster_api
    api.broker.create_topic(TOPIC, partitions=6)
    partition = stopped_node_partition(api.broker, cluster[0])
    with api.broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS) as producer:
        producer.send(TOPIC, b"warm", partition=partition, timeout=10)
        with silent(cluster[0]):
            for i in range(2):
                started = time.monotonic()
                future = producer.send_async(TOPIC, b"x%d" % i, partition=partition)
                check_delivery_timeout(outcome(api, future), time.monotonic() - started)
        assert not producer.send(TOPIC, b"after", partition=partition, timeout=30).duplicate
