"""Check-back by two live members of one transactional group whose check() is slower than the
checker lease (both APIs, through tests/txhelp.py drivers).

The checker lease expires during a slow check(), so another member takes it and asks check()
about the same transaction at the same time. What must hold anyway:

- an UNKNOWN round counts once (tx_claim_check.lua: the first answer of a due round takes it and
  reschedules it; a second answer of that round counts nothing), so a half message is given up
  only after max_checks rounds, check_interval_ms apart;
- the checker renews its lease before each check() call of a round and stops the round when the
  lease is another member's: a check() starts only while its member holds the lease.

The lease's time to live (5 s at least) is shortened here, by replacing
redisq.produce.transactional.background_lease_ms in both drivers, so the tests take seconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import redisq
import redisq.produce.transactional as transactional
import redisq.produce.transactional_async as async_transactional
from redisq.model.keys import unresolved_topic
from redisq.model.transactions import TxState
from redisq.protocol import run_operation
from redisq.protocol import transaction_ops as ops
from redisq.protocol import transactions as tx
from tests.conftest import wait_until
from tests.txhelp import DRIVERS, partitions_of, tx_state

LEASE_MS = 300  # the checker lease's time to live in these tests
CHECK_S = 0.9  # how long each check() takes: longer than the lease
INTERVAL_MS = 1500  # longer than a check, so a round's second answer comes before the next round
SLOW = {"check_first_ms": 100, "check_interval_ms": INTERVAL_MS}
# Timing-bound (two backends suffice: a standalone server and a cluster, where the group's zset
# and the transaction's record are in different slots).
TIMED_BACKENDS = pytest.mark.parametrize("backend", ["redis", "valkey-cluster"])


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


@pytest.fixture
def short_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transactional, "background_lease_ms", lambda tick_s: LEASE_MS)
    monkeypatch.setattr(async_transactional, "background_lease_ms", lambda tick_s: LEASE_MS)


class SlowChecks:
    """The members' check functions: UNKNOWN after CHECK_S. Each call is recorded as
    (member, tx id, start, end, who held the group's checker lease when it started)."""

    def __init__(self, broker: redisq.Broker, group: str, asynchronous: bool) -> None:
        self.broker, self.lease = broker, broker.keys.transaction_checker(group)
        self.asynchronous = asynchronous
        self.calls: list[tuple[str, str, float, float, bytes | None]] = []
        self.lock = threading.Lock()

    def member(self, name: str) -> Callable[[str, list[redisq.TxMessage]], Any]:
        def started() -> tuple[float, bytes | None]:
            return time.monotonic(), self.broker.client.get(self.lease)

        def ended(tx_id: str, start: float, holder: bytes | None) -> TxState:
            with self.lock:
                self.calls.append((name, tx_id, start, time.monotonic(), holder))
            return TxState.UNKNOWN

        def check(tx_id: str, messages: list[redisq.TxMessage]) -> TxState:
            start, holder = started()
            time.sleep(CHECK_S)
            return ended(tx_id, start, holder)

        async def async_check(tx_id: str, messages: list[redisq.TxMessage]) -> TxState:
            # (both members share the driver's event loop: a plain sleep would block the other)
            start, holder = started()
            await asyncio.sleep(CHECK_S)
            return ended(tx_id, start, holder)

        return async_check if self.asynchronous else check

    def overlapping(self, tx_id: str) -> bool:
        """Two members asked check() about tx_id at the same time."""
        with self.lock:
            calls = [c for c in self.calls if c[1] == tx_id]
        return any(
            a[0] != b[0] and a[2] < b[3] and b[2] < a[3] for a in calls for b in calls if a != b
        )


def unknown(tx_id: str, messages: list[redisq.TxMessage]) -> TxState:
    return TxState.UNKNOWN


@TIMED_BACKENDS
def test_a_slow_check_back_counts_each_round_once(
    broker: redisq.Broker, driver: Any, short_leases: None
) -> None:
    """Two members, a check() slower than the checker lease: both ask about the transaction in
    the same round, and the round counts once. The record's `checks` goes up one per round,
    rounds at least check_interval_ms apart, and the message is given up (unresolved) after
    max_checks rounds, not before."""
    max_checks = 3
    broker.create_topic("orders", partitions=1)
    checks = SlowChecks(broker, "svc", driver.name == "async")
    options = {**SLOW, "max_checks": max_checks}
    with (
        driver.producer(transactional_group="svc", check=checks.member("a"), **options) as a,
        driver.producer(transactional_group="svc", check=checks.member("b"), **options),
    ):
        tx_id = a.send_in_transaction("orders", b"created", local=unknown).transaction_id
        record = broker.keys.transaction(tx_id)
        counted: dict[int, float] = {}  # checks -> when first seen

        def given_up() -> bool:
            counted.setdefault(int(broker.client.hget(record, "checks") or 0), time.monotonic())
            return tx_state(broker, tx_id) == "unresolved"

        wait_until(given_up, 30, "the check-back to give up")
        gave_up_at = time.monotonic()
        final_checks = int(broker.client.hget(record, "checks") or 0)
    first_check = min(c[2] for c in checks.calls)
    assert checks.overlapping(tx_id), f"no two checks of one round overlapped: {checks.calls}"
    # While open, `checks` counts the rounds answered, one by one, a round at least
    # check_interval_ms after the one before; the give-up (the max_checks-th UNKNOWN) is counted
    # again by its decision (tx_decide.lua counts every check-back decision).
    rounds = sorted(n for n in counted if 0 < n < max_checks)
    assert rounds == list(range(1, max_checks)), counted
    assert final_checks == max_checks + 1, (counted, checks.calls)
    seen = [counted[n] for n in rounds]
    gaps = [later - earlier for earlier, later in zip(seen, seen[1:], strict=False)]
    assert all(gap >= INTERVAL_MS / 1000 for gap in gaps), f"rounds counted {gaps} s apart"
    # Each round ends with an answer CHECK_S after it started; the next is due INTERVAL_MS later.
    least = CHECK_S + (max_checks - 1) * (INTERVAL_MS / 1000 + CHECK_S)
    assert gave_up_at - first_check >= least, (gave_up_at - first_check, checks.calls)
    [[moved]] = partitions_of(broker, unresolved_topic("svc")).values()
    assert moved.value == b"created"


@TIMED_BACKENDS
def test_a_check_starts_only_under_its_members_lease(
    broker: redisq.Broker, driver: Any, short_leases: None
) -> None:
    """Several transactions due in one round, each check() slower than the lease: the checker
    renews its lease before each check() and ends the round once another member holds it, so
    every check() starts while its own member holds the lease."""
    broker.create_topic("orders", partitions=1)
    checks = SlowChecks(broker, "svc", driver.name == "async")
    options = {**SLOW, "max_checks": 10}
    with (
        driver.producer(transactional_group="svc", check=checks.member("a"), **options) as a,
        driver.producer(transactional_group="svc", check=checks.member("b"), **options),
    ):
        ids = [a.send_in_transaction("orders", b"%d" % i, local=unknown).transaction_id
               for i in range(3)]  # fmt: skip

        def all_answered() -> bool:
            with checks.lock:
                return {c[1] for c in checks.calls} >= set(ids)

        wait_until(all_answered, 30, "every transaction's first check-back")
    holders: dict[str, set[bytes | None]] = {}
    for member, _, _, _, holder in checks.calls:
        holders.setdefault(member, set()).add(holder)
    for member, seen in holders.items():
        assert len(seen) == 1 and None not in seen, f"{member}'s checks started under {seen}"
    if len(holders) == 2:
        assert holders["a"] != holders["b"]
    for tx_id in ids:
        assert tx_state(broker, tx_id) == "open"


def test_a_second_unknown_answer_of_one_round_counts_nothing(broker: redisq.Broker) -> None:
    """tx_ops.answer_check straight (both drivers run it): the first UNKNOWN answer of a due
    round counts and reschedules; a second one of the same round finds it rescheduled and counts
    nothing; in the next round the answer counts again, and max_checks gives up."""
    broker.create_topic("orders", partitions=1)
    with broker.producer(transactional_group="svc", check=unknown, check_first_ms=600_000) as p:
        tx_id = p.send_in_transaction("orders", b"created", local=unknown).transaction_id
    # The producer is closed: nothing else checks. Make the transaction due now.
    client, keys = broker.client, broker.keys
    schedule = keys.transaction_group("svc")
    client.zadd(schedule, {tx_id: 0}, xx=True)
    record = broker.scripts.execute(tx.read_record(keys, tx_id))
    assert record is not None

    def answer() -> str:
        op = ops.answer_check(keys, record, TxState.UNKNOWN, max_checks=2, interval_ms=600_000)
        return run_operation(op, broker.scripts.execute)

    def counted() -> int:
        return int(client.hget(keys.transaction(tx_id), "checks") or 0)

    assert answer() == "open" and counted() == 1
    rescheduled = client.zscore(schedule, tx_id)
    assert rescheduled is not None and rescheduled > time.time() * 1000 + 500_000
    assert answer() == "open" and counted() == 1  # the same round: not counted
    assert client.zscore(schedule, tx_id) == rescheduled
    client.zadd(schedule, {tx_id: 0}, xx=True)  # the next round
    # (the give-up's decision counts it once more: tx_decide.lua counts check-back decisions)
    assert answer() == "unresolved" and counted() == 3
    assert client.zscore(schedule, tx_id) is None
    assert answer() == "open" and counted() == 3  # gone from the schedule: nothing counted
    [[moved]] = partitions_of(broker, unresolved_topic("svc")).values()
    assert moved.value == b"created"
