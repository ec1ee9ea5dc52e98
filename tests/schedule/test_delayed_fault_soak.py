"""Adversarial fault soak of delayed messages: three `redisq scheduler` processes (one
SIGSTOPped past its lease, one SIGKILLed mid-run), the server SIGSTOPped, a thread and an
asyncio scheduler in this process too, while a producer sends delayed and plain messages of
the same keys. Checks: every acknowledged delayed message appended exactly once, never before
its due time (entry id ms >= deliver_at_ms, both from the server's clock), per-key order among
messages of one key and one delay_ms, plain messages all there."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import pytest

import redisq
import redisq.asyncio as rq
from redisq.schedule.scheduler import Scheduler
from redisq.schedule.scheduler_async import Scheduler as AsyncScheduler
from tests.servers import ServerProcess, binary_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_scheduler(url: str, namespace: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "redisq.cli", "scheduler", "--url", url, "--namespace", namespace],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert child.stderr is not None
    assert "delivering delayed messages" in child.stderr.readline()
    return child


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_schedulers_killed_stopped_and_server_stopped(kind: str) -> None:
    server = ServerProcess(binary_for(kind)).start()
    ns = "advsoak"
    broker = redisq.connect(server.url, namespace=ns)
    children: list[subprocess.Popen[str]] = []
    loop_stop = threading.Event()
    in_proc = None
    try:
        broker.create_topic("t", partitions=3)
        children = [start_scheduler(server.url, ns) for _ in range(3)]
        in_proc = Scheduler(redisq.connect(server.url, namespace=ns), ["t"])

        def run_async_scheduler() -> None:
            async def main() -> None:
                ab = await rq.connect(server.url, namespace=ns)
                s = AsyncScheduler(ab, ["t"])
                while not loop_stop.is_set():
                    await asyncio.sleep(0.05)
                await s.close()
                await ab.close()

            asyncio.run(main())

        athread = threading.Thread(target=run_async_scheduler, daemon=True)
        athread.start()
        rnd = random.Random(7)
        n = 1500
        metas: dict[bytes, redisq.RecordMetadata] = {}
        plain: list[bytes] = []
        # the producer runs a scheduler of its own too (it sends delayed messages)
        producer = redisq.connect(server.url, namespace=ns).producer(retry_backoff_ms=10)
        futures = {}
        faults_done = []
        for i in range(n):
            key = f"k{i % 20}"
            value = b"d%05d" % i
            delay_ms = 300 + 40 * (i % 20)
            futures[value] = (key, producer.send_async("t", value, key=key, delay_ms=delay_ms))
            if i % 7 == 0:
                pv = b"p%05d" % i
                plain.append(pv)
                producer.send_async("t", pv, key=key)
            if i == 300:
                os.kill(children[0].pid, signal.SIGSTOP)
                faults_done.append("sigstop scheduler")
            if i == 600:
                os.kill(children[1].pid, signal.SIGKILL)
                faults_done.append("sigkill scheduler")
            if i == 900:
                os.kill(server.pid, signal.SIGSTOP)
                time.sleep(1.0)
                os.kill(server.pid, signal.SIGCONT)
                faults_done.append("sigstop server")
            if i == 1200:
                os.kill(children[0].pid, signal.SIGCONT)
            if i % 50 == 0:
                time.sleep(0.02 * rnd.random())
        producer.flush()
        for value, (_, f) in futures.items():
            metas[value] = f.result(30)
        producer.close()
        deadline = time.monotonic() + 30
        while broker.describe_topic("t").total_scheduled and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert broker.describe_topic("t").total_scheduled == 0
        messages = [m for p in range(3) for m in broker.read("t", p)]
        counts = Counter(m.value for m in messages)
        delayed = {v for v in counts if v.startswith(b"d")}
        assert delayed == set(metas), f"missing {len(set(metas) - delayed)}"
        assert [v for v, c in counts.items() if c > 1] == []
        assert set(plain) <= set(counts)
        early = [
            (m.value, m.offset, metas[m.value].deliver_at_ms)
            for m in messages
            if m.value.startswith(b"d")
            and int(m.offset.split("-")[0]) < metas[m.value].deliver_at_ms
        ]
        assert early == []
        per_key: dict[bytes, list[bytes]] = defaultdict(list)
        for p in range(3):
            for m in broker.read("t", p):
                if m.value.startswith(b"d"):
                    per_key[m.key].append(m.value)
        for key, values in per_key.items():
            assert values == sorted(values), f"key {key!r} out of order"
        print("faults:", faults_done, "delivered:", len(delayed), "plain:", len(plain))
    finally:
        loop_stop.set()
        if in_proc is not None:
            in_proc.close()
        for child in children:
            try:
                os.kill(child.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            child.kill()
            child.wait()
        try:
            os.kill(server.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_server_sigkilled_mid_delivery_with_aof(kind: str) -> None:
    """The server SIGKILLed (AOF, appendfsync always) while a scheduler process and a sending
    producer run; restarted on the same port: every acknowledged delayed message once."""
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    ns = "advaof"
    broker = redisq.connect(server.url, namespace=ns)
    child = None
    try:
        broker.create_topic("t", partitions=2)
        child = start_scheduler(server.url, ns)
        producer = redisq.connect(server.url, namespace=ns).producer(retry_backoff_ms=20)
        futures = {}
        for i in range(800):
            v = b"d%05d" % i
            futures[v] = producer.send_async("t", v, key=f"k{i % 10}", delay_ms=200 + i)
            if i == 400:
                time.sleep(0.4)  # deliveries under way
                server.kill()
                time.sleep(0.3)
                server.start()
            if i % 40 == 0:
                time.sleep(0.01)
        acked = set()
        for v, f in futures.items():
            if f.exception(60) is None:
                acked.add(v)
        producer.close()
        deadline = time.monotonic() + 30
        while broker.describe_topic("t").total_scheduled and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        counts = Counter(m.value for p in range(2) for m in broker.read("t", p))
        assert acked <= set(counts), f"lost {len(acked - set(counts))}"
        assert [v for v, c in counts.items() if c > 1] == []
        print("acked", len(acked), "stored", len(counts))
    finally:
        if child is not None:
            child.kill()
            child.wait()
        server.stop()
