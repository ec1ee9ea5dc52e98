"""Delayed sends on a silent network (thread and asyncio APIs, Valkey and Redis, servers of the
test's own): a delayed send whose answer does not come fails with DeliveryTimeout within about
delivery_timeout_ms, as a plain send does, not after the connection's socket timeout (30 s
here, the default); afterwards a new delayed send works and nothing of the given-up batch is
scheduled later.

Two ways the network goes silent: a proxy that stops forwarding the delayed sender's
connection (its bytes are held and forwarded only after a newer message of the key was
stored: the late copy must be refused), and the server SIGSTOPped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

import redisq
import redisq.asyncio as rq
from redisq.errors import DeliveryTimeout
from tests.aio import aio
from tests.history.proxy import Proxy
from tests.schedule.test_delayed import wait_for
from tests.servers import ServerProcess, binary_for

pytestmark = pytest.mark.fault

DELIVERY_TIMEOUT_MS = 2000
# Well before the 30 s socket timeout, and far above delivery_timeout_ms on a loaded machine.
LIMIT_S = 15.0
TOPIC = "orders"


def _values(direct: redisq.Broker) -> list[bytes]:
    return [m.value for m in direct.read(TOPIC, 0) if not m.value.startswith(b"warm")]


def _all_delivered(direct: redisq.Broker, count: int) -> None:
    """Wait until nothing is scheduled and count messages are in the log, then past any
    further due time of the messages sent (delay 300 ms) and the schedulers' next poll."""
    wait_for(
        lambda: (
            direct.describe_topic(TOPIC).total_scheduled == 0
            and len(list(direct.read(TOPIC, 0))) >= count
        ),
        what="delivery",
    )
    time.sleep(1.0)


def _check_timed_out(error: BaseException | None, elapsed: float) -> None:
    assert isinstance(error, DeliveryTimeout), (
        f"the delayed send on a silent network ended with {error!r} after {elapsed:.1f} s, "
        f"not DeliveryTimeout within {LIMIT_S} s (delivery_timeout_ms={DELIVERY_TIMEOUT_MS})"
    )
    # Not before the batch's deadline (sent at once: about delivery_timeout_ms after the call).
    assert 0.9 * DELIVERY_TIMEOUT_MS / 1000 <= elapsed < LIMIT_S, (
        f"DeliveryTimeout after {elapsed:.1f} s"
    )


def _send_first_times_out(producer: redisq.Producer) -> None:
    """The delayed send on the silent network ends with DeliveryTimeout, in time."""
    started = time.monotonic()
    error: BaseException | None = None
    try:
        producer.send(TOPIC, b"FIRST-MESSAGE", key="k", delay_ms=300, timeout=LIMIT_S)
    except Exception as exc:
        error = exc
    _check_timed_out(error, time.monotonic() - started)


# -- a proxy that stops forwarding the delayed sender's connection ------------------------------


def test_proxy_silent_delayed_send_times_out_and_its_late_copy_is_refused(
    proxied: tuple[ServerProcess, Proxy],
) -> None:
    server, proxy = proxied
    broker = redisq.connect(proxy.url, namespace="silent")  # socket_timeout: 30 s (default)
    broker.create_topic(TOPIC, partitions=1, exist_ok=True)
    direct = redisq.connect(server.url, namespace="silent")
    producer = broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
    try:
        producer.send(TOPIC, b"warm", key="k", delay_ms=300)  # the delayed connection is open
        proxy.trap(b"FIRST-MESSAGE")  # that connection goes silent from this send on
        _send_first_times_out(producer)
        held = proxy.held_connections()
        assert held, "the proxy holds the given-up batch's bytes"
        proxy.heal(keep=held)  # the network is back, but the late copy is still on its way
        second = producer.send(TOPIC, b"SECOND", key="k", delay_ms=300, timeout=LIMIT_S)
        assert not second.duplicate
        proxy.release_held()  # the late copy of FIRST arrives now, after SECOND was stored
        assert proxy.wait_released(10)
        _all_delivered(direct, 2)
    finally:
        proxy.heal()
        producer.close(timeout=10)
        broker.close()
    values = _values(direct)
    scheduled = direct.describe_topic(TOPIC).total_scheduled
    direct.close()
    assert values == [b"SECOND"], f"the given-up batch's late copy was delivered: {values}"
    assert scheduled == 0, f"{scheduled} still scheduled"


@aio
async def test_proxy_silent_delayed_send_times_out_and_its_late_copy_is_refused_asyncio(
    proxied: tuple[ServerProcess, Proxy],
) -> None:
    server, proxy = proxied
    broker = await rq.connect(proxy.url, namespace="silenta")
    await broker.create_topic(TOPIC, partitions=1, exist_ok=True)
    direct = redisq.connect(server.url, namespace="silenta")
    producer = broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
    await producer.start()
    try:
        await producer.send(TOPIC, b"warm", key="k", delay_ms=300)
        proxy.trap(b"FIRST-MESSAGE")
        started = time.monotonic()
        error: BaseException | None = None
        future = producer.send_async(TOPIC, b"FIRST-MESSAGE", key="k", delay_ms=300)
        try:
            await asyncio.wait_for(future, LIMIT_S)
        except Exception as exc:
            error = exc
        _check_timed_out(error, time.monotonic() - started)
        held = proxy.held_connections()
        assert held, "the proxy holds the given-up batch's bytes"
        proxy.heal(keep=held)
        second = await asyncio.wait_for(
            producer.send(TOPIC, b"SECOND", key="k", delay_ms=300), LIMIT_S
        )
        assert not second.duplicate
        proxy.release_held()
        assert proxy.wait_released(10)
        await asyncio.to_thread(_all_delivered, direct, 2)
    finally:
        proxy.heal()
        try:
            await asyncio.wait_for(producer.close(), 20)
        finally:
            await broker.close()
    values = _values(direct)
    scheduled = direct.describe_topic(TOPIC).total_scheduled
    direct.close()
    assert values == [b"SECOND"], f"the given-up batch's late copy was delivered: {values}"
    assert scheduled == 0, f"{scheduled} still scheduled"


# -- the server SIGSTOPped ------------------------------------------------------------------------


@pytest.fixture(params=["valkey", "redis"])
def stoppable(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A private server of each kind, continued (SIGCONT) and stopped afterwards."""
    server = ServerProcess(binary_for(str(request.param))).start()
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()


def _check_order(direct: redisq.Broker) -> None:
    """The given-up batch was stored before SECOND (its copy ran when the server continued) or
    not at all: never after it."""
    values = _values(direct)
    assert values in ([b"SECOND"], [b"FIRST-MESSAGE", b"SECOND"]), values


def test_sigstop_delayed_send_times_out(stoppable: ServerProcess) -> None:
    server = stoppable
    broker = redisq.connect(server.url, namespace="stopped")
    broker.create_topic(TOPIC, partitions=1, exist_ok=True)
    producer = broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
    try:
        producer.send(TOPIC, b"warm", key="k", delay_ms=300)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            _send_first_times_out(producer)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        second = producer.send(TOPIC, b"SECOND", key="k", delay_ms=300, timeout=LIMIT_S)
        assert not second.duplicate
        with redisq.connect(server.url, namespace="stopped") as direct:
            _all_delivered(direct, 2)
            _check_order(direct)
    finally:
        producer.close(timeout=10)
        broker.close()


@aio
async def test_sigstop_delayed_send_times_out_asyncio(stoppable: ServerProcess) -> None:
    server = stoppable
    broker = await rq.connect(server.url, namespace="stoppeda")
    await broker.create_topic(TOPIC, partitions=1, exist_ok=True)
    producer = broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
    await producer.start()
    try:
        await producer.send(TOPIC, b"warm", key="k", delay_ms=300)
        os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        error: BaseException | None = None
        try:
            await asyncio.wait_for(
                producer.send(TOPIC, b"FIRST-MESSAGE", key="k", delay_ms=300), LIMIT_S
            )
        except Exception as exc:
            error = exc
        finally:
            os.kill(server.pid, signal.SIGCONT)
        _check_timed_out(error, time.monotonic() - started)
        second = await asyncio.wait_for(
            producer.send(TOPIC, b"SECOND", key="k", delay_ms=300), LIMIT_S
        )
        assert not second.duplicate
        with redisq.connect(server.url, namespace="stoppeda") as direct:
            await asyncio.to_thread(_all_delivered, direct, 2)
            _check_order(direct)
    finally:
        try:
            await asyncio.wait_for(producer.close(), 20)
        finally:
            await broker.close()
