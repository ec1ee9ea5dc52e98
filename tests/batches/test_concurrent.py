"""Concurrent groups on batch entries (DESIGN §14.8), every backend, both APIs, both formats:
a message is acknowledged, redelivered and dead-lettered on its own; an entry leaves the
pending list once every message of it is settled; a member that stops inside an entry leaves it
pending, with the bitmap of its settled messages beside the pending list, and the member that
claims it gets only what was not settled."""

from __future__ import annotations

import json
from typing import Any

import pytest

import redisq
from redisq.model.keys import dead_letter_topic
from tests.batches.test_reading import PER_BATCH, TOTAL, filled, numbers
from tests.conftest import wait_until

OPTIONS = {"mode": "concurrent", "block_ms": 100, "lease_ttl_ms": 1500}


@pytest.fixture(params=["message", "batch"])
def entry_format(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pending(broker: redisq.Broker) -> int:
    return int(broker.client.xpending(broker.keys.log("t", 0), "g")["pending"])


def test_run_handles_every_message_once_and_leaves_nothing_pending(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    filled(broker, entry_format)
    handled: list[Any] = []
    with api.broker.consumer("t", "g", **OPTIONS) as consumer:
        assert consumer.run(handled.append, max_messages=TOTAL) == TOTAL
    assert sorted(numbers(handled)) == list(range(TOTAL))
    wait_until(lambda: pending(broker) == 0, what="every entry acknowledged")


def test_an_entry_stays_pending_until_its_last_message_is_acked(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    filled(broker, entry_format)
    with api.broker.consumer("t", "g", **OPTIONS) as consumer:
        got: list[Any] = []
        while len(got) < 10:
            got += consumer.poll(timeout=5, max_messages=10 - len(got))
        assert sorted(numbers(got)) == list(range(10))
        assert consumer.ack(got) == 10
        # Read and not settled whole: the first entry (15 of its messages are not settled) and
        # the three after it; in the message format, nothing.
        assert pending(broker) == (TOTAL // PER_BATCH if entry_format == "batch" else 0)
        more: list[Any] = []
        while len(more) < PER_BATCH - 10:
            more += consumer.poll(timeout=5, max_messages=PER_BATCH - 10 - len(more))
        assert consumer.ack(more) == PER_BATCH - 10
        assert pending(broker) == (TOTAL // PER_BATCH - 1 if entry_format == "batch" else 0)
        got += more
        rest: list[Any] = []
        while len(rest) < TOTAL - PER_BATCH:
            polled = consumer.poll(timeout=5, max_messages=7)
            assert polled, f"poll() gave nothing after {len(rest)}"
            assert len(polled) <= 7
            assert consumer.ack(polled) == len(polled)
            rest += polled
        assert sorted(numbers(got + rest)) == list(range(TOTAL))
        assert pending(broker) == 0
        assert not broker.client.exists(broker.keys.settled_messages("t", 0, "g"))
        assert consumer.poll(timeout=0.5) == []


def test_the_member_that_claims_an_entry_gets_what_was_not_settled(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    filled(broker, entry_format)
    first = api.broker.consumer("t", "g", "first", **OPTIONS)
    try:
        got: list[Any] = []
        while len(got) < 30:
            got += first.poll(timeout=5, max_messages=30 - len(got))
        first.ack(got[:30])
    finally:
        first.close()
    settled = set(numbers(got))
    heir_got: list[Any] = []
    with api.broker.consumer("t", "g", "heir", claim_idle_ms=300, **OPTIONS) as heir:
        wait_until(
            lambda: (
                heir_got.extend(heir.poll(timeout=0.2) or ())
                or set(numbers(heir_got)) >= set(range(TOTAL)) - settled
            ),
            timeout=30,
            what="every message not settled delivered to the heir",
        )
        heir.ack(heir_got)
        # The settled part of the entry the first member was inside came from its bitmap.
        assert set(numbers(heir_got)) & settled == set()
        assert sorted(numbers(heir_got)) == sorted(set(range(TOTAL)) - settled)
        wait_until(lambda: pending(broker) == 0, what="every entry acknowledged")
        assert not broker.client.exists(broker.keys.settled_messages("t", 0, "g"))


def test_dead_letters_are_per_message(api: Any, broker: redisq.Broker, entry_format: str) -> None:
    filled(broker, entry_format)
    bad = {3, 27, 28, 99}

    def handler(message: redisq.Message) -> None:
        if json.loads(message.value)["n"] in bad:
            raise ValueError("bad")

    options = dict(OPTIONS, max_attempts=1, retry_backoff_ms=1, max_retry_backoff_ms=1)
    with api.broker.consumer("t", "g", **options) as consumer:
        consumer.run(handler, max_messages=TOTAL)
    wait_until(lambda: pending(broker) == 0, what="every entry settled")
    letters = list(broker.read(dead_letter_topic("t", "g"), 0))
    assert sorted(numbers(letters)) == sorted(bad)
