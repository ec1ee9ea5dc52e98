"""A transaction's outcome, told truthfully when a call's reply was lost or another party decided
first (both APIs, every backend): abort() after a commit() whose decision landed, a retried
commit() that finds its input moved on, local()'s late ROLLBACK after the check-back committed.
In each case the decision that was stored stands, the caller is told so, its records carry the
offsets, and a consume-transform-produce input is not handed out again."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis

import redisq
from redisq.protocol import ScriptCall
from tests.transactions.test_transactions import CHECKS, CONSUMER, Answers, _fill
from tests.txhelp import DRIVERS, committed_positions, partitions_of, tx_state, values_of


class LostReplies:
    """The producer's own connection fails: the round trip that carries `script` runs on the
    server and its reply is lost; every later one fails before it is sent, until heal()."""

    def __init__(self, drv: Any, script: str) -> None:
        self.down = False
        scripts = drv.broker.scripts
        original = scripts.execute

        def hit(steps: Any) -> bool:
            calls = steps if isinstance(steps, list) else [steps]
            return any(isinstance(c, ScriptCall) and c.script == script for c in calls)

        def before(steps: Any) -> None:
            if self.down:
                raise redis.ConnectionError("injected: the network is down")

        def after(steps: Any) -> None:
            if hit(steps):
                self.down = True
                raise redis.ConnectionError(f"injected: the reply to {script} was lost")

        if drv.name == "async":

            async def execute_async(steps: Any) -> Any:
                before(steps)
                result = await original(steps)
                after(steps)
                return result

            scripts.execute = execute_async
        else:

            def execute(steps: Any) -> Any:
                before(steps)
                result = original(steps)
                after(steps)
                return result

            scripts.execute = execute

    def heal(self) -> None:
        self.down = False


def _transform(tx: Any, consumer: Any, inputs: list[redisq.Message]) -> None:
    for m in inputs:
        tx.send("out", b"out:" + m.value, key=m.key)
    tx.ack(consumer, inputs)


def _poll_all(consumer: Any, count: int) -> list[redisq.Message]:
    got: list[redisq.Message] = []
    deadline = time.monotonic() + 15
    while len(got) < count and time.monotonic() < deadline:
        got += consumer.poll(timeout=1.0)
    assert len(got) == count, got
    return got


def _stored_once(broker: redisq.Broker, tx: Any, inputs: list[redisq.Message]) -> None:
    """The outputs are stored once each, at the offsets tx.records gives, and the input
    position is committed past the inputs."""
    assert values_of(broker, "out") == [b"out:" + m.value for m in inputs]
    [stored] = partitions_of(broker, "out").values()
    assert [(r.topic, r.offset) for r in tx.records] == [("out", m.offset) for m in stored]
    assert committed_positions(broker, "in", "xf") == {0: inputs[-1].offset}


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Any:
    """The API under test (the thread one or asyncio)."""
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


@pytest.fixture
def producer_driver(broker: redisq.Broker, server_url: str, driver: Any) -> Any:
    """A second driver of the same API for the producer, so that only its connection fails."""
    drv = DRIVERS[driver.name](server_url, broker.namespace)
    yield drv
    drv.close()


def test_abort_after_a_commit_whose_reply_was_lost(
    broker: redisq.Broker, driver: Any, producer_driver: Any
) -> None:
    """commit()'s decision "committed" lands, its reply and every retry are lost until
    delivery_timeout_ms: commit() fails and the transaction stays open. abort() then finds it
    committed: TransactionDecided, state "committed", the records, and the consumer is not
    handed the inputs again (its position was committed with the outputs)."""
    broker.create_topic("in", partitions=1)
    broker.create_topic("out", partitions=1)
    _fill(broker, "in", 3)
    consumer = driver.consumer("in", "xf", "m1", **CONSUMER)
    producer = producer_driver.producer("xf", transactional=True, delivery_timeout_ms=1000)
    inputs = _poll_all(consumer, 3)
    tx = producer.transaction()
    _transform(tx, consumer, inputs)
    network = LostReplies(producer_driver, "tx_decide")
    with pytest.raises(redisq.RedisqError, match="delivery_timeout_ms"):
        tx.commit()
    assert tx.state == "open" and tx_state(broker, tx.transaction_id) == "committed"

    network.heal()
    with pytest.raises(redisq.TransactionDecided) as decided:
        tx.abort()
    assert decided.value.state == "committed" and tx.state == "committed"
    _stored_once(broker, tx, inputs)
    assert consumer.poll(timeout=1.0) == []  # not read again
    consumer.close()
    producer.close()


def test_retried_commit_that_finds_its_input_moved_reports_the_commit(
    broker: redisq.Broker, driver: Any, producer_driver: Any
) -> None:
    """commit()'s decision lands and its reply is lost; while it retries, the input partition
    moves to another member. The retry cannot hold the input any more, but the transaction was
    committed: commit() returns its records, and the new member is not handed the inputs."""
    broker.create_topic("in", partitions=1)
    broker.create_topic("out", partitions=1)
    _fill(broker, "in", 3)
    first = driver.consumer("in", "xf", "m1", **CONSUMER)
    producer = producer_driver.producer("xf", transactional=True, delivery_timeout_ms=30_000)
    inputs = _poll_all(first, 3)
    tx = producer.transaction()
    _transform(tx, first, inputs)
    network = LostReplies(producer_driver, "tx_decide")
    moved = threading.Event()
    handed: list[redisq.Message] = []

    def rebalance() -> None:
        while not network.down:
            time.sleep(0.01)
        first.close()  # m1 leaves; m2 takes the partition
        second = driver.consumer("in", "xf", "m2", **CONSUMER)
        handed.extend(second.poll(timeout=1.0))
        moved.set()
        network.heal()
        second.close()

    thread = threading.Thread(target=rebalance)
    thread.start()
    records = tx.commit()
    thread.join(30)
    assert moved.is_set()
    assert tx.state == "committed" and records == tx.records
    _stored_once(broker, tx, inputs)
    assert handed == []
    producer.close()


def test_late_local_rollback_after_the_check_back_committed(
    broker: redisq.Broker, driver: Any
) -> None:
    """local() takes longer than the first check-back, whose check answers COMMIT: that
    decision stands. local()'s ROLLBACK then gets state COMMIT and the message's record; the
    message is stored once (the mirror of a late COMMIT, which raises TransactionAborted)."""
    broker.create_topic("orders", partitions=2)
    check = Answers(redisq.TxState.COMMIT)

    def slow_local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        deadline = time.monotonic() + 15
        while tx_state(broker, tx_id) != "committed" and time.monotonic() < deadline:
            time.sleep(0.02)
        return redisq.TxState.ROLLBACK

    async def slow_async_local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        deadline = time.monotonic() + 15
        while tx_state(broker, tx_id) != "committed" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return redisq.TxState.ROLLBACK

    local = slow_async_local if driver.name == "async" else slow_local
    with driver.producer(transactional_group="svc", check=check, **CHECKS) as producer:
        result = producer.send_in_transaction("orders", b"created", key="o-1", local=local)
    assert len(check.calls) == 1
    assert result.state is redisq.TxState.COMMIT
    p = redisq.partition_for_key(b"o-1", 2)
    [stored] = list(broker.read("orders", p))
    assert [(r.partition, r.offset) for r in result.records] == [(p, stored.offset)]
    assert values_of(broker, "orders") == [b"created"]


def test_a_transaction_whose_record_expired_cannot_commit(
    broker: redisq.Broker, driver: Any
) -> None:
    """A producer paused for longer than its open transaction's record lives (its timeout plus
    an hour; here the record and staged batches are deleted as their expiry would) still holds
    the batches: its commit is refused (TransactionAborted) and nothing reaches the topic."""
    broker.create_topic("out", partitions=1)
    producer = driver.producer("slow", transactional=True, max_batch_messages=1)
    tx = producer.transaction()
    tx.send("out", b"a", key="k")
    tx.send("out", b"b", key="k")
    keys = broker.keys
    assert broker.client.llen(keys.transaction_messages(tx.transaction_id)) >= 1
    broker.client.delete(
        keys.transaction(tx.transaction_id), keys.transaction_messages(tx.transaction_id)
    )
    with pytest.raises(redisq.TransactionAborted):
        tx.commit()
    assert tx.state == "aborted"
    assert values_of(broker, "out") == []
    producer.close()
