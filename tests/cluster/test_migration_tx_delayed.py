"""Transactions and delayed messages while a Redis Cluster slot migrates (SETSLOT IMPORTING /
MIGRATING, MIGRATE ... KEYS in two halves, SETSLOT NODE), on a three-master cluster of Valkey and
of Redis 7.0 (the `cluster3` fixture of tests/cluster/test_three_masters.py).

During such a migration a script whose keys are not all on one node is refused with ASK or
TRYAGAIN, and one that creates a key beside existing ones (a roll-forward mark, a transaction's
first staged batch, a scheduler lease) is refused with TRYAGAIN until the slot's keys are all
moved and the slot is handed over. What a user checks afterwards must still hold:

- transactions (thread and asyncio API) committed while the slot of one of their destination
  partitions moves, or while the slot of their own record moves: every committed one is stored
  whole and once, no aborted one is, per-key order holds, `commit()` never fails with a raw
  cluster error, nothing committed is left in the registry;
- delayed messages due before, during and after the move of their partition's slot: each is
  appended once, never before its due time (the server's clock), none is lost.
"""

from __future__ import annotations

import binascii
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import redisq
import redisq.produce.transactional
from redisq.produce.transactions import new_transaction_id
from redisq.schedule.scheduler import Scheduler
from tests.cluster.test_three_masters import (  # noqa: F401
    broker,
    cluster3,
    count_redirects,
    migrate_slot,
    owner_of,
)
from tests.conftest import wait_until
from tests.servers import ServerProcess
from tests.txhelp import DRIVERS, registry

pytestmark = pytest.mark.cluster

TOPIC = "txmig"
PARTITIONS = 6
HOT = 2  # the partition whose slot moves


class Abort(Exception):
    """Raised inside a transaction block: the transaction must abort."""


def hot_keys(partition: int, count: int = 8) -> list[bytes]:
    keys = (b"k%d" % i for i in range(10_000))
    return [k for k in keys if redisq.partition_for_key(k, PARTITIONS) == partition][:count]


def tx_ids_in_slot(slot: int) -> Callable[[], str]:
    """A stand-in for new_transaction_id: ULIDs (time now, random bits) whose record keys hash to
    `slot` (only the last three characters are searched), so every transaction lives there."""
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

    def make() -> str:
        while True:
            prefix = new_transaction_id()[:-3]
            for a in alphabet:
                for b in alphabet:
                    for c in alphabet:
                        tx_id = prefix + a + b + c
                        if binascii.crc_hqx(f"~tx:{tx_id}".encode(), 0) % 16384 == slot:
                            return tx_id

    return make


class TxRun:
    """Transactions in a loop on one producer: three messages each (two to the hot partition,
    one elsewhere), every fifth aborted by an exception in its block. Records each transaction's
    values, outcome and span; a commit() or abort() that raises anything else is recorded and
    called again (README: "a later commit() completes it") until the transaction is settled."""

    def __init__(self, producer: Any, tag: int, hot: list[bytes], cold: list[bytes]) -> None:
        self.producer, self.tag = producer, tag
        self.hot, self.cold = hot, cold
        self.committed: dict[str, list[bytes]] = {}
        self.records: dict[str, list[Any]] = {}
        self.aborted: dict[str, list[bytes]] = {}
        self.spans: list[tuple[float, float]] = []  # (begin, end) of each transaction
        self.errors: list[tuple[str, str]] = []
        self.order: dict[bytes, int] = {}  # value -> send index
        self.count = 0
        self.stop = threading.Event()
        self.failed: list[BaseException] = []

    def one(self, rng: random.Random) -> None:
        i, began = self.count, time.monotonic()
        sends = [rng.choice(self.hot), rng.choice(self.hot), rng.choice(self.cold)]
        values = [b"%s:p%d:t%d:%d" % (key, self.tag, i, j) for j, key in enumerate(sends)]
        abort = i % 5 == 4
        tx = self.producer.transaction()
        try:
            with tx:
                for key, value in zip(sends, values, strict=True):
                    self.order[value] = len(self.order)
                    tx.send(TOPIC, value, key=key)
                if abort:
                    raise Abort
        except Abort:
            if tx.state == "open":  # abort() failed (logged): the user would abort again
                self.errors.append((tx.transaction_id, "abort() failed"))
                self.settle(tx.abort)
        except Exception as exc:  # commit() failed: the outcome is unknown to the user
            self.errors.append((tx.transaction_id, f"{type(exc).__name__}: {exc}"))
            self.settle(tx.commit)
        assert tx.state == ("aborted" if abort else "committed"), (tx.transaction_id, tx.state)
        (self.aborted if abort else self.committed)[tx.transaction_id] = values
        self.records[tx.transaction_id] = list(tx.records)
        self.spans.append((began, time.monotonic()))
        self.count += 1

    def settle(self, step: Callable[[], Any]) -> None:
        """commit() or abort() again until one returns (60 s)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                step()
                return
            except Exception as again:
                self.errors.append(("", f"again: {type(again).__name__}"))
                time.sleep(0.2)

    def run(self, at_least: int) -> None:
        rng = random.Random(self.tag)
        try:
            while not self.stop.is_set() or self.count < at_least:
                self.one(rng)
        except BaseException as exc:
            self.failed.append(exc)


def check_transactions(broker: redisq.Broker, runs: list[TxRun]) -> None:  # noqa: F811
    """Committed: stored whole, once, at the offsets commit() answered; aborted: nothing;
    per-key send order; the registry empties (nothing left decided but not carried out); and
    no commit() or abort() failed on the way."""
    assert not [r.failed for r in runs if r.failed]
    stored = [m for p in range(PARTITIONS) for m in broker.read(TOPIC, p)]
    copies = Counter(m.value for m in stored)
    assert not [v for v, n in copies.items() if n > 1], "a message stored twice"
    at = {(m.partition, m.offset): m.value for m in stored}
    order = {v: (run.tag, i) for run in runs for v, i in run.order.items()}
    for run in runs:
        for tx_id, values in run.committed.items():
            missing = [v for v in values if v not in copies]
            assert not missing, f"committed transaction {tx_id} lost {missing}"
            records = [at.get((r.partition, r.offset)) for r in run.records[tx_id]]
            assert records == values, f"{tx_id}: records {records} != sent {values}"
        for tx_id, values in run.aborted.items():
            assert not [v for v in values if v in copies], f"aborted {tx_id} stored"
    assert len(stored) == sum(len(v) for run in runs for v in run.committed.values())
    by_key: dict[bytes | None, list[tuple[int, int]]] = defaultdict(list)
    for m in stored:
        by_key[m.key].append(order[m.value])
    for key, indexes in by_key.items():
        assert indexes == sorted(indexes), f"key {key!r} out of send order"
    wait_until(lambda: not registry(broker), 30, "the transaction registry to empty")
    errors = [e for run in runs for e in run.errors]
    assert not errors, f"{len(errors)} commit()/abort() failures, e.g. {errors[:3]}"


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest, broker: redisq.Broker) -> Iterator[Any]:  # noqa: F811
    url = broker.client.get_default_node().name
    d = DRIVERS[request.param](f"redis://{url}", broker.namespace)
    yield d
    d.close()


def run_during_migration(
    broker: redisq.Broker,  # noqa: F811
    cluster3: list[ServerProcess],  # noqa: F811
    driver: Any,
    slot: int,
    producers: int = 3,
) -> list[TxRun]:
    """`producers` named transactional producers, each in its own thread on keys of its own,
    run transactions before, during and after the move of `slot`; then check_transactions."""
    hot, cold = hot_keys(HOT, 12), hot_keys(HOT + 1) + hot_keys(HOT + 2)
    prefix = f"tx-{uuid.uuid4().hex[:6]}"
    opened = [
        driver.producer(f"{prefix}-{j}", transactional=True, delivery_timeout_ms=60_000)
        for j in range(producers)
    ]
    runs = [TxRun(p, j, hot[j::producers], cold[j::producers]) for j, p in enumerate(opened)]
    threads = [threading.Thread(target=r.run, args=(20,), daemon=True) for r in runs]
    for thread in threads:
        thread.start()
    wait_until(lambda: all(r.count >= 10 or r.failed for r in runs), 60, "transactions first")
    began = time.monotonic()
    source, target, moved = migrate_slot(cluster3, slot)
    ended = time.monotonic()
    for run in runs:
        run.stop.set()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "the transactions did not finish"
    for producer in opened:
        producer.close()
    assert moved >= 1 and owner_of(cluster3, slot) is target is not source
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    during = sum(1 for r in runs for b, e in r.spans if b < ended and e > began)
    print(f"{during} transactions overlapped the migration")
    assert during >= producers, "too few transactions during the migration to prove anything"
    check_transactions(broker, runs)
    assert all(r.aborted and len(r.committed) >= 16 for r in runs)
    return runs


@pytest.mark.fault
def test_transactions_while_a_destination_partition_slot_migrates(
    broker: redisq.Broker,  # noqa: F811
    cluster3: list[ServerProcess],  # noqa: F811
    driver: Any,
) -> None:
    """Transactions writing to a partition whose slot moves commit whole and once (roll-forward
    marks are created beside the moving stream: TRYAGAIN), aborted ones leave nothing, per-key
    order holds, and commit() answers success or a transaction error, never a cluster error."""
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, HOT))
    run_during_migration(broker, cluster3, driver, slot)


@pytest.mark.fault
def test_transactions_while_their_record_slot_migrates(
    broker: redisq.Broker,  # noqa: F811
    cluster3: list[ServerProcess],  # noqa: F811
    driver: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every transaction's record and staged batches ({~tx:<id>}) in the one slot that moves:
    staging (new keys: ASK, then TRYAGAIN on the importing node), deciding and finishing still
    end with every committed transaction whole and once, no aborted one stored, nothing left."""
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    partition_slots = {broker.client.keyslot(broker.keys.log(TOPIC, p)) for p in range(6)}
    slot = broker.client.keyslot(broker.keys.transaction(new_transaction_id()))
    while slot in partition_slots or slot == broker.client.keyslot(broker.keys.transactions()):
        slot = broker.client.keyslot(broker.keys.transaction(new_transaction_id()))
    make = tx_ids_in_slot(slot)
    monkeypatch.setattr(redisq.produce.transactional, "new_transaction_id", make)
    import redisq.produce.transactional_async as async_transactional

    monkeypatch.setattr(async_transactional, "new_transaction_id", make)
    assert broker.client.keyslot(broker.keys.transaction(make())) == slot
    runs = run_during_migration(broker, cluster3, driver, slot)
    ids = [t for r in runs for t in (*r.committed, *r.aborted)]
    assert {broker.client.keyslot(broker.keys.transaction(t)) for t in ids} == {slot}


# -- delayed messages ----------------------------------------------------------------------------


@pytest.mark.fault
def test_delayed_messages_due_across_a_partition_slot_migration(
    broker: redisq.Broker,  # noqa: F811
    cluster3: list[ServerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delayed messages to a partition whose slot moves, due before, during and after the move,
    sent before and during it, delivered by the producer's scheduler and a second one racing it:
    each is appended exactly once, never before its due time (stream ID ms >= deliver_at_ms, both
    the server's clock), none is lost, and the schedule ends empty on the new owner."""
    seen = count_redirects(monkeypatch)  # redirections the delayed sender met, by kind
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, HOT))
    keys = hot_keys(HOT)
    sent: list[tuple[bytes, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    started = threading.Event()

    def produce(producer: Any) -> None:
        rng = random.Random(3)
        try:
            i = 0
            while not stop.is_set() or i < 1500:
                key = rng.choice(keys)
                value = b"%s:d%d" % (key, i)
                delay = rng.randrange(1, 2500)
                sent.append((value, producer.send_async(TOPIC, value, key=key, delay_ms=delay)))
                i += 1
                if i == 500:
                    started.set()
                if i % 50 == 0:
                    time.sleep(0.02)
            producer.flush(timeout=120)
        except BaseException as exc:
            errors.append(exc)
            started.set()

    with (
        broker.producer(max_batch_messages=50, delivery_timeout_ms=60_000) as producer,
        Scheduler(broker, [TOPIC]),
    ):
        thread = threading.Thread(target=produce, args=(producer,), daemon=True)
        thread.start()
        assert started.wait(60)
        with owner_of(cluster3, slot).client() as node:
            began_ms = int(node.time()[0]) * 1000
        source, target, _ = migrate_slot(cluster3, slot)
        with target.client() as node:
            ended_ms = int(node.time()[0]) * 1000 + 1000
        stop.set()
        thread.join(120)
        assert not thread.is_alive() and not errors, errors
        metas = {value: future.result(timeout=0) for value, future in sent}

        def all_delivered() -> bool:
            return sum(1 for p in range(PARTITIONS) for _ in broker.read(TOPIC, p)) >= len(sent)

        wait_until(all_delivered, 60, "every delayed message to be delivered")
        time.sleep(0.3)  # a duplicate delivery would land now
    stored = [m for p in range(PARTITIONS) for m in broker.read(TOPIC, p)]
    copies = Counter(m.value for m in stored)
    assert not [v for v, n in copies.items() if n > 1], "a delayed message delivered twice"
    assert set(copies) == set(metas), "delayed messages lost"
    early = [
        (m.value, m.append_time_ms, metas[m.value].deliver_at_ms)
        for m in stored
        if m.append_time_ms < metas[m.value].deliver_at_ms
    ]
    assert not early, f"{len(early)} delivered before their due time, e.g. {early[:3]}"
    assert all(m.partition == HOT for m in stored)
    during = [v for v, meta in metas.items() if began_ms <= meta.deliver_at_ms <= ended_ms]
    assert len(during) > 100, "too few messages due during the migration to prove anything"
    assert seen["ASK"] + seen["MOVED"] > 0, f"the delayed sends never met a redirection: {seen}"
    info = broker.describe_topic(TOPIC).partitions[HOT]
    assert info.scheduled == 0 and info.node == f"127.0.0.1:{target.port}"
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
