"""pause() is the member's, not the lease's (issue 37 item 4): a paused partition revoked and
assigned back stays paused until resume(); both APIs (tests/txhelp.py drivers), every backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from tests.conftest import wait_until
from tests.txhelp import DRIVERS

CONSUMER = {"lease_ttl_ms": 1500, "ack_interval_ms": 50, "heartbeat_interval_ms": 100}


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str) -> Iterator[Any]:
    drv = DRIVERS[request.param](server_url, broker.namespace)
    yield drv
    drv.close()


def send(broker: redisq.Broker, values: list[bytes]) -> None:
    with broker.producer() as producer:
        for value in values:
            producer.send("t", value, partition=0)


def test_a_paused_partition_comes_back_paused(broker: redisq.Broker, driver: Any) -> None:
    """m1 reads a, pauses partition 0; m0 joins (it sorts first: the partition is its share),
    then leaves, and the partition comes back to m1 with b and c waiting: nothing of it is read
    until resume(), then b and c."""
    broker.create_topic("t", partitions=1)
    send(broker, [b"a"])
    m1 = driver.consumer("t", "g", "m1", **CONSUMER)
    assert [m.value for m in wait_until(lambda: m1.poll(timeout=0.5), 20, "a")] == [b"a"]
    m1.pause(0)
    assert m1.paused() == [("t", 0)]
    m0 = driver.consumer("t", "g", "m0", **CONSUMER)
    wait_until(lambda: m0.poll(timeout=0.2) == [] and m0.assignment == [0], 20, "m0 takes it")
    m0.close()
    send(broker, [b"b", b"c"])
    wait_until(lambda: m1.poll(timeout=0.2) == [] and m1.assignment == [0], 20, "it comes back")
    assert m1.paused() == [("t", 0)]
    assert m1.poll(timeout=2) == []  # b and c wait: still paused
    m1.resume(0)
    assert m1.paused() == []
    got = wait_until(lambda: m1.poll(timeout=0.5), 20, "b and c after resume()")
    assert [m.value for m in got] == [b"b", b"c"]
    m1.close()


def test_resume_of_a_partition_held_elsewhere_forgets_the_pause(
    broker: redisq.Broker, driver: Any
) -> None:
    """resume() while the paused partition is another member's: no error, and it comes back
    unpaused; pause() of a partition not held is refused (InvalidConfig), as before."""
    broker.create_topic("t", partitions=1)
    send(broker, [b"a"])
    m1 = driver.consumer("t", "g", "m1", **CONSUMER)
    wait_until(lambda: m1.poll(timeout=0.5), 20, "a")
    m1.pause(0)
    m0 = driver.consumer("t", "g", "m0", **CONSUMER)
    wait_until(lambda: m0.poll(timeout=0.2) == [] and m0.assignment == [0], 20, "m0 takes it")
    wait_until(lambda: m1.poll(timeout=0.2) == [] and m1.assignment == [], 20, "m1 lets go")
    with pytest.raises(redisq.InvalidConfig, match="not assigned"):
        m1.pause(0)
    m1.resume(0)
    m0.close()
    send(broker, [b"b"])
    got = wait_until(lambda: m1.poll(timeout=0.5), 20, "b, unpaused")
    assert [m.value for m in got] == [b"b"]
    m1.close()
