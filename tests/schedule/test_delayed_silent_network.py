"""Delayed sends on a silent network (Valkey and Redis, servers of the test's own; written once,
run through both APIs: the thread API, and redisq.asyncio behind tests/apis.py's Bridge): a
delayed send whose answer does not come fails with DeliveryTimeout within about
delivery_timeout_ms, as a plain send does, not after the connection's socket timeout (30 s
here, the default); afterwards a new delayed send works and nothing of the given-up batch is
scheduled later.

Two ways the network goes silent: a proxy that stops forwarding the delayed sender's
connection (its bytes are held and forwarded only after a newer message of the key was
stored: the late copy must be refused), and the server SIGSTOPped."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from redisq.errors import DeliveryTimeout
from tests.apis import open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess, binary_for

pytestmark = pytest.mark.fault

DELIVERY_TIMEOUT_MS = 2000
# Well before the 30 s socket timeout, and far above delivery_timeout_ms on a loaded machine.
LIMIT_S = 15.0
TOPIC = "orders"


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    """The API under test, opened by each test on its own server (tests/apis.py's open_api)."""
    return str(request.param)


def _values(direct: redisq.Broker) -> list[bytes]:
    return [m.value for m in direct.read(TOPIC, 0) if not m.value.startswith(b"warm")]


def _all_delivered(direct: redisq.Broker, count: int) -> None:
    """Until nothing is scheduled and count messages are in the log. Called once the given-up
    batch's copy was executed by the server (stored in the schedule, or refused): then nothing
    more is to come."""
    wait_until(
        lambda: (
            direct.describe_topic(TOPIC).total_scheduled == 0
            and len(list(direct.read(TOPIC, 0))) >= count
        ),
        timeout=30,
        what="delivery",
    )


def _send_first_times_out(producer: Any) -> None:
    """The delayed send on the silent network ends with DeliveryTimeout, in time: not before
    the batch's deadline (sent at once: about delivery_timeout_ms after the call)."""
    started = time.monotonic()
    error: BaseException | None = None
    try:
        producer.send(TOPIC, b"FIRST-MESSAGE", key="k", delay_ms=300, timeout=LIMIT_S)
    except Exception as exc:
        error = exc
    elapsed = time.monotonic() - started
    assert isinstance(error, DeliveryTimeout), (
        f"the delayed send on a silent network ended with {error!r} after {elapsed:.1f} s, "
        f"not DeliveryTimeout within {LIMIT_S} s (delivery_timeout_ms={DELIVERY_TIMEOUT_MS})"
    )
    assert 0.9 * DELIVERY_TIMEOUT_MS / 1000 <= elapsed < LIMIT_S, (
        f"DeliveryTimeout after {elapsed:.1f} s"
    )


# -- a proxy that stops forwarding the delayed sender's connection ------------------------------


def test_proxy_silent_delayed_send_times_out_and_its_late_copy_is_refused(
    api_name: str, proxied: tuple[ServerProcess, Proxy]
) -> None:
    server, proxy = proxied
    namespace = f"silent{uuid.uuid4().hex[:8]}"
    api = open_api(api_name, proxy.url, namespace)  # socket_timeout: 30 s (default)
    direct = redisq.connect(server.url, namespace=namespace)
    try:
        api.broker.create_topic(TOPIC, partitions=1, exist_ok=True)
        producer = api.broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
        try:
            producer.send(TOPIC, b"warm", key="k", delay_ms=300)  # the delayed connection opens
            proxy.trap(b"FIRST-MESSAGE")  # that connection goes silent from this send on
            _send_first_times_out(producer)
            held = proxy.held_connections()
            assert held, "the proxy holds the given-up batch's bytes"
            proxy.heal(keep=held)  # the network is back, but the late copy is still on its way
            second = producer.send(TOPIC, b"SECOND", key="k", delay_ms=300, timeout=LIMIT_S)
            assert not second.duplicate
            proxy.release_held()  # the late copy of FIRST arrives now, after SECOND was stored
            assert proxy.wait_released(10)  # and was executed: stored in the schedule or refused
            _all_delivered(direct, 2)
        finally:
            proxy.heal()
            producer.close(timeout=10)
    finally:
        api.shutdown()
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


def test_sigstop_delayed_send_times_out(api_name: str, stoppable: ServerProcess) -> None:
    """The given-up batch was stored before SECOND (its copy, in the server's socket when it
    stopped, ran when it continued, before SECOND came) or not at all: never after it."""
    server = stoppable
    namespace = f"stopped{uuid.uuid4().hex[:8]}"
    api = open_api(api_name, server.url, namespace)
    try:
        api.broker.create_topic(TOPIC, partitions=1, exist_ok=True)
        producer = api.broker.producer(delivery_timeout_ms=DELIVERY_TIMEOUT_MS, retry_backoff_ms=10)
        try:
            producer.send(TOPIC, b"warm", key="k", delay_ms=300)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                _send_first_times_out(producer)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            second = producer.send(TOPIC, b"SECOND", key="k", delay_ms=300, timeout=LIMIT_S)
            assert not second.duplicate
            with redisq.connect(server.url, namespace=namespace) as direct:
                _all_delivered(direct, 2)
                values = _values(direct)
        finally:
            producer.close(timeout=10)
    finally:
        api.shutdown()
    assert values in ([b"SECOND"], [b"FIRST-MESSAGE", b"SECOND"]), values
