"""Read committed on one server (issue 37 item 5): a committed transaction's roll-forward is one
MULTI/EXEC, so no reader sees one partition's part of it before another's. A transaction here
writes two batches to each of four partitions (two rounds of its roll-forward); a reader takes
snapshots of the four lengths in MULTI/EXEC the whole time, and every snapshot shows the same
length everywhere. Both APIs (tests/txhelp.py drivers), on each standalone server; on a Cluster
the parts land one node at a time (docs/transactions.md says so)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import redisq
from tests.txhelp import DRIVERS

PARTITIONS = 4
TRANSACTIONS = 60


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    if broker.is_cluster:
        pytest.skip("one server: a Cluster's nodes apply their parts one at a time")
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


def test_no_reader_sees_part_of_a_transaction(broker: redisq.Broker, driver: Any) -> None:
    broker.create_topic("t", partitions=PARTITIONS)
    logs = [broker.keys.log("t", p) for p in range(PARTITIONS)]
    reader = redis.Redis.from_url(broker._url) if broker._url else broker.client
    uneven: list[list[int]] = []
    snapshots = 0
    done = threading.Event()

    def read() -> None:
        nonlocal snapshots
        while not done.is_set():
            pipe = reader.pipeline(transaction=True)
            for key in logs:
                pipe.xlen(key)
            lengths = pipe.execute()
            snapshots += 1
            if len(set(lengths)) > 1:
                uneven.append(lengths)

    thread = threading.Thread(target=read)
    thread.start()
    producer = driver.producer("rc", transactional=True, max_batch_messages=1)
    try:
        for n in range(TRANSACTIONS):
            with producer.transaction() as tx:
                for p in range(PARTITIONS):
                    tx.send("t", b"%d-a" % n, partition=p)
                    tx.send("t", b"%d-b" % n, partition=p)
    finally:
        done.set()
        thread.join(30)
        producer.close()
    assert [broker.client.xlen(key) for key in logs] == [2 * TRANSACTIONS] * PARTITIONS
    assert snapshots > TRANSACTIONS  # the reader ran throughout
    assert uneven == [], f"{len(uneven)} of {snapshots} snapshots saw part of a transaction"
