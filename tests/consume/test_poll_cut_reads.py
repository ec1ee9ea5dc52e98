"""poll(max_messages=n) on batch entries holding more than n messages, on every backend and
through both APIs: a read of an entry is given in pieces of n, each message once and in order,
the next pieces without reading the entry again; a seek, or another member taking the
partition over, drops what was kept of the read, so the messages come from the new position;
a poll() that fails (a value its deserializer refuses) gives back what it had read.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import redisq
from redisq.model.records import Message
from tests.conftest import wait_until

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}
N = 50


def values(messages: list[Message]) -> list[str]:
    return [m.value.decode() for m in messages]


def one_entry(broker: redisq.Broker, topic: str) -> list[str]:
    """N messages sent as one producer batch: one stream entry (checked), their offsets."""
    broker.create_topic(topic, partitions=1, entry_format="batch")
    with broker.producer(linger_ms=1000) as producer:
        futures = [producer.send_async(topic, f"m{i}", key=b"k") for i in range(N)]
        producer.flush()
    assert broker.client.xlen(broker.keys.log(topic, 0)) == 1
    return [str(f.result().offset) for f in futures]


def test_an_entry_is_given_in_pieces_each_message_once_in_order(
    api: Any, broker: redisq.Broker
) -> None:
    offsets = one_entry(broker, "t")
    with api.broker.consumer("t", "g", enable_auto_commit=False, **FAST) as consumer:
        got: list[Message] = []
        while len(got) < N:
            piece = consumer.poll(timeout=10, max_messages=7)
            assert 0 < len(piece) <= 7
            assert consumer.poll(timeout=0.05, max_messages=7) == []  # orderly: acks first
            consumer.ack(piece)
            got += piece
        assert [m.offset for m in got] == offsets
        assert values(got) == [f"m{i}" for i in range(N)]
        assert consumer.poll(timeout=0.3, max_messages=7) == []
        consumer.commit()
        assert consumer.committed(0) == offsets[-1]


def test_a_seek_between_pieces_reads_from_the_sought_offset(
    api: Any, broker: redisq.Broker
) -> None:
    offsets = one_entry(broker, "t")
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert values(consumer.poll(timeout=10, max_messages=10)) == [f"m{i}" for i in range(10)]
        consumer.seek(0, offsets[3])  # back, inside the entry
        assert values(consumer.poll(timeout=10, max_messages=4)) == ["m3", "m4", "m5", "m6"]
        consumer.seek(0, offsets[40])  # forward, past what the read kept
        assert values(consumer.poll(timeout=10, max_messages=4)) == ["m40", "m41", "m42", "m43"]
        assert values(consumer.poll(timeout=10, max_messages=4)) == ["m44", "m45", "m46", "m47"]


def test_the_next_owner_reads_from_the_commit_not_from_what_was_kept(
    api: Any, broker: redisq.Broker
) -> None:
    one_entry(broker, "t")
    with api.broker.consumer("t", "g", **FAST) as first:
        first.ack(first.poll(timeout=10, max_messages=5))
        assert values(first.poll(timeout=10, max_messages=5)) == [f"m{i}" for i in range(5, 10)]
        # close() acks what the last poll() returned (auto-commit) and commits through m9
    with api.broker.consumer("t", "g", **FAST) as second:
        assert values(second.poll(timeout=10, max_messages=5)) == [f"m{i}" for i in range(10, 15)]


def test_a_poll_that_fails_gives_back_what_it_had_read(api: Any, broker: redisq.Broker) -> None:
    """poll() reads partition after partition, then deserializes. When that fails (a value
    that is not JSON, in partition 1), the messages read were never returned: no position may
    move over them. The error comes again until the caller seeks past the bad message, then
    everything comes, from the first message on."""
    broker.create_topic("t", partitions=2)
    options = {**FAST, "enable_auto_commit": False, "value_deserializer": "json"}
    with api.broker.consumer("t", "g", **options) as consumer:
        assert consumer.poll(timeout=0) == []  # joined; both partitions held before the sends
        wait_until(lambda: len(consumer.assignment) == 2, 10, "both partitions assigned")
        with broker.producer() as producer:
            for i in range(5):
                producer.send("t", json.dumps(f"m{i}"), partition=0)
            producer.send("t", b"not json", partition=1)
            after = producer.send("t", json.dumps("after"), partition=1)
        for _ in range(2):
            with pytest.raises(ValueError):
                consumer.poll(timeout=5, max_messages=100)
        consumer.seek(1, str(after.offset))
        got: list[Message] = []
        while len(got) < 6:
            piece = consumer.poll(timeout=5, max_messages=100)
            assert piece, f"only {[m.value for m in got]} came"
            consumer.ack(piece)
            got += piece
        assert sorted(m.value for m in got) == sorted(["after", *(f"m{i}" for i in range(5))])
        assert [m.value for m in got if m.partition == 0] == [f"m{i}" for i in range(5)]
