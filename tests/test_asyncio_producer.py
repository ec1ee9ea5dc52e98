"""The asyncio producer (redisq.asyncio) on real servers: the guarantees of tests/test_producer.py
and tests/test_faults.py through `await producer.send(...)` and `producer.send_async(...)`.

Routing by key, per-key order with many batches in flight (also across send_async and send, and
across concurrent tasks), asyncio futures, bad input, both idempotence modes, fencing of named
producers, a lost reply answered from the broker's window, the protocol layer's window driven by
the asyncio executor; then faults on servers of the test's own: the server SIGSTOPped (delivery
timeout), connections killed (CLIENT KILL) and the server SIGKILLed and restarted (AOF).

Tests taking `env` run on each backend (valkey, valkey-cluster, redis, valkey-cluster3); what
the asyncio API wrote is read back through it and, independently, through the sync broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
import uuid
import zlib
from collections import Counter, defaultdict
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
from redisq.asyncio.transport import AsyncTransport
from redisq.errors import UnknownProducer
from redisq.protocol.produce import BatchResult, ProducerIdentity, encode_message, produce
from redisq.topic import TopicConfig
from tests.aio import Env, Killer, aio, read_all
from tests.servers import ServerProcess, binary_for
from tests.test_producer import _Batch, send_numbered
from tests.test_topics import snapshot


def sync_read_all(broker: redisq.Broker, topic: str) -> list[redisq.Message]:
    partitions = broker.describe_topic(topic).config.partitions
    return [m for p in range(partitions) for m in broker.read(topic, p)]


# -- send and routing ---------------------------------------------------------------------------


@aio
async def test_send_answers_the_stored_message_routed_by_crc32(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=5)
        keys = [f"customer-{i}" for i in range(40)] + ["ключ", "🙂"]
        async with broker.producer() as producer:
            metas = []
            for key in keys:
                as_str = await producer.send("orders", f"s-{key}", key=key, headers={"h": "1"})
                as_bytes = await producer.send("orders", f"b-{key}", key=key.encode())
                expected = zlib.crc32(key.encode("utf-8")) % 5
                assert as_str.partition == as_bytes.partition == expected
                assert isinstance(as_str, rq.RecordMetadata) and not as_str.duplicate
                metas += [(key, as_str), (key, as_bytes)]
        assert len({zlib.crc32(k.encode()) % 5 for k in keys}) == 5  # the keys really spread
        stored = {(m.partition, m.offset): m for m in await read_all(broker, "orders")}
    assert len(stored) == 2 * len(keys)
    for key, meta in metas:
        message = stored[(meta.partition, meta.offset)]
        assert message.key == key.encode() and message.topic == "orders"
        assert message.value.endswith(key.encode())
        assert message.timestamp_ms == int(meta.offset.split("-")[0])
        assert abs(message.timestamp - time.time()) < 60
    assert {(m.partition, m.offset) for m in sync_read_all(env.sync, "orders")} == set(stored)
    first = stored[(metas[0][1].partition, metas[0][1].offset)]
    assert first.headers == {"h": b"1"} and first.producer_id is not None


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
@aio
async def test_per_key_order_with_many_batches_in_flight(env: Env, idempotence: str) -> None:
    """20,000 send_async over 300 keys, batches of 50, five in flight per partition: every future
    answers where its message is, each key's messages are stored in send order, once."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=4)
        rng = random.Random(7)
        sent: dict[str, list[bytes]] = defaultdict(list)
        futures = []
        async with broker.producer(
            idempotence=idempotence, max_batch_messages=50, max_in_flight=5, linger_ms=2
        ) as producer:
            for i in range(20_000):
                key = f"k{rng.randrange(300)}"
                value = f"{key}:{i}".encode()
                sent[key].append(value)
                future = producer.send_async("orders", value, key=key)
                assert isinstance(future, asyncio.Future)
                futures.append((key, value, future))
                if i % 1000 == 999:
                    await asyncio.sleep(0)  # let the sender run while more are queued
            await producer.flush()
        assert all(f.done() for _, _, f in futures), "flush returned with futures pending"
        results = {value: future.result() for _, value, future in futures}
        stored = await read_all(broker, "orders")
    assert not any(meta.duplicate for meta in results.values())
    assert len(stored) == 20_000
    by_key: dict[str, list[bytes]] = defaultdict(list)
    for message in stored:  # partition by partition, in offset order
        by_key[message.key.decode()].append(message.value)
    assert by_key == sent
    at = {(m.partition, m.offset): m for m in stored}
    for key, value, _ in futures:
        meta = results[value]
        assert meta.partition == zlib.crc32(key.encode()) % 4
        assert (at[(meta.partition, meta.offset)].key, at[(meta.partition, meta.offset)].value) == (
            key.encode(),
            value,
        )
    if idempotence == "sequence":  # per-partition sequences count messages from 0, no gaps
        for p in range(4):
            sequences = [m.sequence for m in stored if m.partition == p]
            assert sequences == list(range(len(sequences)))


@aio
async def test_send_after_send_async_keeps_their_order(env: Env) -> None:
    """send_async() queues messages for topics whose metadata is not loaded yet; a send() of the
    same key right after must still land after them, even though its own topic's metadata is
    in first (the queued ones wait behind a topic loaded before theirs)."""
    async with env.connect() as broker:
        await broker.create_topic("first", partitions=2)
        await broker.create_topic("second", partitions=3)
        async with broker.producer() as producer:
            queued = [producer.send_async("first", b"f", key="k")]
            queued += [producer.send_async("second", f"q{i}", key="k") for i in range(20)]
            last = await producer.send("second", b"last", key="k")
            metas = await asyncio.gather(*queued)
        values = [m.value async for m in broker.read("second", last.partition)]
    assert values == [f"q{i}".encode() for i in range(20)] + [b"last"]
    assert [m.offset for m in metas[1:]] + [last.offset] == [
        m.offset for m in env.sync.read("second", last.partition)
    ]


@aio
async def test_concurrent_tasks_keep_each_key_in_order(env: Env) -> None:
    """20 tasks share one producer, each awaiting send() for its own key (and send_async for
    another key it shares with every task): every key is stored in each task's send order."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=3)
        async with broker.producer(linger_ms=1) as producer:

            async def task(t: int) -> None:
                for n in range(30):
                    producer.send_async("orders", f"{t}:{n}", key="shared")
                    meta = await producer.send("orders", f"{n}", key=f"task-{t}")
                    assert meta.partition == zlib.crc32(f"task-{t}".encode()) % 3

            await asyncio.gather(*(task(t) for t in range(20)))
        stored = await read_all(broker, "orders")
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


@aio
async def test_send_async_futures_resolve_without_flush(env: Env) -> None:
    """A future is an asyncio.Future: awaiting it is enough (the batch goes after linger_ms)."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        async with broker.producer(linger_ms=20) as producer:
            futures = [producer.send_async("t", f"v{i}", key="k") for i in range(10)]
            metas = await asyncio.wait_for(asyncio.gather(*futures), 30)
            assert all(isinstance(f, asyncio.Future) and f.done() for f in futures)
        values = [m.value async for m in broker.read("t", metas[0].partition)]
    assert values == [f"v{i}".encode() for i in range(10)]
    assert [m.offset for m in metas] == [m.offset for m in env.sync.read("t", metas[0].partition)]


# -- bad input ----------------------------------------------------------------------------------


@aio
async def test_bad_input_raises_at_once_and_writes_nothing(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        async with broker.producer(max_message_bytes=100) as producer:
            await producer.send("t", b"ok", key="k")
            before = snapshot(env.sync)
            for value in (42, {"a": 1}, None, 1.5, ["x"], object()):
                with pytest.raises(TypeError, match=type(value).__name__):
                    await producer.send("t", value)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match=type(value).__name__):
                    producer.send_async("t", value, key="k")  # type: ignore[arg-type]
                with pytest.raises(TypeError):  # also for a topic not loaded yet
                    producer.send_async("not-loaded", value)  # type: ignore[arg-type]
            for key in (7, 2.5, ["k"]):
                with pytest.raises(TypeError, match=type(key).__name__):
                    producer.send_async("t", b"v", key=key)  # type: ignore[arg-type]
            for empty in ("", b""):
                with pytest.raises(ValueError):
                    await producer.send("t", b"v", key=empty)
            for headers in ({1: "x"}, {"name": 5}, [("name", "x")]):
                with pytest.raises(TypeError):
                    producer.send_async("t", b"v", headers=headers)  # type: ignore[arg-type]
            with pytest.raises(redisq.MessageTooLarge) as info:
                await producer.send("t", b"x" * 101)
            assert (info.value.size, info.value.limit) == (101, 100)
            with pytest.raises(redisq.MessageTooLarge):  # the key counts
                producer.send_async("t", b"x" * 100, key="k")
            with pytest.raises(redisq.MessageTooLarge):  # and the headers
                producer.send_async("t", b"x" * 90, headers={"name": "0123456789"})
            with pytest.raises(redisq.MessageTooLarge):  # before the topic is loaded too
                producer.send_async("not-loaded", b"x" * 101)
            with pytest.raises(redisq.PartitionOutOfRange):
                producer.send_async("t", b"v", partition=2)
            with pytest.raises(redisq.PartitionOutOfRange):
                await producer.send("t", b"v", partition=-1)
            # Errors about the topic: from send(), and through the future of send_async().
            with pytest.raises(redisq.InvalidName):
                await producer.send("bad:topic", b"v")
            with pytest.raises(redisq.InvalidName):
                await producer.send_async("bad:name", b"v")
            with pytest.raises(redisq.TopicNotFound):
                await producer.send("missing", b"v")
            missing = producer.send_async("missing", b"v")
            fine = producer.send_async("t", b"after", key="k")  # not held up by the missing one
            with pytest.raises(redisq.TopicNotFound):
                await missing
            await producer.flush()
            assert (await fine).duplicate is False
        assert snapshot(env.sync) != before
        values = [m.value for m in await read_all(broker, "t")]
        assert sorted(values) == [b"after", b"ok"]
        assert "missing" not in await broker.list_topics()
        with pytest.raises(redisq.ProducerClosed):
            await producer.send("t", b"late")
        with pytest.raises(redisq.ProducerClosed):
            producer.send_async("t", b"late")


@pytest.mark.parametrize("loaded", [True, False], ids=["topic-loaded", "first-use"])
@aio
async def test_full_buffer_refuses_send_async_at_once_and_send_waits(
    env: Env, loaded: bool
) -> None:
    """max_buffered_messages waiting: send_async() raises at once (whether or not the topic's
    metadata is loaded yet), so every message it accepted is delivered; send() waits for room."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer(max_buffered_messages=10, linger_ms=300) as producer:
            if loaded:
                await producer.send("t", b"warm-up")
            accepted: list[asyncio.Future[rq.RecordMetadata]] = []
            refused = 0
            for i in range(15):
                try:
                    accepted.append(producer.send_async("t", b"%d" % i))
                except redisq.RedisqError as exc:
                    assert "buffer full" in str(exc)
                    refused += 1
            waited = await producer.send("t", b"waited")
            await producer.flush()
        failures = [f.exception() for f in accepted if f.exception() is not None]
        stored = [m.value async for m in broker.read("t", 0)]
    assert failures == [], f"{len(failures)} accepted messages failed: {failures[:1]}"
    assert (len(accepted), refused) == (10, 5)
    assert stored[-1] == b"waited" and not waited.duplicate
    assert [v for v in stored if v not in (b"warm-up", b"waited")] == [b"%d" % i for i in range(10)]


# -- idempotence="message_id" -------------------------------------------------------------------


@aio
async def test_same_message_id_is_written_once_and_answers_the_first_offset(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("payments", partitions=4)
        async with broker.producer(idempotence="message_id", linger_ms=50) as producer:
            first = await producer.send("payments", b"charge 10", message_id="pay-1")
            again = await producer.send("payments", b"charge 10 (retry)", message_id="pay-1")
            numeric = await producer.send("payments", b"n", message_id=123456)
            numeric_again = await producer.send("payments", b"n", message_id=123456)
            # Inside one batch: the first is written, the others answer its offset.
            batch = [producer.send_async("payments", f"v{i}", message_id="same") for i in range(3)]
            batch.append(producer.send_async("payments", b"other", message_id="different"))
            in_batch = await asyncio.gather(*batch)
        async with broker.producer(idempotence="message_id") as second:  # another instance
            across = await second.send("payments", b"charge 10 (other pod)", message_id="pay-1")
        stored = await read_all(broker, "payments")
    assert first.duplicate is False
    assert again.duplicate is True and again.offset == first.offset
    assert across.duplicate is True and (across.partition, across.offset) == (
        first.partition,
        first.offset,
    )
    assert first.partition == again.partition == zlib.crc32(b"pay-1") % 4
    assert numeric_again.duplicate and numeric_again.offset == numeric.offset
    assert numeric.partition == zlib.crc32(b"123456") % 4
    assert [m.duplicate for m in in_batch] == [False, True, True, False]
    assert in_batch[1].offset == in_batch[2].offset == in_batch[0].offset
    assert sorted(m.value for m in stored) == [b"charge 10", b"n", b"other", b"v0"]
    [original] = [m for m in stored if m.message_id == b"pay-1"]
    assert (original.offset, original.value) == (first.offset, b"charge 10")


@aio
async def test_generated_message_ids_route_and_are_unique(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=3)
        async with broker.producer(idempotence="message_id") as producer:
            futures = [producer.send_async("t", f"v{i}") for i in range(1000)]
            await producer.flush()
        metas = [f.result() for f in futures]
        stored = await read_all(broker, "t")
    assert not any(m.duplicate for m in metas)
    ids = [m.message_id for m in stored]
    assert len(stored) == 1000 and None not in ids and len(set(ids)) == 1000
    for message in stored:  # without a key, the id routes the message
        assert message.partition == zlib.crc32(message.message_id) % 3


@aio
async def test_no_idempotence_appends_plainly(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        async with broker.producer(idempotence=None) as producer:
            first = await producer.send("t", b"a", key="k")
            second = await producer.send("t", b"a", key="k")
            futures = [producer.send_async("t", f"v{i}", key="k") for i in range(50)]
            await producer.flush()
        stored = [m async for m in broker.read("t", first.partition)]
    assert not first.duplicate and not second.duplicate and first.offset != second.offset
    assert [m.value for m in stored] == [b"a", b"a"] + [f"v{i}".encode() for i in range(50)]
    assert [f.result().offset for f in futures] == [m.offset for m in stored][2:]


@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
@aio
async def test_a_stream_ahead_of_the_server_clock_gets_the_next_ids_of_its_millisecond(
    env: Env, idempotence: str | None
) -> None:
    """As tests/test_producer.py's test of that name, through the asyncio producer."""
    log = env.sync.keys.log("t", 0)
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        ahead_ms = int(env.sync.client.time()[0]) * 1000 + 3_600_000
        env.sync.client.xadd(log, {"v": b"ahead"}, id=f"{ahead_ms}-5")
        async with broker.producer(idempotence=idempotence, max_batch_messages=40) as producer:
            futures = send_numbered(producer, idempotence, 100)
            await producer.flush()
            offsets = [f.result().offset for f in futures]
            if idempotence == "message_id":
                again = await producer.send("t", b"again", key="k0", message_id="id-99")
                assert (again.duplicate, again.offset) == (True, offsets[99])
        stored = [m async for m in broker.read("t", 0)]
    assert offsets == [f"{ahead_ms}-{6 + i}" for i in range(100)]
    assert [m.offset for m in stored] == [f"{ahead_ms}-5", *offsets]
    assert [m.value for m in stored] == [b"ahead"] + [f"v{i}".encode() for i in range(100)]


# -- named producers and fencing ----------------------------------------------------------------


@aio
async def test_new_instance_fences_the_old_one(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t1", partitions=2)
        await broker.create_topic("t2", partitions=2)
        await broker.create_topic("fresh", partitions=2)
        a = broker.producer(name="svc", linger_ms=60_000)
        b = broker.producer(name="svc")
        try:
            a_meta = [await a.send("t1", f"a{i}", key=f"k{i}") for i in range(4)]
            lingering = [a.send_async("t1", f"p{i}", key="k1") for i in range(5)]
            await b.start()
            assert b.producer_id == a.producer_id and b.epoch > a.epoch
            before = snapshot(env.sync)
            with pytest.raises(redisq.ProducerFenced):
                await a.send("t1", b"zombie-1", key="k1")
            with pytest.raises(redisq.ProducerFenced):  # once fenced, fenced everywhere
                await a.send("t2", b"zombie-2", key="k1")
            with pytest.raises(redisq.ProducerFenced):
                a.send_async("t1", b"zombie-3", key="k2")
            with pytest.raises(redisq.ProducerFenced):
                await a.send("fresh", b"zombie-4", key="k")
            await a.flush(timeout=10)
            for future in lingering:  # what was waiting in a's batches fails too
                assert isinstance(future.exception(), redisq.ProducerFenced)
            assert snapshot(env.sync) == before, "the fenced instance wrote something"
            b_meta = [await b.send("t1", f"b{i}", key=f"k{i}") for i in range(4)]
            b_meta.append(await b.send("fresh", b"b-fresh", key="k"))
        finally:
            await a.close(timeout=10)
            await b.close(timeout=10)
        stored = await read_all(broker, "t1") + await read_all(broker, "fresh")
    assert not any(m.duplicate for m in b_meta)
    assert sorted(m.value for m in stored) == sorted(
        [b"a0", b"a1", b"a2", b"a3", b"b0", b"b1", b"b2", b"b3", b"b-fresh"]
    )
    assert {m.offset for m in a_meta} <= {m.offset for m in stored}


@aio
async def test_producers_with_different_names_do_not_fence_each_other(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer(name="one") as one, broker.producer(name="two") as two:
            await one.send("t", b"1a")
            await two.send("t", b"2a")
            await one.send("t", b"1b")
            await two.send("t", b"2b")
            assert one.producer_id != two.producer_id
        assert [m.value async for m in broker.read("t", 0)] == [b"1a", b"2a", b"1b", b"2b"]


# -- a lost reply ---------------------------------------------------------------------------------


@aio
async def test_lost_reply_is_answered_from_the_window(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops after the server ran the scripts: the re-sent batches are duplicates
    inside the window and come back with the offsets they were written at; nothing twice."""
    real_read = AsyncTransport.read
    failures = {"left": 1}

    async def flaky_read(
        self: AsyncTransport, node: str, count: int, deadline: float | None = None
    ) -> list[Any]:
        replies = await real_read(self, node, count, deadline)
        written = any(isinstance(r, list) and r[:1] == [b"OK"] for r in replies)
        if written and failures["left"]:  # the scripts ran; their replies are lost
            failures["left"] -= 1
            raise redis.ConnectionError("injected: connection lost")
        return replies

    monkeypatch.setattr(AsyncTransport, "read", flaky_read)
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer(retry_backoff_ms=1) as producer:
            futures = [producer.send_async("t", f"m{i}".encode()) for i in range(5)]
            await producer.flush()
        stored = [m async for m in broker.read("t", 0)]
    assert failures["left"] == 0, "the injection never fired"
    metas = [f.result() for f in futures]
    assert [m.value for m in stored] == [f"m{i}".encode() for i in range(5)]
    assert [m.offset for m in metas] == [m.offset for m in stored]
    assert all(m.duplicate for m in metas)  # the answer came from the window


# -- the broker-side window through the asyncio executor ------------------------------------------

PID = 900_002


async def produce_sequence(
    broker: rq.Broker, base: int, values: list[bytes], *, epoch: int = 1, name: str | None = None
) -> BatchResult:
    args: list[bytes] = []
    for value in values:
        args += encode_message(b"key", value, None, None)
    batch = _Batch("w", 0, "kv", len(values), base, args)
    config = TopicConfig("w", 1, producer_state_ttl_ms=60_000)
    call = produce(broker.keys, "sequence", ProducerIdentity(PID, epoch, name), config, batch,
                   acked_next=0, window=3)  # fmt: skip
    result: BatchResult = await broker.scripts.run(call)
    return result


@aio
async def test_window_answers_through_the_asyncio_executor(env: Env) -> None:
    """produce_sequence.lua driven by the asyncio executor: in the window, the original offset;
    older, no offset; a gap, OutOfOrderSequence with the expected sequence; an older epoch,
    ProducerFenced; a named producer's missing epoch, UnknownProducer. Nothing written."""
    async with env.connect() as broker:
        await broker.create_topic("w")
        first = await produce_sequence(broker, 0, [b"a", b"b"])
        assert not first.duplicate and first.first_id
        for base in range(2, 6):
            assert not (await produce_sequence(broker, base, [b"%d" % base])).duplicate
        before = snapshot(env.sync)
        assert await produce_sequence(broker, 0, [b"a", b"b"]) == BatchResult(None, True)
        inside = await produce_sequence(broker, 4, [b"4"])
        assert (
            inside.duplicate and inside.first_id == [m async for m in broker.read("w", 0)][4].offset
        )
        with pytest.raises(redisq.OutOfOrderSequence) as gap:
            await produce_sequence(broker, 9, [b"9"])
        assert gap.value.expected == 6 and gap.value.retriable
        assert not (await produce_sequence(broker, 0, [b"new"], epoch=2)).duplicate
        after_epoch = snapshot(env.sync)
        with pytest.raises(redisq.ProducerFenced):
            await produce_sequence(broker, 6, [b"zombie"], epoch=1)
        with pytest.raises(UnknownProducer):
            await produce_sequence(broker, 0, [b"named"], epoch=3, name="svc")
        assert snapshot(env.sync) == after_epoch
        assert before != after_epoch
        # Pipelined steps (the executor's list form) answer each step, errors as objects.
        config = TopicConfig("w", 1, producer_state_ttl_ms=60_000)
        steps = [
            produce(
                broker.keys,
                "sequence",
                ProducerIdentity(PID, 2),
                config,
                _Batch("w", 0, "kv", 1, base, encode_message(b"key", b"p", None, None)),
                acked_next=0,
                window=3,
            )  # fmt: skip
            for base in (1, 5)
        ]
        results = await broker.scripts.execute(steps)
        assert not results[0].duplicate
        assert isinstance(results[1], redisq.OutOfOrderSequence) and results[1].expected == 2
        values = [m.value async for m in broker.read("w", 0)]
    assert values == [b"a", b"b", b"2", b"3", b"4", b"5", b"new", b"p"]


# -- faults: a server of the test's own --------------------------------------------------------

TOPIC = "orders"
PARTITIONS = 4

Sent = list[tuple[bytes, bytes, "asyncio.Future[rq.RecordMetadata]"]]


@pytest.fixture
def fault_namespace() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


def check_delivery(broker: redisq.Broker, sent: Sent) -> tuple[int, int]:
    """Every acknowledged message is stored once, at the offset its future answered, and each
    key's messages are stored in send order. Returns (acknowledged, failed)."""
    acked: dict[bytes, rq.RecordMetadata] = {}
    failed = 0
    for _key, value, future in sent:
        assert future.done(), "a future was never resolved"
        if future.exception() is None:
            acked[value] = future.result()
        else:  # outcome unknown: never counted as acknowledged
            failed += 1
    stored = sync_read_all(broker, TOPIC)
    copies = Counter(m.value for m in stored)
    duplicated = {value: n for value, n in copies.items() if n > 1}
    assert not duplicated, f"{len(duplicated)} values stored more than once"
    missing = [value for value in acked if value not in copies]
    assert not missing, f"{len(missing)} acknowledged messages missing, e.g. {missing[:3]}"
    at = {(m.partition, m.offset): m for m in stored}
    index = {value: i for i, (_, value, _) in enumerate(sent)}
    for key, value, _ in sent:
        meta = acked.get(value)
        if meta is not None:
            message = at.get((meta.partition, meta.offset))
            assert message is not None, f"{value!r}: nothing at {meta.partition}/{meta.offset}"
            assert (message.key, message.value) == (key, value)
    order: dict[bytes, list[int]] = defaultdict(list)
    for message in stored:
        assert message.value in index, f"unexpected message {message.value!r}"
        order[message.key].append(index[message.value])
    for key, indexes in order.items():
        assert indexes == sorted(indexes), f"key {key!r} out of order"
    return len(acked), failed


def connection_losses(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if "connection lost" in r.getMessage())


@pytest.mark.fault
@pytest.mark.parametrize("cancelled", [False, True], ids=["close", "close-cancelled"])
@pytest.mark.parametrize("delay_ms", [None, 60_000], ids=["plain", "delayed"])
def test_close_on_a_silent_server_settles_every_future(
    delay_ms: int | None, cancelled: bool, fault_namespace: str
) -> None:
    """The server SIGSTOPped while a send is on its way: close(timeout=0.5) returns (its
    flush gives up with TimeoutError; the sender gets 5 s, then is stopped) and the send's
    future fails with ProducerClosed (its batch may or may not be stored) instead of staying
    pending for ever; a delayed send too. close-cancelled: the close() itself is cancelled
    within those 5 s (wait_for of 1.5 s): the sender is stopped all the same, no task is left
    running and the future fails."""
    server = ServerProcess(binary_for("redis")).start()
    stopped = False

    async def scenario() -> None:
        nonlocal stopped
        broker = await rq.connect(server.url, namespace=fault_namespace)
        try:
            await broker.create_topic(TOPIC, partitions=1)
            producer = broker.producer(delivery_timeout_ms=60_000)
            await producer.send(TOPIC, b"warm-up", delay_ms=delay_ms)
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
            future = producer.send_async(TOPIC, b"x", delay_ms=delay_ms)
            await asyncio.sleep(0.2)  # linger is over: the batch is sent, no answer comes
            if cancelled:
                with pytest.raises(TimeoutError):  # close() cancelled in the sender's grace
                    await asyncio.wait_for(producer.close(timeout=0.5), 1.5)
                others = asyncio.all_tasks() - {asyncio.current_task()}
                done, running = await asyncio.wait(others, timeout=3) if others else ((), ())
                assert not running, f"tasks left running: {running}"
            else:
                with pytest.raises(TimeoutError, match="unacknowledged"):  # the flush gave up
                    await asyncio.wait_for(producer.close(timeout=0.5), 30)  # it returns
            assert future.done(), "a send's future left pending after close()"
            assert isinstance(future.exception(), redisq.ProducerClosed)
            with pytest.raises(redisq.ProducerClosed, match="send after close"):
                producer.send_async(TOPIC, b"y")
        finally:
            if stopped:
                os.kill(server.pid, signal.SIGCONT)
                stopped = False
            await broker.close()

    try:
        asyncio.run(scenario())
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["valkey", "redis"])
@pytest.mark.parametrize("stale_metadata", [False, True], ids=["fresh-metadata", "stale-metadata"])
def test_delivery_timeout_while_the_server_is_stopped(
    kind: str, stale_metadata: bool, fault_namespace: str
) -> None:
    """SIGSTOP: send() fails with DeliveryTimeout within about delivery_timeout_ms, whether or
    not the topic's metadata is due to be read again (metadata_max_age_ms past); after SIGCONT
    a new send works, and each key's messages are in send order in the log (the timed-out one
    stored before the later ones, or not at all)."""
    server = ServerProcess(binary_for(kind)).start()
    stopped = False

    async def scenario() -> None:
        nonlocal stopped
        async with await rq.connect(server.url, namespace=fault_namespace) as broker:
            await broker.create_topic(TOPIC, partitions=2)
            async with broker.producer(
                delivery_timeout_ms=1500,
                metadata_max_age_ms=200 if stale_metadata else 600_000,
                retry_backoff_ms=10,
            ) as producer:
                before = await producer.send(TOPIC, b"before", key="k")
                early = [producer.send_async(TOPIC, f"e{i}", key="other") for i in range(20)]
                await producer.flush()
                if stale_metadata:
                    await asyncio.sleep(0.25)  # metadata_max_age_ms has passed
                os.kill(server.pid, signal.SIGSTOP)
                stopped = True
                started = time.monotonic()
                pending = [producer.send_async(TOPIC, f"p{i}", key="other") for i in range(5)]
                timed_out: BaseException | None = None
                try:
                    await asyncio.wait_for(producer.send(TOPIC, b"during", key="k"), 4.5)
                except redisq.DeliveryTimeout as exc:
                    timed_out = exc
                except TimeoutError:
                    pass
                finally:
                    elapsed = time.monotonic() - started
                    os.kill(server.pid, signal.SIGCONT)
                    stopped = False
                assert timed_out is not None, (
                    f"send() did not fail with DeliveryTimeout within {elapsed:.1f} s of SIGSTOP "
                    "(delivery_timeout_ms=1500)"
                )
                assert 1.0 <= elapsed <= 4.0, f"DeliveryTimeout after {elapsed:.2f} s"
                for future in pending:
                    assert isinstance(await _exception(future), redisq.DeliveryTimeout)
                after = await producer.send(TOPIC, b"after", key="k")
                assert after.partition == before.partition and not after.duplicate
                also = await producer.send(TOPIC, b"after-other", key="other")
            assert all(f.exception() is None for f in early)
            mine = [m async for m in broker.read(TOPIC, before.partition)]
            values_k = [m.value for m in mine if m.key == b"k"]
            assert values_k in ([b"before", b"after"], [b"before", b"during", b"after"])
            theirs = [m async for m in broker.read(TOPIC, also.partition)]
            others = [m.value for m in theirs if m.key == b"other"]
            assert others[:20] == [f"e{i}".encode() for i in range(20)]
            assert others[-1] == b"after-other"
            stored_pending = others[20:-1]
            assert stored_pending == [f"p{i}".encode() for i in range(len(stored_pending))]
            # The error tells what happened during the stop, not what went wrong before it.
            assert "NOSCRIPT" not in str(timed_out), str(timed_out)

    try:
        asyncio.run(scenario())
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


async def _exception(future: asyncio.Future[Any]) -> BaseException | None:
    try:
        await asyncio.wait_for(asyncio.shield(future), 10)
    except Exception as exc:
        return exc
    return None


@pytest.mark.fault
@pytest.mark.parametrize(
    ("kind", "idempotence"),
    [("valkey", "sequence"), ("valkey", "message_id"), ("redis", "sequence")],
)
def test_client_kill_during_async_sends(
    kind: str, idempotence: str, fault_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Connections killed every 20 ms while 10,000 messages go out: every one is acknowledged,
    stored once at its offset, each key in send order."""
    caplog.set_level(logging.WARNING, logger="redisq.asyncio.producer")
    server = ServerProcess(binary_for(kind)).start()
    killer = Killer(server, interval=0.02)
    sent: Sent = []

    async def scenario() -> None:
        async with await rq.connect(server.url, namespace=fault_namespace) as abroker:
            await abroker.create_topic(TOPIC, partitions=PARTITIONS)
            producer = abroker.producer(
                name="svc" if idempotence == "sequence" else None,
                idempotence=idempotence,
                max_batch_messages=100,
                delivery_timeout_ms=60_000,
            )
            await producer.start()
            killer.start()
            try:
                rng = random.Random(10_000)
                for i in range(10_000):
                    key = b"key-%d" % rng.randrange(300)
                    value = b"%s:%d" % (key, i)
                    sent.append((key, value, producer.send_async(TOPIC, value, key=key)))
                    if i % 200 == 199:
                        await asyncio.sleep(0.005)  # paced: sends go on while connections die
                await producer.flush(timeout=90)
            finally:
                killer.stop()
                await producer.close(timeout=30)

    try:
        asyncio.run(scenario())
        with redisq.connect(server.url, namespace=fault_namespace) as broker:
            acked, failed = check_delivery(broker, sent)
    finally:
        killer.stop()
        server.stop()
    assert killer.killed > 0
    assert connection_losses(caplog) > 0, "the producer never lost a connection"
    assert (acked, failed) == (10_000, 0)


@pytest.mark.fault
@pytest.mark.parametrize(("kind", "idempotence"), [("valkey", "sequence"), ("redis", "message_id")])
def test_sigkill_and_restart_with_aof_during_async_sends(
    kind: str, idempotence: str, fault_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server is SIGKILLed once a quarter of 12,000 messages are acknowledged and restarted
    from its AOF (appendfsync always): everything is acknowledged, stored once, in key order."""
    caplog.set_level(logging.WARNING, logger="redisq.asyncio.producer")
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    sent: Sent = []
    crashed_after: list[int] = []

    async def scenario() -> None:
        async with await rq.connect(server.url, namespace=fault_namespace) as abroker:
            await abroker.create_topic(TOPIC, partitions=PARTITIONS)
            producer = abroker.producer(
                name="svc" if idempotence == "sequence" else None,
                idempotence=idempotence,
                max_batch_messages=200,
                delivery_timeout_ms=60_000,
            )
            restart: asyncio.Future[None] | None = None
            try:
                rng = random.Random(12_000)
                for i in range(12_000):
                    key = b"key-%d" % rng.randrange(300)
                    value = b"%s:%d" % (key, i)
                    sent.append((key, value, producer.send_async(TOPIC, value, key=key)))
                    if i % 500 == 499:
                        await asyncio.sleep(0.05)  # paced, so the crash lands mid-stream
                        done = sum(1 for *_, f in sent if f.done())
                        if restart is None and done >= 3_000:
                            crashed_after.append(done)
                            restart = asyncio.ensure_future(asyncio.to_thread(server.restart))
                assert restart is not None, "the crash never came"
                await asyncio.wait_for(restart, 30)
                await producer.flush(timeout=90)
            finally:
                await producer.close(timeout=30)

    try:
        asyncio.run(scenario())
        with redisq.connect(server.url, namespace=fault_namespace) as broker:
            acked, failed = check_delivery(broker, sent)
    finally:
        server.stop()
    assert crashed_after and crashed_after[0] < 12_000, "the crash came after everything"
    assert connection_losses(caplog) > 0, "the producer never saw the crash"
    assert (acked, failed) == (12_000, 0)


@aio
async def test_acks_fsync_needs_waitaof_and_aof(env: Env, backend: str) -> None:
    """The shared servers: Redis 7.0 has no WAITAOF, the fixture's Valkey servers (standalone and
    cluster) run without AOF: start() refuses, before anything is written."""
    async with env.connect() as broker:
        await broker.create_topic("t")
        before = snapshot(env.sync)
        with pytest.raises(redisq.UnsupportedServer):
            await broker.producer(acks="fsync").start()
        assert snapshot(env.sync) == before
