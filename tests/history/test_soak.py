"""Soak: the history checker over a longer run with repeated faults of every kind, in rounds:
a member SIGKILLed and replaced, a member SIGSTOPped past its lease and continued, the server
SIGKILLed and restarted from its AOF (appendfsync always), a new instance of the named producer
started while the old one still sends (which fences it). Two producers send throughout; every
property is checked at the end.

REDISQ_HISTORY_SOAK_ROUNDS (default 2: every fault kind twice, each after the others; more for a
longer soak) sets the rounds, REDISQ_HISTORY_SOAK_SEED the seed of the choices (printed, to
replay a failure).
"""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path

import pytest

import redisq
from tests.history.harness import TOPIC, Run, assert_no_violations, read_stored
from tests.servers import ServerProcess, binary_for

pytestmark = [pytest.mark.soak, pytest.mark.fault]

ROUNDS = int(os.environ.get("REDISQ_HISTORY_SOAK_ROUNDS", "2"))
LEASE_TTL_MS = 1500
PRODUCER = {"max_batch_messages": 100, "linger_ms": 2, "delivery_timeout_ms": 60_000}
CONSUMER = {"lease_ttl_ms": LEASE_TTL_MS}


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_soak_repeated_faults(kind: str, tmp_path: Path) -> None:
    seed = int(os.environ.get("REDISQ_HISTORY_SOAK_SEED", str(random.randrange(1 << 30))))
    print(f"\nsoak seed {seed}, {ROUNDS} rounds")
    rng = random.Random(seed)
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    with Run(tmp_path, server.url, servers=[server]) as run:
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=6)
        named = ["A1"]
        run.producer("A1", name="svc", options=PRODUCER)
        run.producer("B", options=PRODUCER)
        for proc in ("A1", "B"):
            run.workers[proc].command("stream", count=None, rate=400, keys=24)
        members = ["c1", "c2", "c3"]
        numbers = itertools.count(len(members) + 1)
        for proc in members:
            run.consumer(proc, options=CONSUMER, work_ms=1)

        def progress(count: int = 300) -> None:
            """Wait until `count` more messages have been acknowledged and handled."""
            acked, handled = run.count("send_ok"), run.count("handle_end")
            run.wait(lambda: run.count("send_ok") >= acked + count, 120, "sends going on")
            run.wait(lambda: run.count("handle_end") >= handled + count, 120, "handling going on")

        progress()
        for round_ in range(ROUNDS):
            victim = rng.choice(members)
            run.driver.kill(run.workers[victim])
            members.remove(victim)
            members.append(f"c{next(numbers)}")
            run.consumer(members[-1], options=CONSUMER, work_ms=1)
            progress()

            frozen = rng.choice(members)
            run.driver.stop(run.workers[frozen])
            time.sleep(2 * LEASE_TTL_MS / 1000)  # the fault's duration: past the lease
            run.driver.cont(run.workers[frozen])
            progress()

            run.driver.kill_server(server)
            run.driver.restart_server(server)
            progress()

            named.append(f"A{round_ + 2}")
            run.producer(named[-1], name="svc", options=PRODUCER)
            run.workers[named[-1]].command("stream", count=None, rate=400, keys=24)
            progress()

        producers = [*named, "B"]
        problems = run.close_producers(producers, timeout=75)
        with redisq.connect(server.url, namespace=run.namespace) as reader:
            stored = read_stored(reader)
        run.wait_all_handled(stored, timeout=120)
        run.finish_workers()
        fenced = {e["proc"] for e in run.events() if e["ev"] == "stream_end"
                  and e["reason"] == "ProducerFenced"}  # fmt: skip
        print(f"soak: {len(stored)} stored; fenced instances: {sorted(fenced)}")
        if fenced != set(named[:-1]):
            problems.append(f"fenced instances {sorted(fenced)}, expected {named[:-1]}")
        assert_no_violations(run.check(stored), problems)
