"""Delayed messages found wanting by an adversarial test: a fenced named producer's delayed
sends, batch sizes, a late copy of a timed-out delayed send. Written once, run through both APIs
(the thread API, and redisq.asyncio behind tests/apis.py's Bridge)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from redisq.errors import DeliveryTimeout, ProducerFenced
from redisq.protocol import ScriptCall
from tests.apis import _unwrap, open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.schedule.test_delayed import read_all
from tests.servers import ServerProcess


def wait_state_expired(broker: redisq.Broker, topic: str, partitions: int) -> None:
    """Until the producers' state on the topic's partitions (producer_state_ttl_ms) expired."""

    def expired() -> bool:
        return not any(
            True
            for p in range(partitions)
            for _ in broker.client.scan_iter(
                match=broker.keys.partition_pattern(topic, p)[:-1] + "pid:*"
            )
        )

    wait_until(expired, timeout=30, what="the producer state on the partitions to expire")


# -- fencing of a named producer's delayed sends ------------------------------------------------


def test_zombie_schedules_once_the_fence_state_expired(api: Any, broker: redisq.Broker) -> None:
    """README: "A fenced instance of a named producer is refused (ProducerFenced), as it is for
    plain sends." The newer instance only sends delayed messages, so nothing renews the epoch
    it stored on the partitions; once that state expires (producer_state_ttl_ms, 24 h by
    default, 1 s here) the zombie's delayed sends were accepted again (the test's name): they
    must stay refused, as its plain sends are (UNKNOWN_PRODUCER -> proof against the name's
    registration)."""
    broker.create_topic("orders", partitions=1, producer_state_ttl_ms=1000)
    old = api.broker.producer(name="svc")
    zombie_error: BaseException | None = None
    try:
        old.send("orders", b"old", key="k", delay_ms=60_000)
        with api.broker.producer(name="svc") as new:
            new.send("orders", b"new", key="k", delay_ms=60_000)
            with pytest.raises(ProducerFenced):  # while the fence state lives
                old.send("orders", b"zombie-1", key="k", delay_ms=60_000)
            wait_state_expired(broker, "orders", 1)
            try:
                old.send("orders", b"zombie-2", key="k", delay_ms=60_000)
            except ProducerFenced as exc:
                zombie_error = exc
            with pytest.raises(ProducerFenced):  # a plain send is still refused
                old.send("orders", b"zombie-plain", key="k")
    finally:
        old.close()
    scheduled = broker.describe_topic("orders").total_scheduled
    assert zombie_error is not None, "the fenced instance's delayed send was acknowledged"
    assert scheduled == 2, f"{scheduled} scheduled: the zombie's message was stored"


def test_a_named_producer_keeps_scheduling_after_its_state_expired(
    api: Any, broker: redisq.Broker
) -> None:
    """The other side of the fence check: the current instance of a name, delayed sends only,
    on a new topic and after its state on the partitions expired, is never refused."""
    broker.create_topic("orders", partitions=2, producer_state_ttl_ms=1000)
    with api.broker.producer(name="svc", retry_backoff_ms=10) as producer:
        first = [producer.send("orders", b"a%d" % i, key=f"k{i}", delay_ms=300) for i in range(4)]
        wait_state_expired(broker, "orders", 2)
        futures = [
            producer.send_async("orders", b"b%d" % i, key=f"k{i}", delay_ms=300) for i in range(4)
        ]
        later = [api.result(f) for f in futures]
        assert not any(m.duplicate for m in first + later)
        wait_until(lambda: len(read_all(broker, "orders")) >= 8, timeout=30, what="delivery")
    assert sorted(m.value for m in read_all(broker, "orders")) == sorted(
        [b"a%d" % i for i in range(4)] + [b"b%d" % i for i in range(4)]
    )
    assert broker.describe_topic("orders").total_scheduled == 0


# -- a late copy of a delayed batch that timed out ----------------------------------------------


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    """The API under test on a server of the test's own (tests/apis.py's open_api)."""
    return str(request.param)


@pytest.fixture
def proxied_api(api_name: str, proxied: tuple[ServerProcess, Proxy]) -> Iterator[Any]:
    """The API under test through the proxy (socket_timeout=1: the broker's connections; the
    delayed sender's own bound their reads by the delivery timeout), in a namespace of its own."""
    _, proxy = proxied
    driver = open_api(api_name, proxy.url, f"advlate{uuid.uuid4().hex[:8]}", socket_timeout=1)
    try:
        yield driver
    finally:
        driver.shutdown()


def test_late_copy_of_a_timed_out_delayed_send_never_lands_after_newer_messages_of_its_key(
    proxied: tuple[ServerProcess, Proxy], proxied_api: Any
) -> None:
    """README, Guarantees: "A message not acknowledged by then fails with DeliveryTimeout ...
    Before anything else is sent, the producer takes a new epoch and stores it on every
    partition where a failed batch went on the wire, so a late copy of it can never land after
    newer messages of its key." With delayed sends the late copy of FIRST (same key, same
    delay_ms as SECOND) was scheduled after SECOND and delivered after it; SECOND's batch now
    marks FIRST's given up before it is stored, and the late copy is refused.
    tests/schedule/test_delayed_silent_network.py does this with the default socket timeout."""
    server, proxy = proxied
    api = proxied_api
    api.broker.create_topic("orders", partitions=1, exist_ok=True)
    direct = redisq.connect(server.url, namespace=api.broker.namespace)
    producer = api.broker.producer(delivery_timeout_ms=1500, retry_backoff_ms=10)
    try:
        producer.send("orders", b"warm", key="k")
        proxy.trap(b"FIRST-MESSAGE")
        with pytest.raises(DeliveryTimeout):
            producer.send("orders", b"FIRST-MESSAGE", key="k", delay_ms=300, timeout=60)
        held = proxy.held_connections()
        assert held, "the first send's bytes are held by the proxy"
        proxy.heal(keep=held)
        second = producer.send("orders", b"SECOND", key="k", delay_ms=300)
        assert not second.duplicate
        # The case under test, not a wait for an outcome: the late copy comes a few ms after
        # SECOND (not in the same ms).
        time.sleep(0.05)
        proxy.release_held()  # the late copy of FIRST arrives now
        assert proxy.wait_released(10)  # and was executed: stored in the schedule, or refused
        # Nothing scheduled (the late copy included, if it was stored) is left to deliver.
        wait_until(
            lambda: (
                direct.describe_topic("orders").total_scheduled == 0
                and len(list(direct.read("orders", 0))) >= 2
            ),
            timeout=30,
            what="delivery",
        )
    finally:
        proxy.heal()
        producer.close(timeout=10)
    values = [m.value for m in direct.read("orders", 0) if m.value != b"warm"]
    direct.close()
    assert values in ([b"SECOND"], [b"FIRST-MESSAGE", b"SECOND"]), (
        f"the late copy of a timed-out delayed send landed after a newer message of its key: "
        f"{values}"
    )


# -- batch size ----------------------------------------------------------------------------------


def test_delayed_batches_respect_max_batch_bytes(
    api: Any, broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: producer option `max_batch_bytes=1 MiB`. Plain batches are sealed at it; delayed
    batches are sealed only at max_batch_messages (500), so 20 messages of 512 KiB go to the
    server as one 10 MiB schedule.lua call (500 of 1 MiB would be one 500 MiB call)."""
    broker.create_topic("orders", partitions=1)
    # The delayed sender writes packed calls to its own connections (the asyncio broker's
    # scripts object itself, not the Bridge in front of it: the patch goes on the object).
    scripts = _unwrap(api.broker.scripts)
    real = scripts.pack
    sizes: list[int] = []

    def pack(step: ScriptCall) -> bytes:  # type: ignore[type-arg]
        if step.script == "schedule":
            sizes.append(sum(len(a) for a in step.args if isinstance(a, bytes)))
        return real(step)

    monkeypatch.setattr(scripts, "pack", pack)
    value = b"x" * (512 * 1024)
    with api.broker.producer(linger_ms=500) as producer:
        producer.send("orders", b"warm", key="k", delay_ms=60_000)
        futures = [
            producer.send_async("orders", value, key="k", delay_ms=60_000) for _ in range(20)
        ]
        producer.flush(60)
        for future in futures:
            api.result(future)
    assert broker.describe_topic("orders").total_scheduled == 21
    biggest = max(sizes)
    assert biggest <= (1 << 20) + 4096, (
        f"one schedule.lua call carried {biggest / 2**20:.1f} MiB with max_batch_bytes=1 MiB "
        f"(calls: {[round(s / 2**20, 1) for s in sizes]})"
    )
