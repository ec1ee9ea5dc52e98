"""Counting messages on a batch topic (DESIGN §14.6): a group's lag and a topic's total are
messages, as on a topic of message entries, whichever way the group reads (orderly positions
inside entries, concurrent reads of whole entries, partitions not read yet), every backend,
both APIs, both entry formats. Where the counters cannot tell (an entry without c), the
messages are counted in the server instead."""

from __future__ import annotations

import json
from typing import Any

import pytest

import redisq
from tests.apis import poll_and_ack

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}
TOTAL, PER_BATCH = 100, 25


@pytest.fixture(params=["message", "batch"])
def entry_format(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def produce(broker: redisq.Broker, topic: str, count: int, first: int = 0) -> None:
    with broker.producer(linger_ms=30_000, max_batch_messages=PER_BATCH) as producer:
        for n in range(first, first + count):
            producer.send_async(topic, json.dumps({"n": n}), key=f"k{n % 3}", partition=0)


def lags(broker: redisq.Broker, topic: str, group: str) -> list[int | None]:
    return [p.lag for p in broker.describe_group(topic, group).partitions]


def test_lags_count_messages(api: Any, broker: redisq.Broker, entry_format: str) -> None:
    broker.create_topic("t", 1, entry_format=entry_format)
    for group, mode in (("orderly", "orderly"), ("concurrent", "concurrent")):
        with api.broker.consumer("t", group, mode=mode, start="earliest", **FAST) as consumer:
            consumer.poll(timeout=0.2)  # the groups exist before anything is produced
    broker.create_topic("later", 1, entry_format=entry_format)
    produce(broker, "t", TOTAL)
    assert broker.client.xlen(broker.keys.log("t", 0)) == (
        TOTAL // PER_BATCH if entry_format == "batch" else TOTAL
    )
    assert broker.describe_topic("t").total_messages == TOTAL
    assert lags(broker, "t", "orderly") == [TOTAL]
    assert lags(broker, "t", "concurrent") == [TOTAL]

    with api.broker.consumer("t", "orderly", **FAST) as consumer:
        got = poll_and_ack(consumer, 7)  # a position inside the first batch
        consumer.commit()
        assert len(got) == 7
    assert lags(broker, "t", "orderly") == [TOTAL - 7]
    with api.broker.consumer("t", "concurrent", mode="concurrent", **FAST) as consumer:
        assert len(poll_and_ack(consumer, TOTAL)) == TOTAL
    assert lags(broker, "t", "concurrent") == [0]
    produce(broker, "t", 30, first=TOTAL)
    assert lags(broker, "t", "orderly") == [TOTAL + 30 - 7]
    assert lags(broker, "t", "concurrent") == [30]  # a partial batch after the full ones
    assert broker.describe_topic("t").total_messages == TOTAL + 30

    # A group that has not read the partition yet, starting at the latest: what came after
    with api.broker.consumer("later", "g", start="latest", **FAST) as consumer:
        consumer.poll(timeout=0.2)
    produce(broker, "later", 10)
    assert lags(broker, "later", "g") == [10]


def test_an_empty_partition_lags_zero(api: Any, broker: redisq.Broker, entry_format: str) -> None:
    """A partition nothing was sent to has lag 0 (not unknown)."""
    broker.create_topic("t", 2, entry_format=entry_format)
    with api.broker.consumer("t", "g", start="earliest", **FAST) as consumer:
        consumer.poll(timeout=0.2)  # the group exists before anything is produced
    produce(broker, "t", 10)  # all to partition 0
    assert lags(broker, "t", "g") == [10, 0]
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert len(poll_and_ack(consumer, 4)) == 4
        consumer.commit()
        description = broker.describe_group("t", "g")
    assert [p.lag for p in description.partitions] == [6, 0]
    assert description.total_lag == 6


def test_where_the_counters_cannot_tell_the_messages_are_counted(
    api: Any, broker: redisq.Broker
) -> None:
    """A foreign message entry (no c) first: the topic's total is not known from the counters
    (entries shown instead, at least one message each), and a position on it is counted in the
    server, batch entries counting their messages."""
    broker.create_topic("t", 1, entry_format="batch")
    broker.client.xadd(broker.keys.log("t", 0), {"v": json.dumps({"n": -1})})
    produce(broker, "t", TOTAL)
    (partition,) = broker.describe_topic("t").partitions
    assert partition.messages is None and partition.length == 1 + TOTAL // PER_BATCH
    with api.broker.consumer("t", "g", start="earliest", **FAST) as consumer:
        first = poll_and_ack(consumer, 1)
        consumer.commit()
        assert json.loads(first[0].value) == {"n": -1}
    assert lags(broker, "t", "g") == [TOTAL]  # counted: the position is on the foreign entry
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert len(poll_and_ack(consumer, 3)) == 3
        consumer.commit()
    assert lags(broker, "t", "g") == [TOTAL - 3]  # inside a batch entry: its counters tell


def test_trim_keeps_retention_messages_in_whole_entries(api: Any, broker: redisq.Broker) -> None:
    """Broker.trim on a batch topic trims by messages, not entries: 200 messages kept of 1,000
    written in batches of 25, 8 entries (the producers' MAXLEN ~ trims whole stream nodes and
    leaves more; an exact MAXLEN of 200 entries would keep all 40)."""
    broker.create_topic("t", 1, entry_format="batch", retention_messages=200)
    produce(broker, "t", 1_000)
    before = broker.client.xlen(broker.keys.log("t", 0))
    assert api.broker.trim("t") == before - 8
    kept = [json.loads(m.value)["n"] for m in broker.read("t", 0)]
    assert kept == list(range(800, 1_000))
    assert broker.describe_topic("t").total_messages == 200
