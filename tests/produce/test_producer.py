"""The producer on real servers: routing, order, input checks, headers, both idempotence modes,
fencing of named producers, a lost reply, retention, acks, and the broker-side window of
produce_sequence.lua. Tests taking `api` run once per API (the thread API, and redisq.asyncio
behind tests/apis.py's Bridge) on each backend (valkey, valkey-cluster, redis,
valkey-cluster3); what the API under test wrote is read back through the thread API's `broker`,
and where the asyncio API reads it too, through both. Argument checks (ONE_BACKEND) run on one
server, through both APIs."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import redis

import redisq
from redisq.errors import UnknownProducer
from redisq.model.topic import TopicConfig
from redisq.produce.futures import SendFuture
from redisq.protocol.produce import (
    BatchResult,
    ProducerIdentity,
    encode_message,
    fence_partition,
    produce,
)
from redisq.server.transport import Transport
from redisq.server.transport_async import AsyncTransport
from tests.apis import failure, read_all, refused, send_or_error
from tests.marks import ONE_BACKEND
from tests.protocol.test_topic_admin import snapshot
from tests.servers import ServerProcess

# What send_async returns, per API.
FUTURE = {"sync": SendFuture, "async": asyncio.Future}


# -- send and routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
def test_send_returns_record_metadata_of_the_stored_message(
    api: Any, broker: redisq.Broker, idempotence: str | None
) -> None:
    broker.create_topic("orders", partitions=3)
    with api.broker.producer(idempotence=idempotence) as producer:
        meta = producer.send("orders", b"paid", key="order-42", headers={"h": "1"})
    assert isinstance(meta, redisq.RecordMetadata)
    assert meta.topic == "orders"
    assert meta.partition == zlib.crc32(b"order-42") % 3
    assert meta.duplicate is False
    [message] = broker.read("orders", meta.partition)
    assert message.offset == meta.offset and message.topic == "orders"
    assert (message.key, message.value, message.headers) == (b"order-42", b"paid", {"h": b"1"})
    assert message.timestamp_ms == int(meta.offset.split("-")[0])
    assert abs(message.timestamp - time.time()) < 60
    if idempotence == "sequence":
        assert message.producer_id is not None


def test_same_key_same_partition_by_crc32(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=5)
    keys = [f"customer-{i}" for i in range(60)] + ["ключ", "🙂"]
    metas = []
    with api.broker.producer() as producer:
        for key in keys:
            as_str = producer.send("orders", f"s-{key}", key=key)
            as_bytes = producer.send("orders", f"b-{key}", key=key.encode())
            expected = zlib.crc32(key.encode("utf-8")) % 5
            assert as_str.partition == as_bytes.partition == expected
            assert redisq.partition_for_key(key.encode(), 5) == expected
            assert isinstance(as_str, redisq.RecordMetadata) and not as_str.duplicate
            assert not as_bytes.duplicate
            metas += [(key, as_str), (key, as_bytes)]
    used = {zlib.crc32(k.encode()) % 5 for k in keys}
    assert len(used) == 5  # the keys really spread, so the check above meant something
    stored = {(m.partition, m.offset): m for m in read_all(broker, "orders")}
    assert len(stored) == 2 * len(keys)
    for key, meta in metas:  # each answer names where its message is
        message = stored[(meta.partition, meta.offset)]
        assert message.key == key.encode() and message.value.endswith(key.encode())
        assert message.partition == zlib.crc32(message.key) % 5 and message.topic == "orders"
        assert message.timestamp_ms == int(meta.offset.split("-")[0])
        assert abs(message.timestamp - time.time()) < 60
    # The API under test reads back what the thread API reads.
    assert {(m.partition, m.offset) for m in read_all(api.broker, "orders")} == set(stored)


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_per_key_order_with_many_batches_in_flight(
    api: Any, broker: redisq.Broker, idempotence: str
) -> None:
    """20k send_async over 300 keys, batches of 50, five in flight per partition: flush()
    returns with every future answered where its message is, each key's messages stored in
    send order, once."""
    broker.create_topic("orders", partitions=4)
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(300)]
    sent: dict[str, list[bytes]] = defaultdict(list)
    futures = []
    with api.broker.producer(
        idempotence=idempotence, max_batch_messages=50, max_in_flight=5, linger_ms=2
    ) as producer:
        send_async = producer.send_async
        for i in range(20_000):
            key = rng.choice(keys)
            value = f"{key}:{i}".encode()
            sent[key].append(value)
            future = send_async("orders", value, key=key)
            futures.append((key, value, future))
        assert isinstance(future, FUTURE[api.name])
        producer.flush()
        assert all(f.done() for _, _, f in futures), "flush returned with futures pending"
    results = {value: api.result(future) for _, value, future in futures}
    assert not any(meta.duplicate for meta in results.values())

    stored = read_all(broker, "orders")
    assert len(stored) == 20_000
    by_offset = {(m.partition, m.offset): m for m in stored}
    by_key: dict[str, list[bytes]] = defaultdict(list)
    for message in stored:  # per partition in offset order
        by_key[message.key.decode()].append(message.value)
    assert by_key == sent
    for key, value, _ in futures:
        meta = results[value]
        assert meta.partition == zlib.crc32(key.encode()) % 4
        message = by_offset[(meta.partition, meta.offset)]
        assert (message.key, message.value) == (key.encode(), value)
    if idempotence == "sequence":  # per-partition sequences count messages from 0, no gaps
        for p in range(4):
            sequences = [m.sequence for m in stored if m.partition == p]
            assert sequences == list(range(len(sequences)))


def test_send_after_send_async_keeps_their_order(api: Any, broker: redisq.Broker) -> None:
    """send_async() to topics whose metadata the producer has not loaded yet, then a send() of
    the same key: it lands after them, though its own topic's metadata is in first (the queued
    ones wait behind a topic loaded before theirs)."""
    broker.create_topic("first", partitions=2)
    broker.create_topic("second", partitions=3)
    with api.broker.producer() as producer:
        queued = [producer.send_async("first", b"f", key="k")]
        queued += [producer.send_async("second", f"q{i}", key="k") for i in range(20)]
        last = producer.send("second", b"last", key="k")
        metas = [api.result(f) for f in queued]
    values = [m.value for m in api.broker.read("second", last.partition)]
    assert values == [f"q{i}".encode() for i in range(20)] + [b"last"]
    assert [m.offset for m in metas[1:]] + [last.offset] == [
        m.offset for m in broker.read("second", last.partition)
    ]


def test_concurrent_senders_keep_each_key_in_order(api: Any, broker: redisq.Broker) -> None:
    """20 callers share one producer (threads; through the asyncio API, concurrent tasks on its
    loop), each sending its own key with send() and a key shared by all with send_async():
    every key is stored in each caller's send order."""
    broker.create_topic("orders", partitions=3)
    with api.broker.producer(linger_ms=1) as producer:

        def caller(t: int) -> None:
            for n in range(30):
                producer.send_async("orders", f"{t}:{n}", key="shared")
                meta = producer.send("orders", f"{n}", key=f"task-{t}")
                assert meta.partition == zlib.crc32(f"task-{t}".encode()) % 3

        with ThreadPoolExecutor(20) as pool:
            for done in [pool.submit(caller, t) for t in range(20)]:
                done.result(60)
    stored = read_all(broker, "orders")
    own: dict[bytes, list[int]] = defaultdict(list)
    shared: dict[int, list[int]] = defaultdict(list)
    for message in stored:
        if message.key == b"shared":
            t, n = message.value.decode().split(":")
            shared[int(t)].append(int(n))
        else:
            own[message.key].append(int(message.value))
    assert len(stored) == 20 * 30 * 2
    assert all(ns == list(range(30)) for ns in own.values()) and len(own) == 20
    assert all(ns == list(range(30)) for ns in shared.values()) and len(shared) == 20


def test_send_async_futures_resolve_without_flush(api: Any, broker: redisq.Broker) -> None:
    """Waiting for a future is enough: its batch goes after linger_ms, no flush() needed."""
    broker.create_topic("t", partitions=2)
    with api.broker.producer(linger_ms=20) as producer:
        futures = [producer.send_async("t", f"v{i}", key="k") for i in range(10)]
        metas = [api.result(f) for f in futures]
        assert all(isinstance(f, FUTURE[api.name]) and f.done() for f in futures)
    values = [m.value for m in api.broker.read("t", metas[0].partition)]
    assert values == [f"v{i}".encode() for i in range(10)]
    assert [m.offset for m in metas] == [m.offset for m in broker.read("t", metas[0].partition)]


def test_sticky_partitioner_without_key_spreads_over_all_partitions(
    broker: redisq.Broker,
) -> None:
    broker.create_topic("logs", partitions=4)
    with broker.producer(max_batch_messages=50, linger_ms=50) as producer:
        futures = [producer.send_async("logs", f"line-{i}") for i in range(2000)]
        producer.flush()
    partitions = [f.result(timeout=10).partition for f in futures]
    counts = {p: partitions.count(p) for p in range(4)}
    assert all(count > 0 for count in counts.values()), counts
    # Sticky: the partition changes only when a batch is sealed, so runs are batch-sized.
    switches = sum(1 for a, b in zip(partitions, partitions[1:], strict=False) if a != b)
    assert switches < len(partitions) / 10
    stored = read_all(broker, "logs")
    assert sorted(m.value for m in stored) == sorted(f"line-{i}".encode() for i in range(2000))
    for p in range(4):  # within a partition, send order
        values = [int(m.value.split(b"-")[1]) for m in stored if m.partition == p]
        assert values == sorted(values)


def test_custom_partitioner_chooses_the_partition(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=3)
    calls = []

    def by_length(topic: str, key: bytes | None, value: bytes, partitions: int) -> int:
        calls.append((topic, key, value, partitions))
        return len(value) % partitions

    with broker.producer(partitioner=by_length) as producer:
        metas = [producer.send("orders", "x" * n, key=f"k{n}") for n in range(1, 10)]
    assert [m.partition for m in metas] == [n % 3 for n in range(1, 10)]
    assert calls[0] == ("orders", b"k1", b"x", 3)
    for message in read_all(broker, "orders"):
        assert message.partition == len(message.value) % 3


@ONE_BACKEND
@pytest.mark.parametrize("bad", [99, 3, -1, "0", None, 1.5, True], ids=repr)
def test_custom_partitioner_bad_return_raises_and_writes_nothing(
    broker: redisq.Broker, bad: object
) -> None:
    broker.create_topic("orders", partitions=3)
    with broker.producer(partitioner=lambda *args: bad) as producer:
        before = snapshot(broker)
        with pytest.raises(redisq.PartitionOutOfRange):
            producer.send("orders", b"v", key="k")
        with pytest.raises(redisq.PartitionOutOfRange):
            producer.send_async("orders", b"v")
        producer.flush()
        assert snapshot(broker) == before
    assert broker.describe_topic("orders").total_messages == 0


def test_explicit_partition_wins_over_key(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=3)
    key_partition = zlib.crc32(b"k") % 3
    other = (key_partition + 1) % 3
    with broker.producer() as producer:
        meta = producer.send("orders", b"v", key="k", partition=other)
    assert meta.partition == other
    assert [m.value for m in broker.read("orders", other)] == [b"v"]


@ONE_BACKEND
def test_partition_out_of_range_is_refused_and_writes_nothing(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer() as producer:
        producer.send("t", b"ok")
        before = snapshot(broker)
        with pytest.raises(redisq.PartitionOutOfRange):
            producer.send_async("t", b"v", partition=2)
        with pytest.raises(redisq.PartitionOutOfRange):
            producer.send("t", b"v", partition=-1)
        producer.flush()
        assert snapshot(broker) == before


# -- values, keys, sizes, headers ---------------------------------------------------------------


def test_bytes_and_str_values_are_stored_as_bytes(broker: redisq.Broker) -> None:
    broker.create_topic("t")
    with broker.producer() as producer:
        producer.send("t", b"\x00raw\xff")
        producer.send("t", "héllo wörld")
        producer.send("t", "")
    assert [m.value for m in broker.read("t", 0)] == [b"\x00raw\xff", "héllo wörld".encode(), b""]


@ONE_BACKEND
@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
@pytest.mark.parametrize(
    "value",
    [42, {"a": 1}, None, 1.5, ["x"], object()],
    ids=lambda v: type(v).__name__ if type(v) is object else repr(v),  # stable across processes
)
def test_bad_value_type_is_a_type_error_naming_the_type(
    api: Any, broker: redisq.Broker, idempotence: str | None, value: object
) -> None:
    broker.create_topic("t", partitions=2)
    broker.create_topic("not-loaded")  # the producer has not sent to it yet
    with api.broker.producer(idempotence=idempotence) as producer:
        producer.send("t", b"ok")
        before = snapshot(broker)
        with pytest.raises(TypeError, match=type(value).__name__):
            producer.send("t", value)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=type(value).__name__):
            producer.send_async("t", value, key="k")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=type(value).__name__):  # a topic not loaded yet too
            producer.send_async("not-loaded", value)  # type: ignore[arg-type]
        producer.flush()
        assert snapshot(broker) == before
    assert broker.describe_topic("t").total_messages == 1


@ONE_BACKEND
@pytest.mark.parametrize("key", [7, 2.5, ["k"], {"k": 1}], ids=repr)
def test_bad_key_type_is_a_type_error(api: Any, broker: redisq.Broker, key: object) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer() as producer:
        before = snapshot(broker)
        with pytest.raises(TypeError, match=type(key).__name__):
            producer.send("t", b"v", key=key)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=type(key).__name__):
            producer.send_async("t", b"v", key=key)  # type: ignore[arg-type]
        producer.flush()
        assert snapshot(broker) == before


@ONE_BACKEND
@pytest.mark.parametrize("key", ["", b""], ids=repr)
def test_empty_key_is_a_value_error(api: Any, broker: redisq.Broker, key: str | bytes) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer() as producer:
        before = snapshot(broker)
        with pytest.raises(ValueError):
            producer.send("t", b"v", key=key)
        with pytest.raises(ValueError):
            producer.send_async("t", b"v", key=key)
        producer.flush()
        assert snapshot(broker) == before


@ONE_BACKEND
def test_message_too_large(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t")
    broker.create_topic("not-loaded")  # the producer has not sent to it yet
    with api.broker.producer(max_message_bytes=100) as producer:
        fits = producer.send("t", b"x" * 100)
        before = snapshot(broker)
        with pytest.raises(redisq.MessageTooLarge) as info:
            producer.send("t", b"x" * 101)
        assert (info.value.size, info.value.limit) == (101, 100)
        with pytest.raises(redisq.MessageTooLarge):  # the key counts
            producer.send_async("t", b"x" * 100, key="k")
        with pytest.raises(redisq.MessageTooLarge):  # and the headers
            producer.send_async("t", b"x" * 90, headers={"name": "0123456789"})
        with pytest.raises(redisq.MessageTooLarge):  # before the topic is loaded too
            producer.send_async("not-loaded", b"x" * 101)
        producer.flush()
        assert snapshot(broker) == before
    assert [m.offset for m in broker.read("t", 0)] == [fits.offset]


@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
def test_headers_round_trip(broker: redisq.Broker, idempotence: str | None) -> None:
    broker.create_topic("t", partitions=2)
    headers = {
        "trace-id": "abc-123",
        "binary": b"\x00\xff\x10\r\n",
        "ünïcode": "çödé ✓",
        "empty": "",
    }
    with broker.producer(idempotence=idempotence) as producer:
        with_headers = producer.send("t", b"v1", key="k", headers=headers)
        without = producer.send("t", b"v2", key="k")
    assert with_headers.partition == without.partition
    first, second = broker.read("t", with_headers.partition)
    assert first.headers == {
        "trace-id": b"abc-123",
        "binary": b"\x00\xff\x10\r\n",
        "ünïcode": "çödé ✓".encode(),
        "empty": b"",
    }
    assert all(isinstance(v, bytes) for v in first.headers.values())
    assert (first.key, first.value) == (b"k", b"v1")
    assert second.headers == {}


@ONE_BACKEND
@pytest.mark.parametrize(
    "headers",
    [{1: "x"}, {b"name": "x"}, {None: "x"}, {"name": 5}, {"name": None}, [("name", "x")]],
    ids=repr,
)
def test_bad_headers_are_type_errors_and_write_nothing(
    api: Any, broker: redisq.Broker, headers: object
) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer() as producer:
        before = snapshot(broker)
        with pytest.raises(TypeError):
            producer.send("t", b"v", key="k", headers=headers)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            producer.send_async("t", b"v", headers=headers)  # type: ignore[arg-type]
        producer.flush()
        assert snapshot(broker) == before


# -- topics: badly named, missing; a closed producer ---------------------------------------------


@ONE_BACKEND
def test_a_badly_named_topic_is_refused(api: Any, broker: redisq.Broker) -> None:
    before = snapshot(broker)
    with api.broker.producer() as producer:
        with pytest.raises(redisq.InvalidName):
            producer.send("bad:topic", b"v")
        refused(api, redisq.InvalidName, lambda: producer.send_async("bad:name", b"v"), False)
    assert snapshot(broker) == before


def test_a_missing_topic_fails_its_sends_only(api: Any, broker: redisq.Broker) -> None:
    """send() to a missing topic raises TopicNotFound, send_async() fails with it (the thread
    API at once, the asyncio API through the future), and a send queued after it to a topic
    that exists is not held up; nothing creates the missing topic. A closed producer refuses
    both sends with ProducerClosed."""
    broker.create_topic("t", partitions=2)
    with api.broker.producer() as producer:
        producer.send("t", b"ok", key="k")
        with pytest.raises(redisq.TopicNotFound):
            producer.send("missing", b"v")
        missing = send_or_error(lambda: producer.send_async("missing", b"v"))
        fine = producer.send_async("t", b"after", key="k")  # not held up by the missing one
        if not isinstance(missing, BaseException):
            assert api.name == "async", "the thread API's send_async returned"
            missing = failure(api, missing)
        assert isinstance(missing, redisq.TopicNotFound), repr(missing)
        producer.flush()
        assert api.result(fine).duplicate is False
    assert sorted(m.value for m in read_all(broker, "t")) == [b"after", b"ok"]
    assert "missing" not in broker.list_topics()
    with pytest.raises(redisq.ProducerClosed):
        producer.send("t", b"late")
    with pytest.raises(redisq.ProducerClosed):
        producer.send_async("t", b"late")


# -- idempotence="message_id" -------------------------------------------------------------------


def test_same_message_id_is_written_once_and_answers_the_first_offset(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("payments", partitions=4)
    with api.broker.producer(idempotence="message_id") as producer:
        first = producer.send("payments", b"charge 10", message_id="pay-1")
        again = producer.send("payments", b"charge 10 (retry)", message_id="pay-1")
        numeric = producer.send("payments", b"n", message_id=123456)
        numeric_again = producer.send("payments", b"n", message_id=123456)
    with api.broker.producer(idempotence="message_id") as second:  # another instance
        across = second.send("payments", b"charge 10 (other pod)", message_id="pay-1")
    assert first.duplicate is False
    assert again.duplicate is True
    assert again.offset == first.offset
    assert across.duplicate is True
    assert (across.partition, across.offset) == (first.partition, first.offset)
    # No key: the id routes the message, so its dedup scope (the partition) is always the same.
    assert first.partition == again.partition == zlib.crc32(b"pay-1") % 4
    assert numeric.partition == numeric_again.partition == zlib.crc32(b"123456") % 4
    assert numeric_again.duplicate and numeric_again.offset == numeric.offset
    stored = read_all(broker, "payments")
    assert len(stored) == 2
    [original] = [m for m in stored if m.message_id == b"pay-1"]
    assert (original.offset, original.value) == (first.offset, b"charge 10")


def test_message_id_dedup_across_producer_instances(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("payments", partitions=3)
    with api.broker.producer(idempotence="message_id") as first_producer:
        firsts = [
            first_producer.send("payments", f"v{i}", message_id=f"id-{i}", key=f"acct-{i % 5}")
            for i in range(20)
        ]
    with api.broker.producer(idempotence="message_id") as second_producer:
        futures = [
            second_producer.send_async(
                "payments", f"v{i}", message_id=f"id-{i}", key=f"acct-{i % 5}"
            )
            for i in range(25)
        ]
        second_producer.flush()
    seconds = [api.result(f) for f in futures]
    for first, second in zip(firsts, seconds[:20], strict=True):
        assert second.duplicate is True
        assert (second.partition, second.offset) == (first.partition, first.offset)
    assert not any(meta.duplicate for meta in seconds[20:])
    stored = read_all(broker, "payments")
    assert sorted(m.message_id for m in stored) == sorted(f"id-{i}".encode() for i in range(25))


def test_duplicate_ids_inside_one_batch(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer(idempotence="message_id", linger_ms=200) as producer:
        futures = [producer.send_async("t", f"v{i}", message_id="same") for i in range(3)]
        futures.append(producer.send_async("t", b"other", message_id="different"))
        producer.flush()
    metas = [api.result(f) for f in futures]
    assert [m.duplicate for m in metas] == [False, True, True, False]
    assert metas[1].offset == metas[2].offset == metas[0].offset
    stored = read_all(broker, "t")
    assert sorted(m.value for m in stored) == [b"other", b"v0"]


def test_generated_message_ids_are_unique_and_stored(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=3)
    with api.broker.producer(idempotence="message_id") as producer:
        send_async = producer.send_async
        futures = [send_async("t", f"v{i}") for i in range(3000)]
        producer.flush()
    metas = [api.result(f) for f in futures]
    assert not any(m.duplicate for m in metas)
    stored = read_all(broker, "t")
    ids = [m.message_id for m in stored]
    assert len(stored) == 3000
    assert None not in ids
    assert len(set(ids)) == 3000
    for message in stored:  # without a key, the id routes the message
        assert message.partition == zlib.crc32(message.message_id) % 3


def test_no_idempotence_appends_plainly(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    with api.broker.producer(idempotence=None) as producer:
        first = producer.send("t", b"a", key="k")
        second = producer.send("t", b"a", key="k")  # the same message twice: two entries
        futures = [producer.send_async("t", f"v{i}", key="k") for i in range(100)]
        producer.flush()
    assert not first.duplicate and not second.duplicate
    assert first.offset != second.offset
    values = [m.value for m in broker.read("t", first.partition)]
    assert values == [b"a", b"a"] + [f"v{i}".encode() for i in range(100)]
    assert [api.result(f).offset for f in futures] == [
        m.offset for m in broker.read("t", first.partition)
    ][2:]


def send_numbered(producer: Any, idempotence: str | None, count: int) -> list[Any]:
    """send_async of values v0, v1, ... over keys k0-k2 (ids id-0, id-1, ... in message_id
    mode), through either API's producer: their futures, in order."""
    return [
        producer.send_async(
            "t", f"v{i}", key=f"k{i % 3}",
            message_id=f"id-{i}" if idempotence == "message_id" else None,
        )
        for i in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
def test_a_stream_ahead_of_the_server_clock_gets_the_next_ids_of_its_millisecond(
    api: Any, broker: redisq.Broker, idempotence: str | None
) -> None:
    """The last entry's ID is an hour ahead of the server's clock (a failover to a server whose
    clock is behind): a batch continues in that millisecond, with consecutive IDs, and its
    offsets are the stored ones (message_id: a resend answers them as the originals)."""
    broker.create_topic("t", partitions=1)
    log = broker.keys.log("t", 0)
    ahead_ms = int(broker.client.time()[0]) * 1000 + 3_600_000
    broker.client.xadd(log, {"v": b"ahead"}, id=f"{ahead_ms}-5")
    with api.broker.producer(idempotence=idempotence, max_batch_messages=40) as producer:
        futures = send_numbered(producer, idempotence, 100)
        producer.flush()
        offsets = [api.result(f).offset for f in futures]
        if idempotence == "message_id":
            again = [producer.send("t", b"again", key="k0", message_id=f"id-{i}") for i in (0, 99)]
            assert [(m.duplicate, m.offset) for m in again] == [
                (True, offsets[0]), (True, offsets[99])
            ]  # fmt: skip
    assert offsets == [f"{ahead_ms}-{6 + i}" for i in range(100)]
    stored = list(broker.read("t", 0))
    assert [m.offset for m in stored] == [f"{ahead_ms}-5", *offsets]
    assert [m.value for m in stored] == [b"ahead"] + [f"v{i}".encode() for i in range(100)]


# -- named producers and fencing ----------------------------------------------------------------


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Producers to close at the end of a test, whatever happened to them."""
    producers: list[Any] = []
    yield producers
    for producer in producers:
        producer.close(timeout=10)


def test_new_instance_fences_the_old_one(
    api: Any, broker: redisq.Broker, closing: list[Any]
) -> None:
    broker.create_topic("t1", partitions=2)
    broker.create_topic("t2", partitions=2)
    a = api.broker.producer(name="svc")
    closing.append(a)
    a_meta = [a.send("t1", f"a{i}", key=f"k{i}") for i in range(4)]

    b = api.broker.producer(name="svc")
    closing.append(b)
    assert b.producer_id == a.producer_id
    assert b.epoch > a.epoch

    before = snapshot(broker)
    with pytest.raises(redisq.ProducerFenced):
        a.send("t1", b"zombie-1", key="k1")
    with pytest.raises(redisq.ProducerFenced):  # once fenced, fenced everywhere
        a.send("t2", b"zombie-2", key="k1")
    with pytest.raises(redisq.ProducerFenced):
        a.send_async("t1", b"zombie-3", key="k2")
    assert snapshot(broker) == before, "the fenced instance wrote something"

    b_meta = [b.send("t1", f"b{i}", key=f"k{i}") for i in range(4)]
    b_meta.append(b.send("t2", b"b-t2", key="k1"))
    assert not any(m.duplicate for m in b_meta)

    values = sorted(m.value for m in read_all(broker, "t1") + read_all(broker, "t2"))
    assert values == sorted([b"a0", b"a1", b"a2", b"a3", b"b0", b"b1", b"b2", b"b3", b"b-t2"])
    assert {m.offset for m in a_meta} <= {m.offset for m in read_all(broker, "t1")}


def test_fenced_on_a_topic_the_old_instance_never_wrote(
    api: Any, broker: redisq.Broker, closing: list[Any]
) -> None:
    broker.create_topic("t1", partitions=2)
    broker.create_topic("fresh", partitions=2)
    a = api.broker.producer(name="svc")
    closing.append(a)
    a.send("t1", b"a", key="k")
    b = api.broker.producer(name="svc")
    closing.append(b)
    before = snapshot(broker)
    with pytest.raises(redisq.ProducerFenced):
        a.send("fresh", b"zombie", key="k")
    with pytest.raises(redisq.ProducerFenced):
        a.send("t1", b"zombie", key="k")
    assert snapshot(broker) == before
    assert b.send("fresh", b"b", key="k").duplicate is False
    assert [m.value for m in read_all(broker, "fresh")] == [b"b"]


def test_fencing_fails_batches_in_flight(
    api: Any, broker: redisq.Broker, closing: list[Any]
) -> None:
    broker.create_topic("t", partitions=2)
    a = api.broker.producer(name="svc", linger_ms=60_000)
    closing.append(a)
    a.send("t", b"before", key="k")
    pending = [a.send_async("t", f"p{i}", key="k") for i in range(10)]  # lingering
    b = api.broker.producer(name="svc")
    closing.append(b)
    a.flush(timeout=10)
    for future in pending:  # what was waiting in a's batches fails too
        assert isinstance(failure(api, future), redisq.ProducerFenced)
    with pytest.raises(redisq.ProducerFenced):
        a.send_async("t", b"later", key="k")
    assert [m.value for m in read_all(broker, "t")] == [b"before"]


def test_producers_with_different_names_do_not_fence_each_other(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("t", partitions=1)
    with api.broker.producer(name="one") as one, api.broker.producer(name="two") as two:
        one.send("t", b"1a")
        two.send("t", b"2a")
        one.send("t", b"1b")
        two.send("t", b"2b")
        assert one.producer_id != two.producer_id
    assert [m.value for m in broker.read("t", 0)] == [b"1a", b"2a", b"1b", b"2b"]


# -- a lost reply ---------------------------------------------------------------------------------


def test_lost_reply_is_answered_from_the_window(
    api: Any, broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops after the server ran the scripts: the re-sent batches are duplicates
    inside the window and come back with the offsets they were written at; nothing twice."""
    broker.create_topic("t", partitions=1)
    failures = {"left": 1}
    lock = threading.Lock()

    def lose(replies: list[Any]) -> list[Any]:
        written = any(isinstance(r, list) and r[:1] == [b"OK"] for r in replies)
        with lock:
            if written and failures["left"]:  # the scripts ran; their replies are lost
                failures["left"] -= 1
                raise redis.ConnectionError("injected: connection lost")
        return replies

    if api.name == "sync":
        real_read = Transport.read

        def flaky_read(
            self: Transport, node: str, count: int, deadline: float | None = None
        ) -> list[Any]:
            return lose(real_read(self, node, count, deadline))

        monkeypatch.setattr(Transport, "read", flaky_read)
    else:
        real_async_read = AsyncTransport.read

        async def flaky_async_read(
            self: AsyncTransport, node: str, count: int, deadline: float | None = None
        ) -> list[Any]:
            return lose(await real_async_read(self, node, count, deadline))

        monkeypatch.setattr(AsyncTransport, "read", flaky_async_read)
    # one batch: a long linger holds the five sends until flush() (with a short one a sender
    # could take them as two batches, and only the first reply would be lost)
    with api.broker.producer(retry_backoff_ms=1, linger_ms=30_000) as producer:
        futures = [producer.send_async("t", f"m{i}".encode()) for i in range(5)]
        producer.flush()
    assert failures["left"] == 0, "the injection never fired"
    metas = [api.result(f) for f in futures]
    stored = list(broker.read("t", 0))
    assert [m.value for m in stored] == [f"m{i}".encode() for i in range(5)]
    assert [m.offset for m in metas] == [m.offset for m in stored]
    assert all(m.duplicate for m in metas)  # the answer came from the window


# -- retention ----------------------------------------------------------------------------------


def test_retention_by_count_keeps_the_newest_near_the_bound(broker: redisq.Broker) -> None:
    # message entries: trimming ~ in whole stream nodes of entries (tests/batches: batch entries)
    broker.create_topic("t", partitions=1, retention_messages=100, entry_format="message")
    with broker.producer(max_batch_messages=50) as producer:
        send_async = producer.send_async
        futures = [send_async("t", f"v{i}") for i in range(3000)]
        producer.flush()
    offsets = [f.result().offset for f in futures]
    stored = list(broker.read("t", 0))
    length = broker.client.xlen(broker.keys.log("t", 0))
    assert length == len(stored)
    # Approximate trimming (MAXLEN ~) keeps at least the bound and drops whole stream nodes.
    assert 100 <= length <= 300, length
    assert [m.offset for m in stored] == offsets[-length:]
    assert stored[-1].value == b"v2999"


def test_retention_by_age_trims_old_entries_on_a_later_write(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1, retention_ms=1000, entry_format="message")
    with broker.producer(max_batch_messages=100) as producer:
        old = [producer.send_async("t", f"old{i}") for i in range(1000)]
        producer.flush()
        assert broker.describe_topic("t").total_messages == 1000  # nothing is old yet
        time.sleep(1.3)
        new = [producer.send_async("t", f"new{i}") for i in range(50)]
        producer.flush()
    assert all(f.exception() is None for f in old + new)
    stored = list(broker.read("t", 0))
    remaining_old = [m for m in stored if m.value.startswith(b"old")]
    # MINID ~ drops whole stream nodes (at most 100 entries each by default).
    assert len(remaining_old) < 100, len(remaining_old)
    assert [m.value for m in stored if m.value.startswith(b"new")] == [
        f"new{i}".encode() for i in range(50)
    ]


# -- acks ---------------------------------------------------------------------------------------


def test_acks_fsync_needs_waitaof_and_aof(api: Any, broker: redisq.Broker, backend: str) -> None:
    """The shared servers: Redis 7.0 has no WAITAOF; the fixture's Valkey servers (standalone and
    cluster) run without AOF. Each refuses when the producer starts (the thread API's at
    creation), before anything is written."""
    broker.create_topic("t")
    before = snapshot(broker)
    with pytest.raises(redisq.UnsupportedServer) as info:
        api.broker.producer(acks="fsync")
    if backend == "redis" and broker.server.startswith("redis 7.0"):
        assert "WAITAOF" in str(info.value)
    else:
        assert "appendonly yes" in str(info.value)
    assert snapshot(broker) == before


def test_acks_fsync_on_valkey_with_aof(caplog: pytest.LogCaptureFixture) -> None:
    """On a fresh server (no script loaded yet) every send is confirmed, and the barrier
    script's first NOSCRIPT, loaded and sent again, is no warning to the user."""
    server = ServerProcess(config={"appendonly": "yes", "appendfsync": "everysec"}).start()
    try:
        with redisq.connect(server.url, namespace=f"t{uuid.uuid4().hex[:8]}") as broker:
            broker.create_topic("t", partitions=2)
            caplog.set_level(logging.WARNING, logger="redisq")
            with broker.producer(acks="fsync") as producer:
                meta = producer.send("t", b"durable", key="k")
                futures = [producer.send_async("t", f"v{i}", key="k") for i in range(200)]
                producer.flush()
            assert all(f.exception() is None for f in futures)
            values = [m.value for m in broker.read("t", meta.partition)]
            assert values == [b"durable"] + [f"v{i}".encode() for i in range(200)]
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        server.stop()


# -- the broker-side window (produce_sequence.lua, driven directly) ------------------------------

PID = 900_001


@dataclass
class _Batch:
    """A sealed batch as protocol.produce takes it."""

    topic: str
    partition: int
    layout: str
    count: int
    base_seq: int
    args: list[bytes]
    body: bytes | None = None
    body_count: int = 0


def produce_sequence(
    broker: Any,
    base: int,
    values: list[bytes],
    *,
    epoch: int = 1,
    acked_next: int = 0,
    window: int = 3,
    name: str | None = None,
) -> BatchResult:
    """One batch of ("key", value) messages through the protocol layer, as the producer sends it,
    by `broker`'s script executor (the API under test's: `api.broker`)."""
    args: list[bytes] = []
    for value in values:
        args += encode_message(b"key", value, None, None)
    batch = _Batch("w", 0, "kv", len(values), base, args)
    config = TopicConfig("w", 1, producer_state_ttl_ms=60_000)
    identity = ProducerIdentity(PID, epoch, name)
    call = produce(broker.keys, "sequence", identity, config, batch, acked_next=acked_next,
                   window=window)  # fmt: skip
    return broker.scripts.run(call)


def stream(broker: redisq.Broker) -> list[redisq.Message]:
    return list(broker.read("w", 0))


def test_window_resent_batch_inside_window_is_a_dup_with_original_offset(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("w")
    first = produce_sequence(api.broker, 0, [b"a", b"b"])
    assert not first.duplicate and first.first_id
    assert not produce_sequence(api.broker, 2, [b"c"]).duplicate
    before = snapshot(broker)

    assert produce_sequence(api.broker, 0, [b"a", b"b"]) == BatchResult(first.first_id, True)
    assert snapshot(broker) == before
    stored = stream(broker)
    assert [m.value for m in stored] == [b"a", b"b", b"c"]
    assert stored[0].offset == first.first_id
    assert [(m.producer_id, m.sequence) for m in stored] == [(PID, 0), (PID, 1), (PID, 2)]


def test_window_older_duplicate_has_no_offset(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("w")
    for base in range(5):  # five one-message batches; the window remembers the last 3
        assert not produce_sequence(api.broker, base, [b"%d" % base]).duplicate
    before = snapshot(broker)
    assert produce_sequence(api.broker, 0, [b"0"]) == BatchResult(None, True)
    assert produce_sequence(api.broker, 1, [b"1"]) == BatchResult(None, True)
    assert produce_sequence(api.broker, 2, [b"2"]).duplicate
    inside = produce_sequence(api.broker, 2, [b"2"])  # still inside the window
    assert inside.first_id == stream(broker)[2].offset
    assert snapshot(broker) == before
    assert [m.value for m in stream(broker)] == [b"0", b"1", b"2", b"3", b"4"]


def test_window_gap_is_out_of_order_with_the_expected_sequence(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("w")
    produce_sequence(api.broker, 0, [b"a", b"b", b"c"])
    before = snapshot(broker)
    with pytest.raises(redisq.OutOfOrderSequence) as info:
        produce_sequence(api.broker, 5, [b"f"])
    assert info.value.expected == 3
    assert info.value.retriable
    assert snapshot(broker) == before
    assert not produce_sequence(api.broker, 3, [b"d"]).duplicate  # the expected one goes in
    assert [m.value for m in stream(broker)] == [b"a", b"b", b"c", b"d"]


def test_window_moves_on_when_the_broker_lost_acknowledged_batches(
    api: Any, broker: redisq.Broker
) -> None:
    """After a failover to a replica that missed acknowledged writes, the broker expects a
    sequence the producer has long had acknowledged: the producer's acked_next wins, so the next
    batch goes in instead of being refused as a gap until the delivery timeout."""
    broker.create_topic("w")
    produce_sequence(api.broker, 0, [b"a", b"b"])  # the replica had these two
    # The producer had 0..5 acknowledged by the old primary: the new one expects 2.
    with pytest.raises(redisq.OutOfOrderSequence) as info:
        produce_sequence(api.broker, 6, [b"g"])  # a producer that does not say what was acked
    assert info.value.expected == 2
    assert not produce_sequence(api.broker, 6, [b"g"], acked_next=6).duplicate
    assert produce_sequence(api.broker, 6, [b"g"], acked_next=6).duplicate  # still deduplicated
    with pytest.raises(redisq.OutOfOrderSequence):
        produce_sequence(api.broker, 9, [b"j"], acked_next=6)  # a real gap is still a gap
    assert [m.value for m in stream(broker)] == [b"a", b"b", b"g"]


def test_window_older_epoch_is_fenced(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("w")
    produce_sequence(api.broker, 0, [b"a"], epoch=1)
    assert not produce_sequence(api.broker, 0, [b"b"], epoch=2).duplicate  # a new epoch restarts
    before = snapshot(broker)
    with pytest.raises(redisq.ProducerFenced):
        produce_sequence(api.broker, 1, [b"zombie"], epoch=1)
    with pytest.raises(redisq.ProducerFenced):
        produce_sequence(api.broker, 0, [b"a"], epoch=1)
    assert snapshot(broker) == before
    assert [m.value for m in stream(broker)] == [b"a", b"b"]


def test_window_named_producer_needs_its_epoch_on_the_partition(
    api: Any, broker: redisq.Broker
) -> None:
    """A named producer's write to a partition that does not carry its epoch (state expired,
    partition added later, state lost) writes nothing: a missing state cannot tell a new
    instance from a zombie. Once the epoch is stored there (fence_producer), it goes in."""
    broker.create_topic("w")
    before = snapshot(broker)
    with pytest.raises(UnknownProducer):
        produce_sequence(api.broker, 0, [b"a"], epoch=5, name="svc")
    assert snapshot(broker) == before
    produce_sequence(api.broker, 0, [b"old"], epoch=4)  # an older epoch's state (anonymous write)
    with pytest.raises(UnknownProducer):
        produce_sequence(api.broker, 0, [b"a"], epoch=5, name="svc")
    identity = ProducerIdentity(PID, 5, "svc")
    config = TopicConfig("w", 1, producer_state_ttl_ms=60_000)
    assert api.broker.scripts.run(fence_partition(broker.keys, identity, config, 0)) is True
    assert not produce_sequence(api.broker, 0, [b"a"], epoch=5, name="svc").duplicate
    with pytest.raises(redisq.ProducerFenced):  # and the older epoch is refused from now on
        api.broker.scripts.run(fence_partition(broker.keys, ProducerIdentity(PID, 4), config, 0))
    assert [m.value for m in stream(broker)] == [b"old", b"a"]


def test_window_missing_topic(api: Any, broker: redisq.Broker) -> None:
    before = snapshot(broker)
    with pytest.raises(redisq.TopicNotFound):
        produce_sequence(api.broker, 0, [b"a"])
    assert snapshot(broker) == before


def test_window_pipelined_steps_answer_each_step(api: Any, broker: redisq.Broker) -> None:
    """Steps sent in one round trip (the executor's list form) answer each in order, a refused
    one with its error in place of a result; the refused step writes nothing."""
    broker.create_topic("w")
    produce_sequence(api.broker, 0, [b"a"])
    config = TopicConfig("w", 1, producer_state_ttl_ms=60_000)
    steps = [
        produce(
            broker.keys,
            "sequence",
            ProducerIdentity(PID, 1),
            config,
            _Batch("w", 0, "kv", 1, base, encode_message(b"key", b"p", None, None)),
            acked_next=0,
            window=3,
        )
        for base in (1, 5)
    ]
    results = api.broker.scripts.execute(steps)
    assert not results[0].duplicate
    assert isinstance(results[1], redisq.OutOfOrderSequence) and results[1].expected == 2
    assert [m.value for m in stream(broker)] == [b"a", b"p"]
