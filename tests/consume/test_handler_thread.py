"""Which thread run()'s handler runs on (issue 36 item 4): by default each partition's own thread
(thread API); handler_thread="one" runs every call of the member on one thread, lanes too, in
both APIs (the `api` fixture)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import redisq
from redisq.model.records import Message

FAST = {"lease_ttl_ms": 1500, "heartbeat_interval_ms": 100}
COUNT = 40


def fill(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=4)
    with broker.producer() as producer:
        for i in range(COUNT):
            producer.send_async("t", b"%d" % i, key=f"k{i % 8}")
        producer.flush()


def handle_all(consumer: Any) -> dict[int, set[int]]:
    """Thread idents per partition of every handler call; all COUNT handled."""
    threads: dict[int, set[int]] = {}

    def handler(message: Message) -> None:
        threads.setdefault(message.partition, set()).add(threading.get_ident())

    assert consumer.run(handler, max_messages=COUNT, timeout=60) == COUNT
    return threads


def test_one_thread_runs_every_handler_call(broker: redisq.Broker, api: Any) -> None:
    fill(broker)
    consumer = api.broker.consumer("t", "g", handler_thread="one", key_concurrency=4, **FAST)
    threads = handle_all(consumer)
    assert len(threads) == 4  # every partition had messages
    (only,) = set().union(*threads.values())
    assert only != threading.get_ident()


def test_by_default_each_partition_has_its_own_thread(broker: redisq.Broker) -> None:
    fill(broker)
    threads = handle_all(broker.consumer("t", "g", **FAST))
    assert len(threads) == 4
    assert all(len(idents) == 1 for idents in threads.values())
    assert len(set().union(*threads.values())) == 4


def test_handler_thread_is_checked(broker: redisq.Broker) -> None:
    with pytest.raises(redisq.InvalidConfig, match="handler_thread='main'"):
        broker.consumer("t", "g", handler_thread="main")
