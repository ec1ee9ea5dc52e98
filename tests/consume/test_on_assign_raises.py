"""A raising on_assign stops the member (issue 37 item 6): run() and poll() raise what it
raised, nothing of its partitions is handed out by that member, and its partitions go to the
other members (as Kafka's Java consumer raises a rebalance listener's error from poll()). Both
APIs (the `api` fixture), every backend."""

from __future__ import annotations

from typing import Any

import pytest

import redisq
from tests.conftest import wait_until

FAST = {"lease_ttl_ms": 1500, "heartbeat_interval_ms": 100, "enable_auto_commit": False}


class SetupFailed(Exception):
    pass


def refuse(partitions: list[Any]) -> None:
    raise SetupFailed(f"cannot load state for {partitions}")


def two_messages(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        producer.send("t", b"a", partition=0)
        producer.send("t", b"b", partition=1)


def read_by_another_member(broker: redisq.Broker) -> list[bytes]:
    """What a healthy member of the same group reads: the failed member's partitions too."""
    got: list[bytes] = []

    def read() -> bool:
        got.extend(m.value for m in other.poll(timeout=0.3))
        return len(got) == 2

    with broker.consumer("t", "g", "other", **FAST) as other:
        wait_until(read, 30, "the other member to read both partitions")
    return sorted(got)


def test_poll_raises_what_on_assign_raised(broker: redisq.Broker, api: Any) -> None:
    two_messages(broker)
    consumer = api.broker.consumer("t", "g", "m", on_assign=refuse, **FAST)
    with pytest.raises(SetupFailed, match="cannot load state"):
        for _ in range(100):
            assert consumer.poll(timeout=0.3) == []
    assert consumer.closed
    with pytest.raises(redisq.ConsumerClosed):
        consumer.poll()
    assert read_by_another_member(broker) == [b"a", b"b"]


def test_run_raises_what_on_assign_raised(broker: redisq.Broker, api: Any) -> None:
    two_messages(broker)
    handled: list[bytes] = []
    consumer = api.broker.consumer("t", "g", "m", on_assign=refuse, **FAST)
    with pytest.raises(SetupFailed):
        consumer.run(lambda m: handled.append(m.value), timeout=30)
    assert handled == [] and consumer.closed
    assert read_by_another_member(broker) == [b"a", b"b"]
