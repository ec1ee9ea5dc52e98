"""Kafka's consumer habits work (both APIs, every backend): a poll() loop or an iteration that
never acks reads everything (auto-commit: each poll acknowledges what the previous one gave);
a loop left early gives back what it had not reached; with enable_auto_commit=False a poll that
gets nothing because every partition waits for acks says so in the log, and commit() commits
everything returned so far. Never a silent stall."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

import redisq

FAST = {"lease_ttl_ms": 3000}
PARTITIONS = 4
COUNT = 1200  # 300 per partition: more than one poll's 100 per partition


def fill(broker: redisq.Broker) -> dict[int, list[bytes]]:
    broker.create_topic("t", PARTITIONS)
    sent: dict[int, list[bytes]] = {}
    with broker.producer() as producer:
        for i in range(COUNT):
            meta = producer.send_async("t", b"m%d" % i, key=b"k%d" % (i % 40))
            sent.setdefault(redisq.partition_for_key(b"k%d" % (i % 40), PARTITIONS), []).append(
                b"m%d" % i
            )
        producer.flush()
        assert meta.result().offset is not None
    return sent


def by_partition(messages: list[Any]) -> dict[int, list[bytes]]:
    got: dict[int, list[bytes]] = {}
    for m in messages:
        got.setdefault(m.partition, []).append(m.value)
    return got


def wait_assigned(consumer: Any) -> None:
    deadline = time.monotonic() + 30
    while len(consumer.assignment) < PARTITIONS:
        assert time.monotonic() < deadline, "no assignment within 30 s"
        time.sleep(0.05)


def test_a_poll_loop_that_never_acks_reads_everything(api: Any, broker: redisq.Broker) -> None:
    sent = fill(broker)
    consumer = api.broker.consumer("t", "g", **FAST)
    seen: list[Any] = []
    deadline = time.monotonic() + 60
    while len(seen) < COUNT:
        assert time.monotonic() < deadline, f"stalled at {len(seen)} of {COUNT}"
        seen += consumer.poll(timeout=0.5, max_messages=100)
    consumer.close()
    assert by_partition(seen) == sent  # each once, in order per partition
    assert broker.describe_group("t", "g").total_lag == 0  # committed at the close
    again = api.broker.consumer("t", "g", **FAST)
    assert again.poll(timeout=1.0) == []  # nothing handed again: all committed
    again.close()


def test_iterating_without_acks_reads_everything(api: Any, broker: redisq.Broker) -> None:
    sent = fill(broker)
    consumer = api.broker.consumer("t", "g", **FAST)
    seen: list[Any] = []
    watchdog = threading.Timer(60, consumer.close)  # a stalled iteration ends, and fails below
    watchdog.start()
    try:
        for message in consumer:
            seen.append(message)
            if len(seen) == COUNT:
                break
    finally:
        watchdog.cancel()
    consumer.close()
    assert by_partition(seen) == sent
    again = api.broker.consumer("t", "g", **FAST)
    assert again.poll(timeout=1.0) == []
    again.close()


def test_a_loop_left_early_gives_back_what_it_did_not_reach(
    api: Any, broker: redisq.Broker
) -> None:
    sent = fill(broker)
    consumer = api.broker.consumer("t", "g", **FAST)
    wait_assigned(consumer)
    first: list[Any] = []
    for message in consumer:
        first.append(message)
        if len(first) == 150:  # inside a read of 100 per partition
            break
    rest: list[Any] = []
    deadline = time.monotonic() + 60
    while len(first) + len(rest) < COUNT:
        assert time.monotonic() < deadline, f"stalled at {len(first) + len(rest)} of {COUNT}"
        rest += consumer.poll(timeout=0.5, max_messages=100)
    consumer.close()
    assert by_partition(first + rest) == sent  # nothing lost, nothing twice, in order


def test_without_auto_commit_a_stalled_poll_says_so_and_commit_releases_it(
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="redisq.consumer")
    sent = fill(broker)
    consumer = api.broker.consumer("t", "g", enable_auto_commit=False, **FAST)
    wait_assigned(consumer)
    given = consumer.poll(timeout=1.0, max_messages=1000)
    assert {m.partition for m in given} == set(range(PARTITIONS))  # a batch of each partition
    assert consumer.poll(timeout=0.3, max_messages=1000) == []  # each waits for its acks...
    warned = [r.getMessage() for r in caplog.records if "poll() gives nothing" in r.getMessage()]
    assert warned and "ack() or commit() each" in warned[0]  # ...and it says so
    consumer.commit()  # commits everything returned so far
    more: list[Any] = []
    deadline = time.monotonic() + 30
    while len(given) + len(more) < COUNT:
        assert time.monotonic() < deadline, f"stalled at {len(given) + len(more)} of {COUNT}"
        got = consumer.poll(timeout=0.5, max_messages=1000)
        more += got
        consumer.ack(got)
    consumer.commit()
    consumer.close()
    assert by_partition(given + more) == sent


def test_an_ack_is_committed_within_ack_interval_while_the_rest_of_the_batch_is_out(
    api: Any, broker: redisq.Broker
) -> None:
    """A caller acking one message at a time (a Kombu worker) has its acked prefix committed by
    the polls that wait for the rest, not only once the whole batch is acked."""
    broker.create_topic("t", 1)
    with broker.producer() as producer:
        for i in range(3):
            producer.send("t", b"m%d" % i, key=b"k%d" % i)
    consumer = api.broker.consumer("t", "g", enable_auto_commit=False, ack_interval_ms=100, **FAST)
    deadline = time.monotonic() + 30
    given: list[Any] = []
    while len(given) < 3:
        assert time.monotonic() < deadline, f"{len(given)} of 3 given"
        given += consumer.poll(timeout=0.5, max_messages=10)
    consumer.ack(given[0])  # not due yet: a poll waiting for the rest commits it
    deadline = time.monotonic() + 5  # 50 ack intervals
    while consumer.committed(0) != given[0].offset:
        assert time.monotonic() < deadline, f"committed {consumer.committed(0)}"
        assert consumer.poll(timeout=0.2, max_messages=10) == []  # the rest is still out
    consumer.ack(given[1:])
    consumer.close()


def test_enable_auto_commit_takes_a_bool(broker: redisq.Broker) -> None:
    broker.create_topic("t", 1)
    with pytest.raises(TypeError, match="enable_auto_commit"):
        broker.consumer("t", "g", enable_auto_commit="yes")
