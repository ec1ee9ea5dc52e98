"""A scheduler's close() hands its leases back; a hand-back the server refuses is said, not
dropped (the lease then runs out by itself). Written once, run through both APIs (the thread
scheduler, and the asyncio one behind tests/apis.py's Bridge)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import redisq
from tests.conftest import wait_until


def scheduled(broker: redisq.Broker) -> str:
    """One partition with a message due in a minute; the key of its scheduler lease."""
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", b"later", key="k", delay_ms=60_000)
    return broker.keys.scheduler_lease("orders", 0)


def spoil(broker: redisq.Broker, lease: str) -> None:
    """The lease key as a hash: every script that reads it (the hand-back too) gets WRONGTYPE.
    In one step: the running scheduler may take the lease again between a DEL and an HSET."""
    broker.client.eval(
        "redis.call('DEL', KEYS[1]); return redis.call('HSET', KEYS[1], 'not', 'a lease')",
        1,
        lease,
    )


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "could not hand back" in r.getMessage()]


def holding(api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture) -> tuple[str, Any]:
    """A scheduler of the API under test holding the lease of scheduled(); its warnings
    captured."""
    lease = scheduled(broker)
    caplog.set_level(logging.WARNING, logger="redisq.scheduler")
    scheduler = api.scheduler(["orders"])
    wait_until(lambda: broker.client.exists(lease), timeout=30, what="the scheduler's lease")
    return lease, scheduler


def test_a_refused_hand_back_is_logged(
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    lease, scheduler = holding(api, broker, caplog)
    spoil(broker, lease)
    scheduler.close(timeout=10)
    (said,) = refusals(caplog)
    assert "could not hand back 1 of its 1 leases" in said and "WRONGTYPE" in said


def test_a_lease_another_client_holds_is_not_a_refusal(
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease ran out and another scheduler took it: nothing of ours to hand back."""
    lease, scheduler = holding(api, broker, caplog)
    broker.client.set(lease, "someone-else", px=60_000)
    scheduler.close(timeout=10)
    assert refusals(caplog) == []
    assert broker.client.get(lease) == b"someone-else"
