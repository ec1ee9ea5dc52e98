"""Transaction gaps found by an adversarial test (both APIs, tests/txhelp.py drivers):

- tx.ack of messages polled under an earlier lease of the partition (it moved to another member
  and came back) is refused (LeaseLost) instead of being dropped without a word, which let the
  transaction commit its output without the input position: every input handled twice;
- a fenced (zombie) instance of a named producer cannot commit a transaction that only acks,
  nor an empty one (ProducerFenced): the zombie's acks would have moved the group's position;
- once commit() was called, nothing more can be sent or acked in the transaction (a decision
  stored before the error is what the transaction is): a send after a commit whose reply was
  lost was refused by Redis and reported as an abort of a committed transaction.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from redisq.consume.deadletter import release_key
from tests.conftest import wait_until
from tests.consume.test_foreign_entries import FOREIGN, xadd
from tests.history.proxy import Proxy
from tests.servers import ServerProcess
from tests.txhelp import DRIVERS, committed_positions, tx_state, values_of

# consume-transform-produce acks through the transaction, so auto-commit is off (as in Kafka)
CONSUMER = {"lease_ttl_ms": 1500, "ack_interval_ms": 50, "enable_auto_commit": False}


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


def three_inputs(broker: redisq.Broker) -> None:
    broker.create_topic("in", partitions=1)
    broker.create_topic("out", partitions=1)
    with broker.producer() as producer:
        for value in (b"a", b"b", b"c"):
            producer.send("in", value, key="k")


def another_member_handles_it(driver: Any, m1: Any) -> Any:
    """m0 joins (it sorts first: the partition is its share), transforms and commits what is
    there, and leaves: the partition comes back to m1 under a new lease. Returns m0's
    producer."""
    m0 = driver.consumer("in", "g", "m0", **CONSUMER)
    producer0 = driver.producer("xf0", transactional=True)
    taken = wait_until(lambda: m0.poll(timeout=0.5, max_messages=10), 20, "m0 to take it")
    with producer0.transaction() as tx0:
        for m in taken:
            tx0.send("out", b"m0:" + m.value, key=m.key)
        tx0.ack(m0, taken)
    m0.close()
    wait_until(lambda: m1.assignment == [0], 20, "the partition back with m1")
    return producer0


def test_tx_ack_of_messages_from_an_earlier_lease_is_refused(
    broker: redisq.Broker, driver: Any
) -> None:
    """m1 polls a, b, c; the partition moves to m0, which transforms and commits them, then
    leaves; the partition comes back to m1. m1's transaction of the messages it polled before
    fails (LeaseLost at tx.ack, the transaction aborted) and writes nothing: each input is in
    the output once."""
    three_inputs(broker)
    m1 = driver.consumer("in", "g", "m1", **CONSUMER)
    producer1 = driver.producer("xf1", transactional=True)
    polled = m1.poll(timeout=5, max_messages=10)
    assert [m.value for m in polled] == [b"a", b"b", b"c"]

    producer0 = another_member_handles_it(driver, m1)

    with pytest.raises(redisq.LeaseLost):
        with producer1.transaction() as tx1:
            for m in polled:
                tx1.send("out", b"m1:" + m.value, key=m.key)
            tx1.ack(m1, polled)
    assert tx1.state == "aborted"
    assert values_of(broker, "out") == [b"m0:a", b"m0:b", b"m0:c"]
    assert m1.poll(timeout=0.5) == []  # nothing is read again: m0 committed all three
    for closing in (m1, producer0, producer1):
        closing.close()


def test_tx_ack_leaves_no_gap(broker: redisq.Broker, driver: Any) -> None:
    """Acks that skip a message (c without b, in one call or a later one; b and c without a)
    would commit a position short of what the transaction acked, and the skipped message's
    successors would be handled again: refused before anything changes (InvalidConfig); in
    order they go through and the position covers them all."""
    three_inputs(broker)
    consumer = driver.consumer("in", "g", "m1", **CONSUMER)
    producer = driver.producer("xf", transactional=True)
    a, b, c = consumer.poll(timeout=5, max_messages=10)
    with producer.transaction() as tx:
        with pytest.raises(redisq.InvalidConfig, match="in order"):
            tx.ack(consumer, [b, c])
        with pytest.raises(redisq.InvalidConfig, match="in order"):
            tx.ack(consumer, [a, c])
        tx.ack(consumer, [a])
        with pytest.raises(redisq.InvalidConfig, match="in order"):
            tx.ack(consumer, [c])
        tx.ack(consumer, [b, c])
        tx.send("out", b"abc")
    assert committed_positions(broker, "in", "g") == {0: c.offset}
    assert consumer.poll(timeout=0.5) == []
    consumer.close()
    producer.close()


@pytest.mark.parametrize("acked_by", ["ack", "auto-commit", "transaction"])
def test_tx_ack_of_messages_acked_already_says_so(
    broker: redisq.Broker, driver: Any, acked_by: str
) -> None:
    """a and b were acknowledged under the consumer's lease (by ack(), by the auto-commit of the
    next poll(), or by a committed transaction): a transaction acking them again is refused with
    AlreadyAcked (not LeaseLost: the lease is held), the transaction aborts, nothing is written
    and the group's position stays where the first acknowledgement put it."""
    three_inputs(broker)
    settings = {**CONSUMER, "enable_auto_commit": acked_by == "auto-commit"}
    consumer = driver.consumer("in", "g", "m1", **settings)
    producer = driver.producer("xf", transactional=True)
    a, b = consumer.poll(timeout=5, max_messages=2)
    if acked_by == "ack":
        consumer.ack([a, b])
    elif acked_by == "transaction":
        with producer.transaction() as first:
            first.send("out", b"ab")
            first.ack(consumer, [a, b])
    (c,) = consumer.poll(timeout=5, max_messages=10)  # auto-commit: a and b acked here
    before = committed_positions(broker, "in", "g")
    with pytest.raises(redisq.AlreadyAcked, match="acknowledged already"):
        with producer.transaction() as tx:
            tx.send("out", b"again")
            tx.ack(consumer, [a, b])
    assert tx.state == "aborted"
    assert values_of(broker, "out") == ([b"ab"] if acked_by == "transaction" else [])
    assert committed_positions(broker, "in", "g") == before
    with producer.transaction() as tx:  # c, still unacked, goes through
        tx.send("out", b"c")
        tx.ack(consumer, [c])
    assert committed_positions(broker, "in", "g") == {0: c.offset}
    consumer.close()
    producer.close()


def test_a_transaction_that_acked_under_a_lost_lease_cannot_commit(
    broker: redisq.Broker, driver: Any
) -> None:
    """tx1 acks a, b, c under m1's lease; the partition moves to m0, which handles and commits
    them, and comes back to m1, which polls a new message d: acking d in tx1 is refused
    (LeaseLost) and tx1 commits nothing (before, it committed under the new lease: a, b, c
    handled twice)."""
    three_inputs(broker)
    m1 = driver.consumer("in", "g", "m1", **CONSUMER)
    producer1 = driver.producer("xf1", transactional=True)
    polled = m1.poll(timeout=5, max_messages=10)
    tx1 = producer1.transaction()
    for m in polled:
        tx1.send("out", b"m1:" + m.value, key=m.key)
    tx1.ack(m1, polled)

    producer0 = another_member_handles_it(driver, m1)
    with broker.producer() as plain:
        plain.send("in", b"d", key="k")
    d = wait_until(lambda: m1.poll(timeout=0.5, max_messages=10), 10, "m1 to poll d")
    assert [m.value for m in d] == [b"d"]
    with pytest.raises(redisq.LeaseLost, match="earlier lease"):
        tx1.ack(m1, d)
    with pytest.raises(redisq.TransactionAborted):
        tx1.commit()
    assert values_of(broker, "out") == [b"m0:a", b"m0:b", b"m0:c"]
    again = m1.poll(timeout=2, max_messages=10)  # the partition is not stuck in tx1
    assert [m.value for m in again] == [b"d"]  # handed out again after the abort
    with producer1.transaction() as tx2:
        tx2.send("out", b"m1:d")
        tx2.ack(m1, again)
    assert values_of(broker, "out") == [b"m0:a", b"m0:b", b"m0:c", b"m1:d"]
    for closing in (m1, producer0, producer1):
        closing.close()


@pytest.mark.parametrize("what", ["acks only", "empty"])
def test_zombie_cannot_commit_a_transaction_without_sends(
    broker: redisq.Broker, driver: Any, what: str
) -> None:
    """Instance B of "x" started: A's transaction that only acks inputs (or does nothing) is
    refused (ProducerFenced) and the group's position does not move."""
    three_inputs(broker)
    consumer = driver.consumer("in", "g", "m1", **CONSUMER)
    a = driver.producer("x", transactional=True)
    with a.transaction() as first:
        first.send("out", b"before")
    b = driver.producer("x", transactional=True)
    polled = consumer.poll(timeout=5, max_messages=10)
    assert polled
    with pytest.raises(redisq.ProducerFenced):
        with a.transaction() as tx:
            if what == "acks only":
                tx.ack(consumer, polled)
    assert tx.state == "aborted"
    assert committed_positions(broker, "in", "g").get(0) in (None, "0-0")
    assert values_of(broker, "out") == [b"before"]
    with b.transaction() as tx_b:  # the new instance is not held up
        tx_b.ack(consumer, consumer.poll(timeout=2, max_messages=10) or polled)
    consumer.close()
    b.close()
    try:
        a.close()
    except redisq.RedisqError:
        pass


@pytest.mark.parametrize("api", sorted(DRIVERS))
def test_nothing_is_added_after_a_commit_whose_answer_was_lost(
    proxied: tuple[ServerProcess, Proxy], api: str
) -> None:
    """commit()'s decision lands, its answer is lost and the network stays down past
    delivery_timeout_ms: commit() raises, the transaction is open in the client. A send (or
    ack) then is refused (InvalidConfig) and changes nothing; commit() again completes the
    transaction as it was decided: its messages once, the input position with them."""
    server, proxy = proxied
    namespace = f"txi{time.monotonic_ns() % 10**9}"
    direct = redisq.connect(server.url, namespace=namespace)
    via_direct = DRIVERS[api](server.url, namespace)
    via_proxy = DRIVERS[api](proxy.url, namespace)
    consumer = producer = None
    try:
        direct.create_topic("in", partitions=1)
        direct.create_topic("out", partitions=1)
        with direct.producer() as plain:
            for value in (b"a", b"b"):
                plain.send("in", value, key="k")
        consumer = via_direct.consumer("in", "g", "m1", lease_ttl_ms=5000, ack_interval_ms=50)
        producer = via_proxy.producer("xf", transactional=True, delivery_timeout_ms=1500)
        polled = consumer.poll(timeout=5, max_messages=10)
        assert [m.value for m in polled] == [b"a", b"b"]
        tx = producer.transaction()
        for m in polled:
            tx.send("out", b"out:" + m.value, key=m.key)
        tx.ack(consumer, polled)

        direct.scripts.load_all()  # the held call must run, not meet NOSCRIPT
        decide = direct.scripts["tx_decide"].sha.encode()
        proxy.trap(decide)
        errors: list[BaseException] = []

        def commit() -> None:
            try:
                tx.commit()
            except BaseException as exc:  # noqa: BLE001 - looked at below
                errors.append(exc)

        committing = threading.Thread(target=commit)
        committing.start()
        wait_until(lambda: proxy.holds_for_server(decide), 10, "the decision held")
        proxy.lose_answers(decide)
        proxy.wait_released(5)
        proxy.blackhole()
        while committing.is_alive():  # the network stays down: every connection reset
            proxy.reset_all()
            committing.join(0.05)
        assert len(errors) == 1 and isinstance(errors[0], redisq.RedisqError), errors
        assert tx.state == "open" and tx_state(direct, tx.transaction_id) == "committed"

        proxy.pass_through()
        with pytest.raises(redisq.InvalidConfig, match="commit"):
            tx.send("out", b"extra")
        with pytest.raises(redisq.InvalidConfig, match="commit"):
            tx.ack(consumer, polled)
        records = tx.commit()
        assert tx.state == "committed" and len(records) == 2
        assert values_of(direct, "out") == [b"out:a", b"out:b"]
        wait_until(
            lambda: committed_positions(direct, "in", "g").get(0) == polled[-1].offset,
            10, "the input position committed",
        )  # fmt: skip
        assert consumer.poll(timeout=0.5) == []  # the inputs are not read again
    finally:
        for closing in (consumer, producer):
            if closing is not None:
                try:
                    closing.close()
                except redisq.RedisqError:
                    pass
        via_proxy.close()
        via_direct.close()
        direct.close()


def test_a_refused_ack_leaves_the_other_partitions_usable(
    broker: redisq.Broker, driver: Any
) -> None:
    """tx1 acks p0's messages; p0 moves to m0 and comes back; one tx.ack of a new p0 message
    and p1's messages is refused (LeaseLost) and tx1 aborts: p1's messages are handed out
    again and a new transaction commits them (before, p1 stayed marked as in tx1: its
    transactions failed and its plain commits waited)."""
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=1)
    with broker.producer() as plain:
        for partition in (0, 1):
            plain.send("in", f"p{partition}".encode(), partition=partition)
    m1 = driver.consumer("in", "g", "m1", **CONSUMER)
    producer1 = driver.producer("xf1", transactional=True)
    polled: list[Any] = []

    def both_polled() -> bool:
        polled.extend(m1.poll(timeout=0.5, max_messages=10))
        return {m.partition for m in polled} == {0, 1}

    wait_until(both_polled, 15, "m1 to poll both partitions")
    p0 = [m for m in polled if m.partition == 0]
    p1 = [m for m in polled if m.partition == 1]
    tx1 = producer1.transaction()
    tx1.ack(m1, p0)

    m0 = driver.consumer("in", "g", "m0", **CONSUMER)  # sorts first: p0 is its share
    wait_until(lambda: m0.poll(timeout=0.5, max_messages=10), 20, "m0 to take p0")
    m0.close()
    wait_until(lambda: sorted(m1.assignment) == [0, 1], 20, "p0 back with m1")
    with broker.producer() as plain:
        plain.send("in", b"p0-new", partition=0)
    new = wait_until(lambda: m1.poll(timeout=0.5, max_messages=10), 10, "m1 to poll p0-new")
    with pytest.raises(redisq.LeaseLost, match="earlier lease"):
        tx1.ack(m1, [*new, *p1])
    with pytest.raises(redisq.TransactionAborted):
        tx1.commit()
    again: list[Any] = []
    wait_until(lambda: again.extend(m1.poll(timeout=0.5, max_messages=10)) or any(
        m.partition == 1 for m in again), 10, "p1's message handed out again")  # fmt: skip
    assert [m.value for m in again if m.partition == 1] == [b"p1"]
    with producer1.transaction() as tx2:
        tx2.send("out", b"did p1")
        tx2.ack(m1, [m for m in again if m.partition == 1])
    assert committed_positions(broker, "in", "g")[1] == p1[-1].offset
    m1.close()
    producer1.close()


def fk1_parked(broker: redisq.Broker, *values: bytes) -> None:
    """Topics "in" and "out"; on "in", n0 (key fk1), a malformed entry of key fk1 and then
    `values` (fk1, then "other"); a run() member of group g with policy park_key handles n0,
    parks fk1 at the malformed entry, holds what follows of fk1, handles the rest, and leaves."""
    broker.create_topic("in", partitions=1)
    broker.create_topic("out", partitions=1)
    with broker.producer() as plain:
        plain.send("in", b"n0", key="fk1")
        xadd(broker, "in", 0, FOREIGN["non-numeric producer id"])  # key fk1: parks it
        plain.send("in", values[0], key="fk1")  # held behind the parked key
        for value in values[1:]:
            plain.send("in", value, key="other")
    handled: list[bytes] = []
    runner = broker.consumer("in", "g", "m0", failure_policy="park_key", **CONSUMER)
    thread = threading.Thread(target=runner.run, args=(lambda m: handled.append(m.value),))
    thread.start()
    want = [b"n0", *values[1:]]
    wait_until(lambda: handled == want, 10, f"{want} handled, fk1 parked")
    runner.close()
    thread.join(10)


@pytest.mark.parametrize("policy", ["park_key", "dead_letter"])
def test_a_released_held_message_is_acked_outside_transactions(
    broker: redisq.Broker, driver: Any, policy: str
) -> None:
    """A message held behind a parked key and released after the position passed it: its ack
    is a record (no longer held), not a position, so a transaction cannot carry it (it would be
    recorded even if the transaction aborts, and never handed out again): InvalidConfig, and
    consumer.ack() takes it. A member whose own policy is not park_key honours the group's
    parked key too (before, it ignored it and never handed the held message out)."""
    fk1_parked(broker, b"n1", b"n2")
    # The group's parked keys hold whatever the policy of the member that owns the partition.
    consumer = driver.consumer("in", "g", "m1", failure_policy=policy, **CONSUMER)
    producer = driver.producer("xf", transactional=True)
    assert consumer.poll(timeout=1, max_messages=10) == []  # n1 is held
    assert release_key(broker, "in", "g", "fk1") == 1
    released = wait_until(lambda: consumer.poll(timeout=0.5, max_messages=10), 10, "n1 again")
    assert [m.value for m in released] == [b"n1"]
    with pytest.raises(redisq.InvalidConfig, match="parked"):
        with producer.transaction() as tx:
            tx.send("out", b"from n1")
            tx.ack(consumer, released)
    assert values_of(broker, "out") == []
    consumer.ack(released)
    consumer.close()
    producer.close()


def h1_held_and_n3_polled(broker: redisq.Broker, driver: Any) -> tuple[Any, Any, list[Any]]:
    """fk1 parked (fk1_parked), then h1 (fk1) and n3 (other) sent; m1 (no plain commit before
    close) polls n3 only. Returns m1, a transactional producer and what m1 polled."""
    fk1_parked(broker, b"n1", b"n2")
    with broker.producer() as plain:
        plain.send("in", b"h1", key="fk1")
        plain.send("in", b"n3", key="other")
    consumer = driver.consumer("in", "g", "m1", **{**CONSUMER, "ack_interval_ms": 600_000})
    producer = driver.producer("xf", transactional=True)
    polled = wait_until(lambda: consumer.poll(timeout=0.5, max_messages=10), 10, "n3")
    assert [m.value for m in polled] == [b"n3"]  # n1 and h1 held behind fk1
    return consumer, producer, polled


def released_once_fk1_is(broker: redisq.Broker, consumer: Any) -> list[bytes]:
    """Release fk1; what `consumer` polls until two messages came (15 s at most)."""
    assert release_key(broker, "in", "g", "fk1") == 1
    got: list[bytes] = []

    def released() -> bool:
        got.extend(m.value for m in consumer.poll(timeout=0.3, max_messages=10))
        return len(got) >= 2

    wait_until(released, 15, "n1 and h1 handed out once fk1 is released")
    return got


def test_a_held_message_the_transaction_passes_survives_the_lease(
    broker: redisq.Broker, driver: Any
) -> None:
    """fk1 is parked. m1 polls h1 (fk1: held back) and n3 and commits a transaction that acks
    n3: its position passes h1. Then m1 loses its lease before any plain commit (its key
    expires: a pause longer than the TTL; here deleted, as the expiry would). h1 is not lost:
    the transaction's hold recorded it as held, so once fk1 is released, the partition's next
    grant hands it out (before, only the next plain commit recorded it: h1 was never handed
    out)."""
    consumer, producer, polled = h1_held_and_n3_polled(broker, driver)
    with producer.transaction() as tx:
        tx.send("out", b"from n3", key="other")
        tx.ack(consumer, polled)
    assert committed_positions(broker, "in", "g")[0] == polled[0].offset  # past h1
    broker.client.delete(broker.keys.lease("in", 0, "g"))  # m1's lease ran out
    assert released_once_fk1_is(broker, consumer) == [b"n1", b"h1"]
    assert values_of(broker, "out") == [b"from n3"]
    consumer.close()
    producer.close()


def test_a_held_message_survives_an_aborted_transaction_that_passed_it(
    broker: redisq.Broker, driver: Any
) -> None:
    """As above, but m1's transaction aborts: n3 is polled again and acked outside any
    transaction, and m1 leaves (its commit passes h1). h1 is still recorded as held: once fk1
    is released, the next member hands it out."""
    consumer, producer, polled = h1_held_and_n3_polled(broker, driver)
    with pytest.raises(RuntimeError, match="changed my mind"):
        with producer.transaction() as tx:
            tx.send("out", b"from n3", key="other")
            tx.ack(consumer, polled)
            raise RuntimeError("changed my mind")
    again = wait_until(lambda: consumer.poll(timeout=0.5, max_messages=10), 10, "n3 again")
    assert [m.value for m in again] == [b"n3"]
    consumer.ack(again)
    consumer.close()  # commits past h1
    assert committed_positions(broker, "in", "g")[0] == again[0].offset
    heir = driver.consumer("in", "g", "m2", **CONSUMER)
    assert released_once_fk1_is(broker, heir) == [b"n1", b"h1"]
    assert values_of(broker, "out") == []
    heir.close()
    producer.close()


@pytest.mark.parametrize("outcome", ["commit", "abort"])
def test_a_plain_ack_during_an_open_transaction_waits_for_it(
    broker: redisq.Broker, driver: Any, outcome: str
) -> None:
    """m1 polls a, b, c; a transaction acks a; consumer.ack(b) outside it. The plain ack waits
    for the transaction: committed, the group ends up past b once m1 leaves; aborted, a and b
    are delivered again (at-least-once), nothing is lost."""
    three_inputs(broker)
    consumer = driver.consumer("in", "g", "m1", **CONSUMER)
    producer = driver.producer("xf", transactional=True)
    a, b, c = wait_until(lambda: consumer.poll(timeout=0.5, max_messages=10), 10, "a, b, c")
    try:
        with producer.transaction() as tx:
            tx.send("out", b"from a", key="k")
            tx.ack(consumer, [a])
            consumer.ack([b])
            time.sleep(0.3)  # several ack intervals: the plain ack is not committed alone
            assert committed_positions(broker, "in", "g").get(0) in (None, "0-0")
            if outcome == "abort":
                raise RuntimeError("abort")
    except RuntimeError:
        pass
    if outcome == "commit":
        assert committed_positions(broker, "in", "g")[0] == a.offset
        consumer.close()
        assert committed_positions(broker, "in", "g")[0] == b.offset
        assert values_of(broker, "out") == [b"from a"]
    else:
        again = wait_until(lambda: consumer.poll(timeout=0.5, max_messages=10), 10, "again")
        assert [m.value for m in again] == [b"a", b"b", b"c"]
        assert values_of(broker, "out") == []
        consumer.close()
    producer.close()
