"""Producer-set timestamps (Kafka's CreateTime) and key/value serializers, through both APIs, on
every backend: what a consumer reads back, and bad input refused with nothing stored."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import redisq
import redisq.asyncio as rq


def stored(broker: redisq.Broker, topic: str) -> list[redisq.Message]:
    description = broker.describe_topic(topic)
    return [m for p in description.partitions for m in broker.read(topic, p.partition)]


def test_timestamps_are_kept_and_the_append_time_stays_the_offset(broker: redisq.Broker) -> None:
    broker.create_topic("t")
    before = int(time.time() * 1000) - 5_000
    with broker.producer() as producer:
        stamped = producer.send("t", b"old", key="k", timestamp_ms=1_000_000)
        plain = producer.send("t", b"now", key="k")
    first, second = stored(broker, "t")
    assert (first.offset, first.timestamp_ms, first.value) == (stamped.offset, 1_000_000, b"old")
    assert first.append_time_ms >= before and first.timestamp == 1_000.0
    assert second.timestamp_ms == second.append_time_ms >= before  # no timestamp: append time
    assert plain.offset == second.offset


@pytest.mark.parametrize(
    ("stamp", "error"),
    [(-1, ValueError), (1 << 49, ValueError), ("5", TypeError), (True, TypeError)],
)
def test_bad_timestamps_store_nothing(broker: redisq.Broker, stamp: object, error: type) -> None:
    broker.create_topic("t")
    with broker.producer() as producer:
        with pytest.raises(error):
            producer.send("t", b"v", key="k", timestamp_ms=stamp)  # type: ignore[arg-type]
        with pytest.raises(redisq.InvalidConfig):
            producer.send("t", b"v", key="k", timestamp_ms=5, delay_ms=1000)
    assert broker.describe_topic("t").total_messages == 0


def test_serializers_and_deserializers_round_trip(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer(value_serializer="json", key_serializer=lambda k: b"user-%d" % k) as p:
        sent = [p.send("t", {"n": n, "tags": ["a"]}, key=n % 3) for n in range(6)]
        with pytest.raises(TypeError):  # the key serializer's own error: nothing queued
            p.send("t", {"n": 99}, key="not an int")
    assert all(not m.duplicate for m in sent)
    raw = stored(broker, "t")
    assert sorted(m.value for m in raw) == sorted(
        json.dumps({"n": n, "tags": ["a"]}, separators=(",", ":")).encode() for n in range(6)
    )
    assert {m.key for m in raw} == {b"user-0", b"user-1", b"user-2"}
    with broker.consumer("t", "g", value_deserializer="json", key_deserializer="str") as c:
        got: list[redisq.Message] = []
        deadline = time.monotonic() + 20
        while len(got) < 6 and time.monotonic() < deadline:
            batch = c.poll(timeout=0.5)
            c.ack(batch)
            got += batch
    assert sorted(m.value["n"] for m in got) == list(range(6))  # type: ignore[index]
    assert {m.key for m in got} == {"user-0", "user-1", "user-2"}


def test_bad_serializer_options_are_refused(broker: redisq.Broker) -> None:
    with pytest.raises(TypeError):
        broker.producer(value_serializer="yaml")
    with pytest.raises(TypeError):
        broker.producer(key_serializer=42)  # type: ignore[arg-type]


def test_asyncio_timestamps_and_serializers(server_url: str, namespace: str) -> None:
    async def scenario() -> list[redisq.Message]:
        broker = await rq.connect(server_url, namespace=namespace)
        try:
            await broker.create_topic("t")
            async with broker.producer(value_serializer="json") as producer:
                early = producer.send_async("t", {"a": 1}, key="k", timestamp_ms=77)  # first use
                await producer.send("t", {"b": 2}, key="k", timestamp_ms=88)
                await early
                with pytest.raises(ValueError):
                    await producer.send("t", {"c": 3}, key="k", timestamp_ms=-5)
            return [m async for m in broker.read("t", 0)]
        finally:
            await broker.delete_topic("t", force=True)
            await broker.close()

    messages = asyncio.run(scenario())
    assert [(m.value, m.timestamp_ms) for m in messages] == [(b'{"a":1}', 77), (b'{"b":2}', 88)]
