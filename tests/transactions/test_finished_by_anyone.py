"""A committed transaction whose producer died before rolling it forward is carried out by
whoever runs in the namespace (issue 37 item 5): a consumer (both APIs) or `redisq scheduler`,
with no transactional producer anywhere, within seconds rather than at the transaction's
timeout (60 s by default, left as it is here).

The producer "x" is SIGKILLed right after its commit decision was stored (tests/txhelp.py); its
name never comes back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

import redisq
from tests.conftest import wait_until
from tests.transactions.test_crash_at_every_step import crashed, kafka_sends, layout
from tests.txhelp import Child, CrashAt, assert_exactly_once, kafka_child, registry, tx_state

pytestmark = pytest.mark.fault

# The bound the docs state: the roll-forward grace (2 s) plus a sweep interval (1 s) plus, when
# a sweeper lease holder is gone, its lease (5 s); the transaction timeout is 60 s.
BOUND_S = 15


def _crash_after_decide(broker: redisq.Broker, server_url: str) -> str:
    broker.create_topic("out", partitions=4)
    broker.create_topic("audit", partitions=1)
    spec = {
        "name": "x",
        "options": {"max_batch_messages": 2},
        "sends": kafka_sends("x"),
        "crash": CrashAt("tx_decide", 1),
    }
    child = Child(kafka_child, server_url, broker.namespace, spec)
    _, tx_id = child.expect("tx")
    crashed(child, spec["crash"])
    assert tx_state(broker, tx_id) == "committed"
    assert registry(broker) == [tx_id]
    return tx_id


def test_a_consumer_finishes_a_committed_transaction_left_behind(
    api: Any, broker: redisq.Broker, server_url: str
) -> None:
    _crash_after_decide(broker, server_url)
    start = time.monotonic()
    consumer = api.broker.consumer(["out", "audit"], "g", start="earliest")
    seen: list[bytes] = []
    while len(seen) < 13 and time.monotonic() - start < 40:
        seen += [m.value for m in consumer.poll(timeout=0.5)]
    elapsed = time.monotonic() - start
    consumer.close()
    assert sorted(seen) == sorted(v for _, v, _ in kafka_sends("x"))
    assert elapsed < BOUND_S, f"read after {elapsed:.1f} s"
    assert_exactly_once(broker, layout(kafka_sends("x")), ["out", "audit"])
    wait_until(lambda: registry(broker) == [], 10, "the transaction forgotten")


def test_the_scheduler_finishes_a_committed_transaction_left_behind(
    broker: redisq.Broker, server_url: str
) -> None:
    tx_id = _crash_after_decide(broker, server_url)
    start = time.monotonic()
    command = [sys.executable, "-m", "redisq.cli", "scheduler", "--url", server_url]
    runner = subprocess.Popen(
        [*command, "--namespace", broker.namespace],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: registry(broker) == [], 40, "the scheduler's sweep")
        elapsed = time.monotonic() - start
    finally:
        runner.terminate()
        _, err = runner.communicate(timeout=30)
    assert runner.returncode == 0, err
    assert elapsed < BOUND_S, f"carried out after {elapsed:.1f} s"
    assert tx_state(broker, tx_id) == "committed"
    assert_exactly_once(broker, layout(kafka_sends("x")), ["out", "audit"])
