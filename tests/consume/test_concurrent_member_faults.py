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

import pytest

import redisq
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
