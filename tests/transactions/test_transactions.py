"""Transactions as a user sees them (DESIGN §11), on every backend and through both APIs (the
thread API and the asyncio API behind the same facade, tests/txhelp.py drivers).

Kafka style: a committed transaction appears whole, each message once, in send order per
partition, and nothing of it is visible before the commit (not even what was staged); an aborted
one never appears; `records` point at the stored messages; consume-transform-produce commits the
input positions with the output, and not when an input partition moved away. RocketMQ style:
half messages become visible only on COMMIT (from `local` or from the check-back) and go to the
group's unresolved topic after max_checks UNKNOWN answers. Zombie fencing and the transaction
timeout. Bad input: typed errors before anything is written.

What the tests check is read through a separate sync broker (broker.read, XINFO GROUPS).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest

import redisq
from redisq.model.keys import unresolved_topic
from tests.conftest import wait_until
from tests.txhelp import (
    DRIVERS,
    committed_positions,
    partitions_of,
    registry,
    tx_state,
    values_of,
)

FAST = {"check_interval_ms": 100}  # background duties every 50 ms (sweeper, check-back)
SMALL_BATCHES = {"max_batch_messages": 2}  # a transaction stages while it is being written
# consume-transform-produce acks through the transaction, so auto-commit is off (as in Kafka)
CONSUMER = {"lease_ttl_ms": 1500, "ack_interval_ms": 50, "enable_auto_commit": False}
# Bad input is refused in the client before anything is written: two backends suffice (the
# standalone client and Redis 7.0) instead of the broker fixture's four.
TWO_BACKENDS = pytest.mark.parametrize("backend", ["valkey", "redis"])


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


def tx_keys(broker: redisq.Broker) -> list[str]:
    """Keys of any transaction (record or staged batches) in the namespace."""
    pattern = f"{broker.namespace}:{{~tx:*"
    return sorted(k.decode() for k in broker.client.scan_iter(match=pattern, count=1000))


def staged_batches(broker: redisq.Broker, tx_id: str) -> int:
    return int(broker.client.llen(broker.keys.transaction_messages(tx_id)))


def nothing_visible(broker: redisq.Broker, *topics: str) -> None:
    for topic in topics:
        stored = {p: [m.value for m in ms] for p, ms in partitions_of(broker, topic).items() if ms}
        assert not stored, f"visible in {topic}: {stored}"


def mixed_sends(label: str) -> list[tuple[str, bytes, str | None, dict[str, str] | None]]:
    """12 keyed messages over out's 4 partitions (some with headers: another batch layout) and
    3 unkeyed ones to audit; values unique."""
    sends: list[tuple[str, bytes, str | None, dict[str, str] | None]] = []
    for i in range(12):
        headers = {"n": str(i)} if i % 3 == 0 else None
        sends.append(("out", f"{label}:o{i}".encode(), f"k{i % 8}", headers))
    for i in range(3):
        sends.append(("audit", f"{label}:a{i}".encode(), None, None))
    return sends


def expected_layout(
    sends: list[tuple[str, bytes, str | None, Any]], partitions: dict[str, int]
) -> dict[tuple[str, int], list[bytes]]:
    """Where each message must be: keyed by the documented key hash, unkeyed on audit's only
    partition; in send order per partition."""
    layout: dict[tuple[str, int], list[bytes]] = {}
    for topic, value, key, _ in sends:
        p = redisq.partition_for_key(key.encode(), partitions[topic]) if key is not None else 0
        layout.setdefault((topic, p), []).append(value)
    return layout


# -- Kafka style: atomic visibility ---------------------------------------------------------------


def test_commit_appears_whole_once_in_send_order(broker: redisq.Broker, driver: Any) -> None:
    """15 messages over two topics and five partitions, in batches of two (so most of them are
    staged in Redis before the commit): nothing is visible to a reader or a consumer until the
    commit, then each is stored once, in send order per partition, where records say."""
    broker.create_topic("out", partitions=4)
    broker.create_topic("audit", partitions=1)
    watcher = broker.consumer("out", "watch", "w1", **CONSUMER)
    sends = mixed_sends("t1")
    with driver.producer("enricher", transactional=True, **SMALL_BATCHES) as producer:
        with producer.transaction() as tx:
            for topic, value, key, headers in sends:
                tx.send(topic, value, key=key, headers=headers)
                nothing_visible(broker, "out", "audit")
            assert staged_batches(broker, tx.transaction_id) >= 5, "the test meant to stage"
            assert watcher.poll(timeout=0.3) == []
            nothing_visible(broker, "out", "audit")
        assert tx.state == "committed"

    expected = expected_layout(sends, {"out": 4, "audit": 1})
    for topic in ("out", "audit"):
        for p, messages in partitions_of(broker, topic).items():
            assert [m.value for m in messages] == expected.get((topic, p), []), (topic, p)
    # records: one per send, in send order, each pointing at its stored message
    assert len(tx.records) == len(sends)
    for record, (topic, value, key, headers) in zip(tx.records, sends, strict=True):
        assert (record.topic, record.duplicate) == (topic, False)
        [stored] = list(broker.read(topic, record.partition, start=record.offset, count=1))
        assert stored.offset == record.offset
        assert (stored.value, stored.key) == (value, None if key is None else key.encode())
        assert stored.headers == ({} if headers is None else {"n": headers["n"].encode()})
    # a consumer now gets each of them once
    seen: list[bytes] = []
    while len(seen) < 12:
        batch = watcher.poll(timeout=5)
        assert batch, f"the consumer got only {len(seen)} of 12"
        seen += [m.value for m in batch]
        watcher.ack(batch)
    assert Counter(seen) == Counter(v for t, v, _, _ in sends if t == "out")
    watcher.close()
    assert registry(broker) == [] and staged_batches(broker, tx.transaction_id) == 0


@pytest.mark.parametrize("how", ["exception", "abort"])
def test_aborted_transaction_never_appears(broker: redisq.Broker, driver: Any, how: str) -> None:
    """An exception in the block (re-raised) or tx.abort(): nothing of it is stored, what was
    staged is gone, the decision is final; the producer's next transaction commits alone."""
    broker.create_topic("out", partitions=4)
    broker.create_topic("audit", partitions=1)
    with driver.producer("enricher", transactional=True, **SMALL_BATCHES) as producer:
        with pytest.raises(RuntimeError, match="boom") if how == "exception" else nullcontext():
            with producer.transaction() as tx:
                for topic, value, key, headers in mixed_sends("aborted"):
                    tx.send(topic, value, key=key, headers=headers)
                assert staged_batches(broker, tx.transaction_id) >= 5
                if how == "exception":
                    raise RuntimeError("boom")
                tx.abort()
        assert tx.state == "aborted"
        assert tx_state(broker, tx.transaction_id) == "aborted"
        nothing_visible(broker, "out", "audit")
        assert staged_batches(broker, tx.transaction_id) == 0 and registry(broker) == []
        with pytest.raises(redisq.TransactionAborted):
            tx.commit()

        sends = mixed_sends("next")
        with producer.transaction() as tx2:
            for topic, value, key, headers in sends:
                tx2.send(topic, value, key=key, headers=headers)
    assert sorted(values_of(broker, "out", "audit")) == sorted(v for _, v, _, _ in sends)


def test_ended_transaction_cannot_be_used(broker: redisq.Broker, driver: Any) -> None:
    """After commit (or abort) every call on the transaction raises TransactionAborted and
    writes nothing; one transaction at a time per producer (InvalidConfig)."""
    broker.create_topic("out", partitions=2)
    with driver.producer("enricher", transactional=True) as producer:
        tx = producer.transaction()
        with pytest.raises(redisq.InvalidConfig, match="one at a time"):
            producer.transaction()
        tx.send("out", b"v1", key="k")
        tx.commit()
        for call in (
            lambda: tx.send("out", b"late", key="k"),
            lambda: tx.commit(),
            lambda: tx.abort(),
            lambda: tx.ack(None, []),
        ):
            with pytest.raises(redisq.TransactionAborted):
                call()
        tx2 = producer.transaction()  # the next one may begin now
        tx2.abort()
        with pytest.raises(redisq.TransactionAborted):
            tx2.send("out", b"after abort")
    assert values_of(broker, "out") == [b"v1"]


# A transaction of 2 messages in batches of 2 is all staged (its commit only decides); of 3,
# one message is still to be staged at the commit.
STAGED = pytest.mark.parametrize("sent", [2, 3], ids=["all-staged", "partly-staged"])


def test_timeout_aborts_an_open_transaction(broker: redisq.Broker, driver: Any) -> None:
    """An open transaction past transaction_timeout_ms is aborted by the sweeper (here the
    producer's own background duty): what it staged never appears, and its commit fails."""
    _timed_out(broker, driver, sent=2)


@pytest.mark.parametrize("backend", ["valkey"])
def test_timeout_aborts_a_partly_staged_transaction(broker: redisq.Broker, driver: Any) -> None:
    """The same with a message still to be staged at the commit (its stage is refused)."""
    _timed_out(broker, driver, sent=3)


def _timed_out(broker: redisq.Broker, driver: Any, sent: int) -> None:
    broker.create_topic("out", partitions=2)
    options = {"transaction_timeout_ms": 1000, **FAST, **SMALL_BATCHES}
    with driver.producer("slow", transactional=True, **options) as producer:
        tx = producer.transaction()
        for i in range(sent):
            tx.send("out", f"v{i}", key="k")
        assert staged_batches(broker, tx.transaction_id) == 1
        wait_until(lambda: tx_state(broker, tx.transaction_id) == "aborted", 15, "the sweeper")
        with pytest.raises(redisq.TransactionAborted):
            tx.commit()
        assert tx.state == "aborted"  # ended: the producer may begin the next one
        nothing_visible(broker, "out")
        wait_until(lambda: registry(broker) == [], 15, "the sweeper to finish")
        with producer.transaction() as tx2:
            tx2.send("out", b"next", key="k")
    assert values_of(broker, "out") == [b"next"]


def test_the_timeout_runs_from_the_first_message(broker: redisq.Broker, driver: Any) -> None:
    """transaction_timeout_ms counts from the transaction's first message (Kafka: from its first
    partition), not from its first staged batch: a transaction whose messages still fit one
    batch, so that nothing of it was staged, is aborted past its timeout all the same."""
    broker.create_topic("out", partitions=2)
    options = {"transaction_timeout_ms": 1000, **FAST}
    with driver.producer("slow", transactional=True, **options) as producer:
        tx = producer.transaction()
        tx.send("out", b"v0", key="k")  # less than a batch: nothing staged, nothing registered
        assert staged_batches(broker, tx.transaction_id) == 0
        time.sleep(1.5)  # past the timeout, whatever the server's clock says of it
        with pytest.raises(redisq.TransactionAborted, match="timed out"):
            tx.commit()
        assert tx.state == "aborted"
        with producer.transaction() as tx2:
            tx2.send("out", b"next", key="k")
    assert values_of(broker, "out") == [b"next"]


def test_a_plain_send_while_the_transaction_is_open_is_refused(
    broker: redisq.Broker, api: Any
) -> None:
    """A transactional producer's plain send while its transaction is open would land at once,
    before the transaction's earlier messages of its key: refused (TransactionInProgress), as
    Kafka refuses a transactional producer's send outside its transaction; nothing is written.
    After commit() it sends again."""
    broker.create_topic("out", partitions=1)
    producer = api.broker.producer(name="svc", transactional=True)
    tx = producer.transaction()
    tx.send("out", b"in-tx", key="k")
    with pytest.raises(redisq.TransactionInProgress):
        producer.send("out", b"plain", key="k")
    with pytest.raises(redisq.TransactionInProgress):
        producer.send_async("out", b"plain-async", key="k")
    tx.commit()
    producer.send("out", b"after", key="k")
    producer.close()
    assert values_of(broker, "out") == [b"in-tx", b"after"]


@STAGED
def test_zombie_instance_is_fenced(broker: redisq.Broker, driver: Any, sent: int) -> None:
    """Instance A of "x" has staged (all or part of) a transaction; instance B of "x" starts
    and aborts it. A's commit fails, none of A's messages ever appear, A can write nothing
    more; B's transactions commit."""
    broker.create_topic("out", partitions=2)
    a = driver.producer("x", transactional=True, **SMALL_BATCHES)
    tx = a.transaction()
    for i in range(sent):
        tx.send("out", f"a{i}", key="k")
    assert staged_batches(broker, tx.transaction_id) == 1
    b = driver.producer("x", transactional=True)
    assert tx_state(broker, tx.transaction_id) == "aborted"  # B's start settled it
    with pytest.raises(redisq.TransactionAborted):
        tx.commit()
    assert tx.state == "aborted"
    with pytest.raises(redisq.ProducerFenced):
        a.send("out", b"a-plain", key="k")
    with b.transaction() as tx_b:
        tx_b.send("out", b"b1", key="k")
    nothing_of_a = [v for v in values_of(broker, "out") if v.startswith(b"a")]
    assert nothing_of_a == [] and values_of(broker, "out") == [b"b1"]
    b.close()
    try:
        a.close()
    except redisq.RedisqError:
        pass


def test_zombie_that_staged_nothing_is_fenced_at_commit(broker: redisq.Broker, driver: Any) -> None:
    """A's transaction is still only in A's memory when B starts: A's commit is refused
    (ProducerFenced) and writes nothing."""
    broker.create_topic("out", partitions=2)
    a = driver.producer("x", transactional=True)
    tx = a.transaction()
    tx.send("out", b"a1", key="k")
    b = driver.producer("x", transactional=True)
    with pytest.raises(redisq.ProducerFenced):
        tx.commit()
    assert tx.state == "aborted"
    nothing_visible(broker, "out")
    with b.transaction() as tx_b:
        tx_b.send("out", b"b1", key="k")
    assert values_of(broker, "out") == [b"b1"]
    b.close()
    try:
        a.close()
    except redisq.RedisqError:
        pass


# -- consume-transform-produce --------------------------------------------------------------------


def _fill(broker: redisq.Broker, topic: str, count: int, keys: int = 8) -> list[bytes]:
    """count messages "in<i>" under keys k0..k<keys-1> (k0-k3 and k4-k7 split over 2
    partitions)."""
    values = [f"in{i}".encode() for i in range(count)]
    with broker.producer() as producer:
        for i, value in enumerate(values):
            producer.send(topic, value, key=f"k{i % keys}")
    return values


def test_ctp_input_positions_commit_with_the_output(broker: redisq.Broker, driver: Any) -> None:
    """tx.ack: the group's position moves only when the transaction commits; an aborted one
    leaves it where it was and the consumer is handed the same messages again."""
    broker.create_topic("in", partitions=1)
    broker.create_topic("out", partitions=2)
    inputs = _fill(broker, "in", 12)
    consumer = driver.consumer("in", "xf", "m1", **CONSUMER)
    producer = driver.producer("xf", transactional=True)

    first = consumer.poll(timeout=5, max_messages=4)
    assert first
    with producer.transaction() as tx:
        for m in first:
            tx.send("out", b"out:" + m.value, key=m.key)
        tx.ack(consumer, first)
    last = {m.partition: m.offset for m in first}
    assert {p: committed_positions(broker, "in", "xf")[p] for p in last} == last

    second = consumer.poll(timeout=5, max_messages=4)
    assert second and not {m.offset for m in second} & {m.offset for m in first}
    with pytest.raises(RuntimeError):
        with producer.transaction() as tx:
            for m in second:
                tx.send("out", b"out:" + m.value, key=m.key)
            tx.ack(consumer, second)
            raise RuntimeError("transform failed")
    assert {p: committed_positions(broker, "in", "xf")[p] for p in last} == last
    again = consumer.poll(timeout=5, max_messages=4)
    assert [m.offset for m in again] == [m.offset for m in second]

    done = first
    batch = again
    while batch:
        with producer.transaction() as tx:
            for m in batch:
                tx.send("out", b"out:" + m.value, key=m.key)
            tx.ack(consumer, batch)
        done += batch
        batch = consumer.poll(timeout=0.5, max_messages=4)
    assert sorted(m.value for m in done) == sorted(inputs)
    assert sorted(values_of(broker, "out")) == sorted(b"out:" + v for v in inputs)
    consumer.close()
    producer.close()


def test_ctp_commit_refused_after_the_input_moved(broker: redisq.Broker, driver: Any) -> None:
    """Member A polled both input partitions and acked them in a transaction; B joins and
    takes one of them (and is handed its messages again). A's commit aborts
    (TransactionAborted): none of A's output appears, and in the end every input is in the
    output exactly once."""
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    inputs = _fill(broker, "in", 8)
    a = driver.consumer("in", "xf", "a", **CONSUMER)
    a_producer = driver.producer("xf-a", transactional=True)
    polled: list[Any] = []

    def a_holds_both() -> bool:
        polled.extend(a.poll(timeout=0.5, max_messages=100))
        return {m.partition for m in polled} == {0, 1}

    wait_until(a_holds_both, 15, "A to poll both partitions")
    tx = a_producer.transaction()
    for m in polled:
        tx.send("out", b"A:" + m.value, key=m.key)
    tx.ack(a, polled)

    b = broker.consumer("in", "xf", "b", **CONSUMER)
    b_producer = broker.producer("xf-b", transactional=True)
    taken = wait_until(lambda: b.poll(timeout=0.5), 20, "B to take a partition")
    moved = {m.partition for m in taken}
    assert moved and moved <= set(a.assignment) ^ {0, 1}
    with pytest.raises(redisq.TransactionAborted):
        tx.commit()
    assert not [v for v in values_of(broker, "out") if v.startswith(b"A:")]

    def run(consumer: Any, producer: Any, label: bytes, batch: list[Any]) -> None:
        deadline = time.monotonic() + 30
        while len(values_of(broker, "out")) < len(inputs) and time.monotonic() < deadline:
            if batch:
                with producer.transaction() as t:
                    for m in batch:
                        t.send("out", label + m.value, key=m.key)
                    t.ack(consumer, batch)
            batch = consumer.poll(timeout=0.2)

    thread = threading.Thread(target=run, args=(b, b_producer, b"B:", taken))
    thread.start()
    run(a, a_producer, b"A:", [])
    thread.join(40)
    out = values_of(broker, "out")
    assert Counter(v.split(b":", 1)[1] for v in out) == Counter(inputs), out
    for consumer, producer in ((a, a_producer), (b, b_producer)):
        consumer.close()
        producer.close()


@TWO_BACKENDS
def test_tx_ack_needs_an_orderly_consumer(broker: redisq.Broker, driver: Any) -> None:
    broker.create_topic("in", partitions=1)
    _fill(broker, "in", 2)
    consumer = driver.consumer("in", "cc", "c1", mode="concurrent", **CONSUMER)
    messages = wait_until(lambda: consumer.poll(timeout=1), 10, "messages")
    with driver.producer("xf", transactional=True) as producer:
        with pytest.raises(redisq.InvalidConfig, match="orderly"):
            with producer.transaction() as tx:
                tx.ack(consumer, messages)
    consumer.close()
    assert registry(broker) == []


# -- RocketMQ style: half messages ----------------------------------------------------------------

CHECKS = {"check_first_ms": 200, "check_interval_ms": 100}


class Answers:
    """A local/check function with a fixed answer that records its calls."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[str, list[redisq.TxMessage]]] = []

    def __call__(self, tx_id: str, messages: list[redisq.TxMessage]) -> Any:
        self.calls.append((tx_id, messages))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_half_message_committed_by_local(broker: redisq.Broker, driver: Any) -> None:
    broker.create_topic("orders", partitions=4)
    local, check = Answers(redisq.TxState.COMMIT), Answers(redisq.TxState.ROLLBACK)
    with driver.producer(
        "orders-svc", transactional_group="svc", check=check, **CHECKS
    ) as producer:
        result = producer.send_in_transaction(
            "orders", b"created", key="order-42", headers={"h": "1"}, local=local
        )
    assert result.state is redisq.TxState.COMMIT
    [(tx_id, messages)] = local.calls
    assert tx_id == result.transaction_id
    p = redisq.partition_for_key(b"order-42", 4)
    assert messages == [redisq.TxMessage("orders", p, b"order-42", b"created", {"h": b"1"})]
    [record] = result.records
    [stored] = list(broker.read("orders", p))
    assert (record.topic, record.partition, record.offset) == ("orders", p, stored.offset)
    assert (stored.value, stored.key, stored.headers) == (b"created", b"order-42", {"h": b"1"})
    assert values_of(broker, "orders") == [b"created"] and check.calls == []


def test_half_message_rolled_back_by_local(broker: redisq.Broker, driver: Any) -> None:
    broker.create_topic("orders", partitions=2)
    check = Answers(redisq.TxState.COMMIT)
    with driver.producer(transactional_group="svc", check=check, **CHECKS) as producer:
        result = producer.send_in_transaction(
            "orders", b"created", key="order-1", local=Answers(redisq.TxState.ROLLBACK)
        )
        assert (result.state, result.records) == (redisq.TxState.ROLLBACK, ())
        assert tx_state(broker, result.transaction_id) == "aborted"
    nothing_visible(broker, "orders")
    assert check.calls == [] and registry(broker) == []


@pytest.mark.parametrize(
    "answer", [redisq.TxState.UNKNOWN, RuntimeError("db down"), None, "yes"], ids=repr
)
def test_undecided_half_message_waits_for_check_back(
    broker: redisq.Broker, driver: Any, answer: Any
) -> None:
    """local answers UNKNOWN (or raises, or answers something that is not a TxState): the
    message stays invisible until the check-back asks `check` (with the transaction id and the
    message) and it answers COMMIT; then it is stored once."""
    broker.create_topic("orders", partitions=2)
    check = Answers(redisq.TxState.COMMIT)
    with driver.producer(transactional_group="svc", check=check, **CHECKS) as producer:
        result = producer.send_in_transaction("orders", b"created", local=Answers(answer))
        assert (result.state, result.records) == (redisq.TxState.UNKNOWN, ())
        nothing_visible(broker, "orders")
        wait_until(lambda: values_of(broker, "orders"), 15, "the check-back's commit")
        assert [tx_id for tx_id, _ in check.calls] == [result.transaction_id]
        assert [m.value for m in check.calls[0][1]] == [b"created"]
        wait_until(lambda: registry(broker) == [], 15, "the check-back to finish")
    assert values_of(broker, "orders") == [b"created"]


def test_an_undecided_half_message_waits_three_days_for_its_group(
    broker: redisq.Broker, driver: Any
) -> None:
    """No member of the group is left to check back (the service is down): the half message
    and its record are kept 72 h past the last check-back (RocketMQ's half-topic retention),
    not one hour, and a member that comes back within that commits it."""
    broker.create_topic("orders", partitions=2)
    with driver.producer(transactional_group="svc", check=Answers(redisq.TxState.UNKNOWN),
                         check_first_ms=1_000) as producer:  # fmt: skip
        half = producer.send_in_transaction(
            "orders", b"created", local=Answers(redisq.TxState.UNKNOWN)
        )
    client, keys = broker.client, broker.keys
    day = 24 * 3600 * 1000
    for key in (
        keys.transaction(half.transaction_id),
        keys.transaction_messages(half.transaction_id),
    ):
        assert client.pttl(key) > 3 * day, key
    check = Answers(redisq.TxState.COMMIT)
    with driver.producer(transactional_group="svc", check=check, **CHECKS):
        wait_until(lambda: values_of(broker, "orders") == [b"created"], 15, "the commit")
    assert [tx_id for tx_id, _ in check.calls][:1] == [half.transaction_id]


def test_check_back_rollback_discards(broker: redisq.Broker, driver: Any) -> None:
    broker.create_topic("orders", partitions=2)
    check = Answers(redisq.TxState.ROLLBACK)
    with driver.producer(transactional_group="svc", check=check, **CHECKS) as producer:
        result = producer.send_in_transaction(
            "orders", b"created", local=Answers(redisq.TxState.UNKNOWN)
        )
        wait_until(lambda: tx_state(broker, result.transaction_id) == "aborted", 15, "rollback")
    nothing_visible(broker, "orders")
    assert len(check.calls) == 1


def test_late_local_commit_loses_to_the_check_back(broker: redisq.Broker, driver: Any) -> None:
    """local takes longer than the first check-back, whose check answers ROLLBACK: the
    decision is the check-back's, for good. local's COMMIT then fails (TransactionAborted)
    and the message never appears."""
    broker.create_topic("orders", partitions=2)
    check = Answers(redisq.TxState.ROLLBACK)

    def slow_local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        wait_until(lambda: tx_state(broker, tx_id) == "aborted", 15, "the check-back")
        return redisq.TxState.COMMIT

    async def slow_async_local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        # (a plain function would block the event loop, and the check-back with it)
        deadline = time.monotonic() + 15
        while tx_state(broker, tx_id) != "aborted" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return redisq.TxState.COMMIT

    local = slow_async_local if driver.name == "async" else slow_local
    with driver.producer(transactional_group="svc", check=check, **CHECKS) as producer:
        with pytest.raises(redisq.TransactionAborted):
            producer.send_in_transaction("orders", b"created", local=local)
    assert len(check.calls) == 1
    nothing_visible(broker, "orders")


def test_check_back_gives_up_into_the_unresolved_topic(broker: redisq.Broker, driver: Any) -> None:
    """max_checks UNKNOWN answers: the half message moves to `<group>~unresolved` (value, key,
    headers, plus where it was headed) and never reaches its topic; check is asked no more."""
    broker.create_topic("orders", partitions=4)
    check = Answers(redisq.TxState.UNKNOWN)
    options = {**CHECKS, "max_checks": 3}
    with driver.producer(transactional_group="svc", check=check, **options) as producer:
        result = producer.send_in_transaction(
            "orders", b"created", key="order-7", headers={"h": "v"}, local=Answers("unknown")
        )
        topic = unresolved_topic("svc")
        wait_until(lambda: topic in broker.list_topics() and values_of(broker, topic), 15, topic)
        assert len(check.calls) == 3
        wait_until(lambda: registry(broker) == [], 15, "the check-back to finish")
    [moved] = partitions_of(broker, topic)[0]
    assert (moved.value, moved.key) == (b"created", b"order-7")
    assert moved.headers == {
        "h": b"v",
        "redisq.tx": result.transaction_id.encode(),
        "redisq.topic": b"orders",
        "redisq.partition": str(redisq.partition_for_key(b"order-7", 4)).encode(),
    }
    nothing_visible(broker, "orders")
    assert len(check.calls) == 3


def test_async_local_and_check(broker: redisq.Broker, server_url: str) -> None:
    """The asyncio producer also takes coroutine functions for local and check."""
    drv = DRIVERS["async"](server_url, broker.namespace)
    broker.create_topic("orders", partitions=2)
    calls: list[str] = []

    async def local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        await asyncio.sleep(0)
        calls.append("local")
        return redisq.TxState.UNKNOWN

    async def check(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        await asyncio.sleep(0)
        calls.append("check")
        return redisq.TxState.COMMIT

    try:
        with drv.producer(transactional_group="svc", check=check, **CHECKS) as producer:
            producer.send_in_transaction("orders", b"async", local=local)
            wait_until(lambda: values_of(broker, "orders"), 15, "the async check-back")
    finally:
        drv.close()
    assert calls == ["local", "check"] and values_of(broker, "orders") == [b"async"]


@pytest.mark.parametrize("backend", ["redis"])  # the client's own task handling
def test_async_close_stops_a_check_that_swallows_cancellation(
    broker: redisq.Broker, server_url: str
) -> None:
    """close() of an asyncio producer ends its background duties even when the check function
    swallows the cancellation (a check in an await when close() comes): close returns, and no
    check runs after it."""
    import redisq.asyncio as rq

    broker.create_topic("orders", partitions=2)
    calls: list[float] = []

    async def check(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        calls.append(time.monotonic())
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # swallowed: a careless check
        return redisq.TxState.UNKNOWN

    async def scenario() -> float:
        async_broker = await rq.connect(server_url, namespace=broker.namespace)
        try:
            producer = async_broker.producer(transactional_group="svc", check=check, **CHECKS)
            await producer.send_in_transaction(
                "orders", b"unknown", local=lambda tx_id, messages: redisq.TxState.UNKNOWN
            )
            while not calls:  # the check-back is running (and awaiting)
                await asyncio.sleep(0.05)
            started = time.monotonic()
            await producer.close()
            closed = time.monotonic()
            await asyncio.sleep(1)  # several check intervals: none may start now
            assert [c for c in calls if c > closed] == []
            return closed - started
        finally:
            await async_broker.close()

    elapsed: list[float] = []
    # Its own thread: a close() that never returns fails the test instead of hanging it.
    runner = threading.Thread(target=lambda: elapsed.append(asyncio.run(scenario())), daemon=True)
    runner.start()
    runner.join(45)
    assert not runner.is_alive(), "close() did not return"
    assert elapsed and elapsed[0] < 10
    nothing_visible(broker, "orders")


# -- bad input ------------------------------------------------------------------------------------


def _check(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
    return redisq.TxState.ROLLBACK


GROUP_OK = {"transactional_group": "g", "check": _check}


def _param_id(value: Any) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): names of
    types and functions, not their reprs."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, dict):
        return str({k: getattr(v, "__name__", v) for k, v in value.items()})
    return str(value)


@TWO_BACKENDS
@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        (None, {"transactional": True}, redisq.InvalidConfig),
        ("x", {"transactional": "yes"}, TypeError),
        (None, {"transactional_group": "svc"}, redisq.InvalidConfig),
        (None, {"check": _check}, redisq.InvalidConfig),
        (None, {"transactional_group": "svc", "check": "commit"}, TypeError),
        (None, {"transactional_group": "bad name", "check": _check}, redisq.InvalidName),
        ("x", {"transactional": True, "transaction_timeout_ms": 10}, redisq.InvalidConfig),
        ("x", {"transactional": True, "transaction_timeout_ms": "1s"}, TypeError),
        (None, {**GROUP_OK, "max_checks": 0}, redisq.InvalidConfig),
        (None, {**GROUP_OK, "check_first_ms": 1}, redisq.InvalidConfig),
        (None, {**GROUP_OK, "check_interval_ms": "often"}, TypeError),
    ],
    ids=lambda v: _param_id(v),
)  # fmt: skip
def test_bad_producer_options(
    broker: redisq.Broker, driver: Any, name: str | None, options: dict[str, Any], error: type
) -> None:
    with pytest.raises(error):
        driver.producer(name, **options)
    assert tx_keys(broker) == [] and registry(broker) == []


@TWO_BACKENDS
def test_wrong_style_is_refused(broker: redisq.Broker, driver: Any) -> None:
    """transaction() needs transactional=True, send_in_transaction() a transactional group."""
    broker.create_topic("out", partitions=1)
    local = Answers(redisq.TxState.COMMIT)
    with driver.producer("plain") as plain:
        with pytest.raises(redisq.InvalidConfig):
            plain.transaction()
        with pytest.raises(redisq.InvalidConfig):
            plain.send_in_transaction("out", b"v", local=local)
    with driver.producer("kafka", transactional=True) as kafka:
        with pytest.raises(redisq.InvalidConfig):
            kafka.send_in_transaction("out", b"v", local=local)
    with driver.producer(transactional_group="svc", check=_check) as group:
        with pytest.raises(redisq.InvalidConfig):
            group.transaction()
    assert local.calls == [] and tx_keys(broker) == [] and values_of(broker, "out") == []


@TWO_BACKENDS
@pytest.mark.parametrize(
    ("send", "error"),
    [
        ({"topic": "missing", "value": b"v"}, redisq.TopicNotFound),
        ({"topic": "out", "value": 42}, TypeError),
        ({"topic": "out", "value": b"v", "key": 3.5}, TypeError),
        ({"topic": "out", "value": b"v", "headers": {"h": 1}}, TypeError),
        ({"topic": "out", "value": b"v", "partition": 7}, redisq.PartitionOutOfRange),
        ({"topic": "out", "value": b"x" * 2048}, redisq.MessageTooLarge),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_bad_send_in_transaction_stages_nothing(
    broker: redisq.Broker, driver: Any, send: dict[str, Any], error: type
) -> None:
    """A bad message is refused by tx.send with a typed error before anything is written; the
    transaction goes on and commits only its good messages."""
    broker.create_topic("out", partitions=2)
    with driver.producer(
        "x", transactional=True, max_batch_messages=1, max_message_bytes=1024
    ) as p:
        with p.transaction() as tx:
            send = dict(send)
            topic, value = send.pop("topic"), send.pop("value")
            with pytest.raises(error):
                tx.send(topic, value, **send)
            assert tx_keys(broker) == [] and values_of(broker, "out") == []
            tx.send("out", b"good", key="k")
    assert values_of(broker, "out") == [b"good"]


@TWO_BACKENDS
@pytest.mark.parametrize(
    ("send", "error"),
    [
        ({"topic": "missing", "value": b"v", "local": _check}, redisq.TopicNotFound),
        ({"topic": "out", "value": 42, "local": _check}, TypeError),
        ({"topic": "out", "value": b"v", "key": 1, "local": _check}, TypeError),
        ({"topic": "out", "value": b"v", "local": None}, TypeError),
        ({"topic": "out", "value": b"v", "local": "commit"}, TypeError),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_bad_half_message_is_refused(
    broker: redisq.Broker, driver: Any, send: dict[str, Any], error: type
) -> None:
    broker.create_topic("out", partitions=2)
    with driver.producer(transactional_group="svc", check=_check) as producer:
        send = dict(send)
        topic, value = send.pop("topic"), send.pop("value")
        with pytest.raises(error):
            producer.send_in_transaction(topic, value, **send)
    assert tx_keys(broker) == [] and registry(broker) == [] and values_of(broker, "out") == []
