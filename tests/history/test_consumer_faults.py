"""Consumer faults, checked through the history checker (tests/history): members SIGKILLed,
SIGSTOPped past their lease and continued, joining and leaving while messages flow, and foreign
entries (written by another client, not by redisq) in the partition streams.

Each member is a `python -m tests.history.worker consumer` process that records handle_start and
handle_end of every handler call; a producer process sends while the faults happen. Afterwards:
one handler per partition at a time (a SIGSTOPped member's frozen call excepted, see
checker.one_handler_per_partition), every stored message handled, first handlings per key in
log order, and the producer's properties.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

import redisq
from tests.history.checker import Stored
from tests.history.harness import (
    PRODUCER,
    TOPIC,
    Run,
    assert_no_violations,
    read_partition,
    read_stored,
)
from tests.servers import ServerProcess, binary_for

pytestmark = pytest.mark.fault

KINDS = ["valkey", "redis"]
LEASE_TTL_MS = 1500
CONSUMER = {"lease_ttl_ms": LEASE_TTL_MS}


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> ServerProcess:
    """A server of its own, stopped by the Run that takes it over."""
    return ServerProcess(binary_for(request.param)).start()


def setup(run: Run, partitions: int = 6) -> None:
    with redisq.connect(run.url, namespace=run.namespace) as broker:
        broker.create_topic(TOPIC, partitions=partitions)


def stored_now(run: Run) -> list[Stored]:
    with redisq.connect(run.url, namespace=run.namespace) as reader:
        return read_stored(reader)


def handled_by(run: Run, proc: str) -> int:
    return run.count("handle_end", proc)


def test_consumer_sigkill(server: ServerProcess, tmp_path: Path) -> None:
    """One of three members is SIGKILLed mid-stream; the others take its partitions over after
    its lease runs out, first handling again what it had not acknowledged."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run)
        run.producer("A", options=PRODUCER)
        for proc in ("c1", "c2", "c3"):
            run.consumer(proc, options=CONSUMER, work_ms=3)
        run.workers["A"].command("stream", count=1500, rate=500, keys=16)
        run.wait(lambda: handled_by(run, "c1") >= 50, 60, "c1 handling")
        run.driver.kill(run.workers["c1"])
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])
        stored = stored_now(run)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)


def test_consumer_sigstop_past_lease(server: ServerProcess, tmp_path: Path) -> None:
    """A member is frozen (SIGSTOP) for at least twice the lease TTL mid-stream, then continued.
    Its partitions move to the others meanwhile; after SIGCONT it must not go on handling them
    (its one frozen call may finish; its acks are refused)."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run)
        run.producer("A", options=PRODUCER)
        # A backlog (the producer bursts ahead of 8 ms handlers): members hold full batches, so
        # the frozen one has messages in hand when it is continued, past its lease.
        for proc in ("c1", "c2", "c3"):
            run.consumer(proc, options=CONSUMER, work_ms=8)
        run.workers["A"].command("stream", count=1500, rate=1500, keys=16)
        run.wait(lambda: handled_by(run, "c1") >= 50, 60, "c1 handling")
        owned = {e["partition"] for e in run.events() if e["ev"] == "handle_end"
                 and e["proc"] == "c1"}  # fmt: skip
        run.driver.stop(run.workers["c1"])
        stopped = time.monotonic()
        since = time.time() * 1000

        def taken_over() -> bool:
            return any(
                e["ev"] == "handle_end" and e["proc"] != "c1" and e["partition"] in owned
                and e["wall"] > since
                for e in run.events()
            )  # fmt: skip

        run.wait(taken_over, 60, "the frozen member's partitions to be taken over")
        hold(max(0.0, 2 * LEASE_TTL_MS / 1000 - (time.monotonic() - stopped)))
        run.driver.cont(run.workers["c1"])
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])
        stored = stored_now(run)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)


def hold(seconds: float) -> None:
    """The duration of a fault (a process kept stopped): not a wait for a condition."""
    time.sleep(seconds)


def test_membership_churn(server: ServerProcess, tmp_path: Path) -> None:
    """Members join and leave (gracefully and by SIGKILL) while messages flow: c1 alone, c2 and
    c3 join, c1 leaves, c4 joins, c2 is killed, c5 joins."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run)
        run.producer("A", options=PRODUCER)
        run.consumer("c1", options=CONSUMER, work_ms=3)
        # Until closed: every member joins while messages flow, however long the rebalances
        # take (a fixed count ran out before c4 joined on a loaded machine: c4 had nothing left)
        run.workers["A"].command("stream", count=None, rate=400, keys=16)

        def step(proc: str, count: int = 30) -> None:
            run.wait(lambda: handled_by(run, proc) >= count, 60, f"{proc} handling")

        step("c1")
        run.consumer("c2", options=CONSUMER, work_ms=3)
        run.consumer("c3", options=CONSUMER, work_ms=3)
        step("c2")
        step("c3")
        run.finish_workers(["c1"])  # leaves: its leases are released at once
        run.consumer("c4", options=CONSUMER, work_ms=3)
        step("c4")
        run.driver.kill(run.workers["c2"])
        run.consumer("c5", options=CONSUMER, work_ms=3)
        step("c5")
        problems = run.close_producers(["A"])
        stored = stored_now(run)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)


# -- foreign entries -------------------------------------------------------------------------------

FOREIGN: list[dict[bytes, bytes]] = [
    {b"foo": b"bar"},  # no field redisq writes
    {b"k": b"k0", b"v": b"foreign-p", b"p": b"not-a-number"},
    {b"k": b"k1", b"v": b"foreign-s", b"p": b"1", b"s": b"xyz"},
    {b"k": b"k2", b"v": b"foreign-h", b"h": b"\x00\x09garbage"},
    {b"v": b"foreign-extra", b"z": b"1", b"k": b"k3"},  # an extra field, another field order
]


def test_foreign_entries_do_not_block_partitions(server: ServerProcess, tmp_path: Path) -> None:
    """Another client XADDs entries redisq did not write into every partition stream while
    messages flow: fields the library does not know, a non-numeric producer id or sequence,
    garbage headers. The good messages are all handled, in order per key; the members keep
    going. broker.read must read such a partition too."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run, partitions=4)
        run.producer("A", options=PRODUCER)
        for proc in ("c1", "c2"):
            run.consumer(proc, options=CONSUMER)
        run.workers["A"].command("stream", count=1000, rate=400, keys=8)
        run.wait_handled(100)
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            with redis.Redis(port=server.port) as foreign:
                for p in range(4):
                    for fields in FOREIGN:
                        if b"v" in fields:  # unique values, to tell them apart in a report
                            fields = {**fields, b"v": fields[b"v"] + b"-%d" % p}
                        foreign.xadd(broker.keys.log(TOPIC, p), fields)  # type: ignore[arg-type]
        run.driver.record("foreign_entries", "server", server, count=4 * len(FOREIGN))
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])
        stored, read_errors = stored_despite_foreign(run, partitions=4)
        run.wait_all_handled(stored)
        run.finish_workers()
        consumer_errors = [
            f"{e['proc']}: {e['error']}: {e['message']}"
            for e in run.events()
            if e["ev"] == "consumer_error"
        ]
        results = run.check(stored, foreign_ok=True)
        assert_no_violations(results, problems + read_errors + consumer_errors)


def stored_despite_foreign(run: Run, partitions: int) -> tuple[list[Stored], list[str]]:
    """broker.read of every partition; where it raises (a violation: a reader must read what a
    partition holds), the entries are taken with XRANGE so the other checks still run."""
    errors = []
    stored: list[Stored] = []
    with redisq.connect(run.url, namespace=run.namespace) as broker:
        for p in range(partitions):
            try:
                stored += read_partition(broker, p)
            except Exception as exc:
                errors.append(f"broker.read({TOPIC!r}, {p}) raised {type(exc).__name__}: {exc}")
                for entry_id, fields in broker.client.xrange(broker.keys.log(TOPIC, p)):
                    key = fields.get(b"k")
                    stored.append(
                        Stored(
                            p,
                            entry_id.decode(),
                            key.decode(errors="backslashreplace") if key else None,
                            fields.get(b"v", b"").decode(errors="backslashreplace"),
                        )
                    )
    return stored, errors
