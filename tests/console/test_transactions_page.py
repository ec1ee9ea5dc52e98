"""The console's Transactions & schedules page over HTTP, and the batched reads behind it
(redisq.protocol.waiting): a transaction left open by a killed process, half messages answered
UNKNOWN
until they are unresolved, delayed messages with their due time until they are delivered, the
sweep action (CSRF, hidden in read-only), and reads that cost the same round trips at any size.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from redisq.model.transactions import TxState
from redisq.protocol import run_operation
from redisq.protocol.overview import namespace_snapshot
from redisq.protocol.waiting import scheduled_messages, schedules, transactions_snapshot
from redisq.schedule.scheduler import Scheduler
from tests.conftest import drop_namespace
from tests.servers import ServerProcess

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tests.console.test_http import (  # noqa: E402
    Client,
    cells,
    count_round_trips,
    notice_of,
    running_console,
)

# A child that opens a Kafka-style transaction, stages two batches and is killed (SIGKILL)
# before it commits: the transaction stays open until the sweeper aborts it past its timeout.
KILLED_MIDWAY = """
import os, signal, sys, redisq
broker = redisq.connect(sys.argv[1], namespace=sys.argv[2])
producer = broker.producer(name="payments-tx", transactional=True, max_batch_messages=1,
                           transaction_timeout_ms=int(sys.argv[3]))
tx = producer.transaction().__enter__()
tx.send("payments", b"debit 10", key="acct-1")
tx.send("payments", b"credit 10", key="acct-2")
print(tx.transaction_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def open_transaction_in_killed_process(url: str, namespace: str, timeout_ms: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MIDWAY, url, namespace, str(timeout_ms)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -9, done.stderr
    return done.stdout.strip()


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def when(ms: int) -> str:
    """The console's rendering of a server time (UTC, milliseconds)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d} UTC"


@pytest.fixture
def local_broker(valkey_server: ServerProcess, namespace: str) -> Iterator[redisq.Broker]:
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    yield broker
    drop_namespace(broker)
    broker.close()


def rows_by_tx(page: str, table: str) -> dict[str, list[str]]:
    return {row[0] if table == "transactions" else row[1]: row for row in cells(page, table)}


# -- the page ------------------------------------------------------------------------------------
def test_killed_producer_leaves_an_open_transaction_until_swept(
    valkey_server: ServerProcess, local_broker: redisq.Broker
) -> None:
    local_broker.create_topic("payments", partitions=2)
    tx_id = open_transaction_in_killed_process(valkey_server.url, local_broker.namespace, 1000)
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/transactions")
        row = rows_by_tx(page, "transactions")[tx_id]
        assert row[1:5] == ["open", "payments-tx", "", "2"]  # state, producer, group, batches
        assert 'action="/transactions/sweep"' in page
        record = local_broker.client.hgetall(local_broker.keys.transaction(tx_id))
        deadline = int(record[b"deadline_ms"])
        assert row[6].startswith(when(deadline))
        wait_for(lambda: local_broker.client.time()[0] * 1000 > deadline + 50, 10, "the deadline")
        _, _, page = client.get("/transactions")
        assert "past: due for the sweeper" in rows_by_tx(page, "transactions")[tx_id][6]
        status, headers, _ = client.post(
            "/transactions/sweep", {"csrf": client.csrf("/transactions")}
        )
        assert status == 303
        assert notice_of(client, headers["location"]) == "ok: Swept: 1 transaction due"
        _, _, page = client.get("/transactions")
        assert tx_id not in page
        assert cells(page, "transactions") == [["No open or unfinished transactions."]]
    state = local_broker.client.hget(local_broker.keys.transaction(tx_id), "state")
    assert state == b"aborted"
    assert all(local_broker.client.xlen(local_broker.keys.log("payments", p)) == 0 for p in (0, 1))


def test_half_messages_answered_unknown_count_checks_then_are_unresolved(
    local_broker: redisq.Broker,
) -> None:
    """Check-back answers UNKNOWN twice (max_checks=2): the page shows the transaction open with
    0, then 1 check, then its message in the group's unresolved topic with where it was headed.
    Each page load falls well inside a check interval (1.5 s)."""
    local_broker.create_topic("orders", partitions=3)
    checks: list[str] = []

    def check(tx_id: str, messages: Any) -> TxState:
        checks.append(tx_id)
        return TxState.UNKNOWN

    record_checks = lambda tx_id: local_broker.client.hget(  # noqa: E731
        local_broker.keys.transaction(tx_id), "checks"
    )
    options: Any = {"check_first_ms": 1_500, "check_interval_ms": 1_500, "max_checks": 2}
    with running_console(local_broker) as base:
        client = Client(base)
        with local_broker.producer(transactional_group="order-svc", check=check, **options) as p:
            result = p.send_in_transaction(
                "orders", b'{"order": 42}', key="order-42", local=lambda tx, m: TxState.UNKNOWN
            )
            tx_id = result.transaction_id
            _, _, page = client.get("/transactions")
            row = rows_by_tx(page, "transactions")[tx_id]
            assert row[1:5] == ["open", str(p.producer_id), "order-svc", "1"]
            assert row[7] == "0" and not checks
            wait_for(lambda: record_checks(tx_id) == b"1", 10, "the first check-back")
            _, _, page = client.get("/transactions")
            row = rows_by_tx(page, "transactions")[tx_id]
            assert row[1] == "open" and row[7] == "1"
            wait_for(
                lambda: tx_id not in rows_by_tx(client.get("/transactions")[2], "transactions"),
                15,
                "the transaction to leave the registry",
            )
        _, _, page = client.get("/transactions")
        [moved] = cells(page, "unresolved")
        partition = redisq.partition_for_key(b"order-42", 3)
        assert moved[:5] == ["order-svc", tx_id, f"orders/{partition}", "order-42", '{"order": 42}']
        assert cells(page, "transactions") == [["No open or unfinished transactions."]]
    assert checks == [tx_id, tx_id]
    assert all(local_broker.client.xlen(local_broker.keys.log("orders", p)) == 0 for p in range(3))


def test_delayed_message_is_scheduled_with_its_due_time_until_delivered(
    local_broker: redisq.Broker,
) -> None:
    local_broker.create_topic("reminders", partitions=4)
    with local_broker.producer() as producer:
        meta = producer.send("reminders", b"call back", key="cust-7", delay_ms=2_500)
    schedule = local_broker.keys.scheduled("reminders", meta.partition)
    [(_, due)] = local_broker.client.zrange(schedule, 0, -1, withscores=True)
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/transactions")
        [row] = cells(page, "scheduled-partitions")
        assert row[:4] == ["reminders", str(meta.partition), "1", when(int(due))]
        [upcoming] = cells(page, "scheduled-messages")
        assert upcoming[:5] == [when(int(due)), "reminders", str(meta.partition), "cust-7",
                                "call back"]  # fmt: skip
        with Scheduler(local_broker, ["reminders"]):
            wait_for(
                lambda: local_broker.client.xlen(
                    local_broker.keys.log("reminders", meta.partition)
                ),
                15,
                "the delivery",
            )
        _, _, page = client.get("/transactions")
        assert cells(page, "scheduled-partitions") == [["No scheduled messages."]]
        assert cells(page, "scheduled-messages") == [["Nothing scheduled."]]
    [delivered] = local_broker.read("reminders", meta.partition)
    assert delivered.value == b"call back" and delivered.timestamp_ms >= int(due)


def test_read_only_has_no_sweep(local_broker: redisq.Broker) -> None:
    with running_console(local_broker, read_only=True) as base:
        client = Client(base)
        status, _, page = client.get("/transactions")
        assert status == 200 and 'method="post"' not in page and "Sweep now" not in page
        status, _, page = client.post("/transactions/sweep", {"csrf": client.csrf("/login")})
        assert status == 403 and "read-only" in page


def test_sweep_without_csrf_is_refused(local_broker: redisq.Broker) -> None:
    with running_console(local_broker) as base:
        client = Client(base)
        client.get("/transactions")
        assert client.post("/transactions/sweep", {})[0] == 403


# -- the reads -----------------------------------------------------------------------------------
def test_waiting_reads_cost_the_same_round_trips_at_any_size(broker: redisq.Broker) -> None:
    """Every backend: the next due messages are those a full read of every schedule gives, and
    transactions cost two round trips (three with half messages) for 1 and for 6."""
    broker.create_topic("later", partitions=8)
    with broker.producer() as producer:
        for i in range(40):
            producer.send_async("later", b"m%d" % i, key=f"k{i}", delay_ms=600_000 + 997 * (i % 13))
        producer.flush()
    truth = sorted(
        (int(score), p, member)
        for p in range(8)
        for member, score in broker.client.zrange(
            broker.keys.scheduled("later", p), 0, -1, withscores=True
        )
    )
    assert len(truth) == 40
    snapshot = run_operation(namespace_snapshot(broker.keys), broker.scripts.execute)
    topic = snapshot.topics["later"]
    assert topic.scheduled == 40 and topic.next_due_ms == truth[0][0]
    execute, calls = count_round_trips(broker)
    waiting = run_operation(schedules(broker.keys), execute)
    assert len(calls) == 3
    counts = {p: 0 for p in range(8)}
    for _, p, _ in truth:
        counts[p] += 1
    assert [(s.partition, s.scheduled) for s in waiting.partitions] == [
        (p, n) for p, n in counts.items() if n
    ]
    next_due = {("later", s.partition): s.next_due_ms for s in waiting.partitions}
    assert next_due == {("later", p.partition): p.next_due_ms for p in topic.partitions
                        if p.next_due_ms}  # fmt: skip
    execute, calls = count_round_trips(broker)
    first = run_operation(scheduled_messages(broker.keys, next_due, 10), execute)
    assert len(calls) == 2
    assert [(m.due_ms, m.partition, m.schedule_id) for m in first] == truth[:10]
    fewer = run_operation(scheduled_messages(broker.keys, next_due, 3), broker.scripts.execute)
    assert [(m.due_ms, m.partition, m.schedule_id) for m in fewer] == truth[:3]
    assert all(m.value.startswith(b"m") and m.key for m in first)

    trips = []
    for count in (1, 6):
        with broker.producer(
            transactional_group=f"g{count}", check=lambda tx, m: TxState.UNKNOWN,
            check_first_ms=600_000,
        ) as producer:  # fmt: skip
            for _ in range(count):
                producer.send_in_transaction("later", b"half", local=lambda tx, m: TxState.UNKNOWN)
            execute, calls = count_round_trips(broker)
            seen = run_operation(transactions_snapshot(broker.keys), execute)
            trips.append(len(calls))
            mine = [t for t in seen.transactions if t.info.group == f"g{count}"]
            assert len(mine) == count and all(t.info.state == "open" for t in mine)
            assert all(t.next_check_ms and t.next_check_ms > seen.now_ms for t in mine)
    assert trips == [3, 3]
