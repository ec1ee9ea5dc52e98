"""Delayed messages found wanting by an adversarial test (thread and asyncio APIs): a fenced
named producer's delayed sends, batch sizes, a late copy of a timed-out delayed send."""

from __future__ import annotations

import asyncio
import time

import pytest

import redisq
import redisq.asyncio as rq
from redisq.errors import DeliveryTimeout, ProducerFenced
from tests.aio import aio
from tests.history.proxy import Proxy
from tests.schedule.test_delayed import read_all, wait_for
from tests.servers import ServerProcess

# -- fencing of a named producer's delayed sends ------------------------------------------------


def test_zombie_schedules_once_the_fence_state_expired(broker: redisq.Broker) -> None:
    """README: "A fenced instance of a named producer is refused (ProducerFenced), as it is for
    plain sends." The newer instance only sends delayed messages, so nothing renews the epoch
    it stored on the partitions; once that state expires (producer_state_ttl_ms, 24 h by
    default, 1 s here) the zombie's delayed sends are accepted again, while its plain sends are
    still refused (UNKNOWN_PRODUCER -> proof against the name's registration)."""
    broker.create_topic("orders", partitions=1, producer_state_ttl_ms=1000)
    old = broker.producer(name="svc")
    try:
        old.send("orders", b"old", key="k", delay_ms=60_000)
        with broker.producer(name="svc") as new:
            new.send("orders", b"new", key="k", delay_ms=60_000)
            with pytest.raises(ProducerFenced):  # while the fence state lives
                old.send("orders", b"zombie-1", key="k", delay_ms=60_000)
            time.sleep(1.5)  # the fence state on the partition expires
            zombie_error: BaseException | None = None
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


@aio
async def test_zombie_schedules_once_the_fence_state_expired_asyncio(
    broker: redisq.Broker, server_url: str
) -> None:
    broker.create_topic("orders", partitions=1, producer_state_ttl_ms=1000)
    abroker = await rq.connect(server_url, namespace=broker.namespace)
    old = abroker.producer(name="svc")
    await old.start()
    zombie_error: BaseException | None = None
    try:
        await old.send("orders", b"old", key="k", delay_ms=60_000)
        async with abroker.producer(name="svc") as new:
            await new.send("orders", b"new", key="k", delay_ms=60_000)
            with pytest.raises(ProducerFenced):
                await old.send("orders", b"zombie-1", key="k", delay_ms=60_000)
            await asyncio.sleep(1.5)
            try:
                await old.send("orders", b"zombie-2", key="k", delay_ms=60_000)
            except ProducerFenced as exc:
                zombie_error = exc
    finally:
        try:
            await old.close()
        except Exception:
            pass
        await abroker.close()
    scheduled = broker.describe_topic("orders").total_scheduled
    assert zombie_error is not None, "the fenced instance's delayed send was acknowledged"
    assert scheduled == 2, f"{scheduled} scheduled: the zombie's message was stored"


# -- a late copy of a delayed batch that timed out ----------------------------------------------


def test_late_copy_of_a_timed_out_delayed_send_never_lands_after_newer_messages_of_its_key(
    proxied: tuple[ServerProcess, Proxy],
) -> None:
    """README, Guarantees: "A message not acknowledged by then fails with DeliveryTimeout ...
    Before anything else is sent, the producer takes a new epoch and stores it on every
    partition where a failed batch went on the wire, so a late copy of it can never land after
    newer messages of its key." With delayed sends the late copy of FIRST (same key, same
    delay_ms as SECOND) was scheduled after SECOND and delivered after it; SECOND's batch now
    marks FIRST's given up before it is stored, and the late copy is refused."""
    server, proxy = proxied
    # socket_timeout=1 (the broker's connections; the delayed sender's own bound their reads by
    # the delivery timeout): tests/schedule/test_delayed_silent_network.py does this with the
    # default 30 s.
    broker = redisq.connect(proxy.url, namespace="advlate", socket_timeout=1)
    broker.create_topic("orders", partitions=1, exist_ok=True)
    direct = redisq.connect(server.url, namespace="advlate")
    producer = broker.producer(delivery_timeout_ms=1500, retry_backoff_ms=10)
    try:
        producer.send("orders", b"warm", key="k")
        proxy.trap(b"FIRST-MESSAGE")
        with pytest.raises(DeliveryTimeout):
            producer.send("orders", b"FIRST-MESSAGE", key="k", delay_ms=300)
        held = proxy.held_connections()
        assert held, "the first send's bytes are held by the proxy"
        proxy.heal(keep=held)
        second = producer.send("orders", b"SECOND", key="k", delay_ms=300)
        assert not second.duplicate
        time.sleep(0.05)  # the late copy comes a few ms after SECOND (not in the same ms)
        proxy.release_held()  # the late copy of FIRST arrives now
        assert proxy.wait_released(10)
        wait_for(
            lambda: (
                direct.describe_topic("orders").total_scheduled == 0
                and len(list(direct.read("orders", 0))) >= 2
            ),
            what="delivery",
        )
        time.sleep(0.5)
    finally:
        proxy.heal()
        producer.close(timeout=10)
        broker.close()
    values = [m.value for m in direct.read("orders", 0) if m.value != b"warm"]
    direct.close()
    assert values in ([b"SECOND"], [b"FIRST-MESSAGE", b"SECOND"]), (
        f"the late copy of a timed-out delayed send landed after a newer message of its key: "
        f"{values}"
    )


@aio
async def test_late_copy_of_a_timed_out_delayed_send_asyncio(
    proxied: tuple[ServerProcess, Proxy],
) -> None:
    """The asyncio API: same as the thread test above."""
    server, proxy = proxied
    broker = await rq.connect(proxy.url, namespace="advlatea", socket_timeout=1)
    await broker.create_topic("orders", partitions=1, exist_ok=True)
    direct = redisq.connect(server.url, namespace="advlatea")
    producer = broker.producer(delivery_timeout_ms=1500, retry_backoff_ms=10)
    await producer.start()
    try:
        await producer.send("orders", b"warm", key="k")
        proxy.trap(b"FIRST-MESSAGE")
        with pytest.raises(DeliveryTimeout):
            await asyncio.wait_for(
                producer.send("orders", b"FIRST-MESSAGE", key="k", delay_ms=300), 60
            )
        held = proxy.held_connections()
        assert held, "the first send's bytes are held by the proxy"
        proxy.heal(keep=held)
        second = await producer.send("orders", b"SECOND", key="k", delay_ms=300)
        assert not second.duplicate
        await asyncio.sleep(0.05)
        proxy.release_held()
        assert proxy.wait_released(10)
        for _ in range(500):
            if (
                direct.describe_topic("orders").total_scheduled == 0
                and len(list(direct.read("orders", 0))) >= 3
            ):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
    finally:
        proxy.heal()
        try:
            await asyncio.wait_for(producer.close(), 20)
        except Exception:
            pass
        await broker.close()
    values = [m.value for m in direct.read("orders", 0) if m.value != b"warm"]
    direct.close()
    assert values in ([b"SECOND"], [b"FIRST-MESSAGE", b"SECOND"]), (
        f"the late copy of a timed-out delayed send landed after a newer message of its key: "
        f"{values}"
    )


def test_a_named_producer_keeps_scheduling_after_its_state_expired(broker: redisq.Broker) -> None:
    """The other side of the fence check: the current instance of a name, delayed sends only,
    on a new topic and after its state on the partitions expired, is never refused."""
    broker.create_topic("orders", partitions=2, producer_state_ttl_ms=1000)
    with broker.producer(name="svc", retry_backoff_ms=10) as producer:
        first = [producer.send("orders", b"a%d" % i, key=f"k{i}", delay_ms=300) for i in range(4)]
        time.sleep(1.5)
        later = [producer.send("orders", b"b%d" % i, key=f"k{i}", delay_ms=300) for i in range(4)]
        assert not any(m.duplicate for m in first + later)
        wait_for(lambda: len(read_all(broker, "orders")) == 8, what="delivery")
    assert sorted(m.value for m in read_all(broker, "orders")) == sorted(
        [b"a%d" % i for i in range(4)] + [b"b%d" % i for i in range(4)]
    )


@aio
async def test_a_named_producer_keeps_scheduling_after_its_state_expired_asyncio(
    broker: redisq.Broker, server_url: str
) -> None:
    broker.create_topic("orders", partitions=2, producer_state_ttl_ms=1000)
    abroker = await rq.connect(server_url, namespace=broker.namespace)
    try:
        async with abroker.producer(name="svc", retry_backoff_ms=10) as producer:
            first = [
                await producer.send("orders", b"a%d" % i, key=f"k{i}", delay_ms=300)
                for i in range(4)
            ]
            await asyncio.sleep(1.5)
            futures = [
                producer.send_async("orders", b"b%d" % i, key=f"k{i}", delay_ms=300)
                for i in range(4)
            ]
            later = await asyncio.gather(*futures)
            assert not any(m.duplicate for m in first + later)
            for _ in range(250):
                if len(read_all(broker, "orders")) == 8:
                    break
                await asyncio.sleep(0.02)
    finally:
        await abroker.close()
    assert len(read_all(broker, "orders")) == 8


# -- batch size ----------------------------------------------------------------------------------


def test_delayed_batches_respect_max_batch_bytes(
    broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: producer option `max_batch_bytes=1 MiB`. Plain batches are sealed at it; delayed
    batches are sealed only at max_batch_messages (500), so 20 messages of 512 KiB go to the
    server as one 10 MiB schedule.lua call (500 of 1 MiB would be one 500 MiB call)."""
    from redisq.protocol import ScriptCall

    broker.create_topic("orders", partitions=1)
    real = broker.scripts.pack  # the delayed sender writes packed calls to its own connections
    sizes: dict[str, list[int]] = {"schedule": [], "produce": []}

    def pack(step: ScriptCall) -> bytes:  # type: ignore[type-arg]
        if step.script == "schedule":
            sizes["schedule"].append(sum(len(a) for a in step.args if isinstance(a, bytes)))
        return real(step)

    monkeypatch.setattr(broker.scripts, "pack", pack)
    value = b"x" * (512 * 1024)
    with broker.producer(linger_ms=500) as producer:
        futures = [
            producer.send_async("orders", value, key="k", delay_ms=60_000) for _ in range(20)
        ]
        for f in futures:
            f.result(timeout=60)
    assert broker.describe_topic("orders").total_scheduled == 20
    biggest = max(sizes["schedule"])
    assert biggest <= (1 << 20) + 4096, (
        f"one schedule.lua call carried {biggest / 2**20:.1f} MiB with max_batch_bytes=1 MiB "
        f"(calls: {[round(s / 2**20, 1) for s in sizes['schedule']]})"
    )


@aio
async def test_delayed_batches_respect_max_batch_bytes_asyncio(
    broker: redisq.Broker, server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redisq.protocol import ScriptCall

    broker.create_topic("orders", partitions=1)
    abroker = await rq.connect(server_url, namespace=broker.namespace)
    real = abroker.scripts.pack  # the delayed sender writes packed calls to its own connections
    sizes: list[int] = []

    def pack(step: ScriptCall) -> bytes:  # type: ignore[type-arg]
        if step.script == "schedule":
            sizes.append(sum(len(a) for a in step.args if isinstance(a, bytes)))
        return real(step)

    monkeypatch.setattr(abroker.scripts, "pack", pack)
    value = b"x" * (512 * 1024)
    try:
        async with abroker.producer(linger_ms=500) as producer:
            await producer.send("orders", b"warm", key="k", delay_ms=60_000)
            futures = [
                producer.send_async("orders", value, key="k", delay_ms=60_000) for _ in range(20)
            ]
            await asyncio.gather(*futures)
    finally:
        await abroker.close()
    assert broker.describe_topic("orders").total_scheduled == 21
    assert max(sizes) <= (1 << 20) + 4096, (
        f"one schedule.lua call carried {max(sizes) / 2**20:.1f} MiB with max_batch_bytes=1 MiB"
    )
