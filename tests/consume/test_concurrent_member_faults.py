"""Concurrent mode under faults: a member SIGSTOPped past claim_idle_ms while it holds
unacked entries, then SIGCONTed; a member SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis

import redisq
from redisq.consume.partition_io import PartitionIO
from redisq.consume.partition_io_async import AsyncPartitionIO
from tests.conftest import wait_until


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def url_of(broker: redisq.Broker) -> str:
    kwargs = broker.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}"


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_concurrent_member_frozen_or_killed_with_unacked_entries(
    broker: redisq.Broker, fault: str
) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for i in range(400):
            producer.send_async("t", b"%d" % i, key=str(i))
        producer.flush()
    events = f"{broker.namespace}:test-events"
    client = broker.client
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.adv_concurrent_worker", url_of(broker), broker.namespace,
         "victim"], env=env,
    )  # fmt: skip
    try:
        wait_until(lambda: client.llen(events) >= 30, what="the victim handling")
        os.kill(proc.pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        stuck = (
            client.xpending(broker.keys.log("t", 0), "g")["pending"]
            + client.xpending(broker.keys.log("t", 1), "g")["pending"]
        )
        local: list[tuple[int, str]] = []
        survivor = broker.consumer(
            "t", "g", "survivor", mode="concurrent", lease_ttl_ms=1500, claim_idle_ms=500
        )
        thread = threading.Thread(
            target=survivor.run,
            args=(lambda m: (time.sleep(0.002), local.append((m.partition, m.offset))),),
        )
        thread.start()
        time.sleep(3.0)
        if fault == "stop":
            os.kill(proc.pid, signal.SIGCONT)

        def handled() -> set[tuple[int, str]]:
            remote = {
                (int(p), o)
                for _, p, o in (e.decode().split() for e in client.lrange(events, 0, -1))
            }
            return remote | set(local)

        wait_until(lambda: len(handled()) >= 400, timeout=30, what="every message handled")
        survivor.close()
        thread.join(10)
    finally:
        if fault == "stop":
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        proc.wait(20)
    assert len(handled()) == 400
    pending = sum(client.xpending(broker.keys.log("t", p), "g")["pending"] for p in (0, 1))
    counts = Counter(
        [(int(p), o) for _, p, o in (e.decode().split() for e in client.lrange(events, 0, -1))]
        + local
    )
    repeats = sum(c - 1 for c in counts.values())
    print(f"{fault}: stuck {stuck}, repeats {repeats}, pending at the end {pending}")
    if fault == "stop":  # the victim closed cleanly: nothing pending
        assert pending == 0


# -- a read whose reply is lost --------------------------------------------------------------------


@pytest.mark.parametrize("entry_format", ["batch", "message"])
def test_entries_a_lost_reply_took_are_handled_without_waiting_for_a_claim(
    api: Any, broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch, entry_format: str
) -> None:
    """The connection drops after XREADGROUP ran: its entries are pending on this member, and
    their reply is lost. The member reads its own pending entries again after the failed read,
    so they are handled now, each once, not after claim_idle_ms (ten minutes here)."""
    broker.create_topic("t", partitions=1, entry_format=entry_format)
    values = [b"m%d" % i for i in range(20)]
    with broker.producer(linger_ms=30_000) as producer:
        for half in (values[:10], values[10:]):
            for value in half:
                producer.send_async("t", value)
            producer.flush()
    lost = {"left": 1}

    def lose(commands: list[tuple[Any, ...]], replies: list[Any]) -> list[Any]:
        took = commands[-1][0] == "XREADGROUP" and commands[-1][-1] == ">" and replies[-1]
        if took and lost["left"]:
            lost["left"] -= 1
            raise redis.ConnectionError("injected: the reply was lost")
        return replies

    if api.name == "sync":
        real = PartitionIO._exchange

        def flaky(self: PartitionIO, key: str, commands: Any, **kw: Any) -> list[Any]:
            return lose(commands, real(self, key, commands, **kw))

        monkeypatch.setattr(PartitionIO, "_exchange", flaky)
    else:
        real_async = AsyncPartitionIO._exchange

        async def flaky_async(
            self: AsyncPartitionIO, key: str, commands: Any, **kw: Any
        ) -> list[Any]:
            return lose(commands, await real_async(self, key, commands, **kw))

        monkeypatch.setattr(AsyncPartitionIO, "_exchange", flaky_async)
    handled: list[bytes] = []
    consumer = api.broker.consumer("t", "g", mode="concurrent", claim_idle_ms=600_000)
    started = time.monotonic()
    consumer.run(lambda m: handled.append(m.value), idle_timeout=3.0)
    assert lost["left"] == 0, "the injection never fired"
    assert sorted(handled) == sorted(values)
    assert time.monotonic() - started < 60
