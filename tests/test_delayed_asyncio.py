"""Delayed messages through redisq.asyncio on real servers: the guarantees of
tests/test_delayed.py through `await producer.send(..., delay_ms=...)`, `send_async`, the
asyncio consumer (which runs the scheduler of its topics) and redisq.asyncio.Scheduler.
Tests taking `env` run on each backend (valkey, valkey-cluster, redis, valkey-cluster3).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

import redisq
from redisq.asyncio.scheduler import Scheduler as AsyncScheduler
from redisq.asyncio.transport import AsyncTransport
from redisq.errors import InvalidConfig
from redisq.protocol import ScriptCall
from redisq.scheduler import Scheduler
from tests.aio import Env, aio, read_all, wait_until


@aio
async def test_delivered_once_never_before_due_by_a_consumer(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=3)
        at = datetime.now(UTC) + timedelta(milliseconds=400)
        async with broker.producer() as producer:
            first = await producer.send("orders", b"first", key="k", delay_ms=200)
            futures = [
                producer.send_async("orders", b"%d" % i, key=f"k{i % 5}", delay_ms=200 + i)
                for i in range(200)
            ]
            futures.append(producer.send_async("orders", b"at", key="k", deliver_at=at))
            metas = [first] + list(await asyncio.gather(*futures))
        assert all(m.offset is None and not m.duplicate and m.deliver_at_ms for m in metas)
        assert metas[-1].deliver_at_ms == int(at.timestamp() * 1000)
        values = [b"first"] + [b"%d" % i for i in range(200)] + [b"at"]
        due = dict(zip(values, (m.deliver_at_ms for m in metas), strict=True))
        # The producer is closed: the consumer's scheduler delivers.
        got: list[redisq.Message] = []
        async with broker.consumer("orders", group="g") as consumer:

            async def all_in() -> bool:
                for message in await consumer.poll(timeout=0.1):
                    got.append(message)
                    await consumer.ack(message)
                return len(got) >= len(values)

            await wait_until(all_in, timeout=20, what="delivery")
            await asyncio.sleep(0.3)
            got += await consumer.poll(timeout=0.1)
        assert sorted(m.value for m in got) == sorted(values)
        for message in got:
            assert message.timestamp_ms >= due[message.value]  # the server's clock, both
        assert (await broker.describe_topic("orders")).total_scheduled == 0
    assert Counter(m.value for m in env.sync.read("orders", 0)) == Counter(
        m.value for m in got if m.partition == 0
    )


@aio
async def test_equal_due_times_keep_send_order_per_key(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=3)
        at = datetime.now(UTC) + timedelta(milliseconds=500)
        async with broker.producer(max_batch_messages=9) as producer:
            for i in range(200):
                producer.send_async("orders", b"%d" % i, key=f"k{i % 2}", deliver_at=at)
            await producer.flush()
            await wait_until(
                lambda: env.sync.describe_topic("orders").total_messages >= 200, what="delivery"
            )
        by_key: dict[bytes | None, list[bytes]] = {}
        for message in await read_all(broker, "orders"):
            by_key.setdefault(message.key, []).append(message.value)
    for k in range(2):
        assert by_key[f"k{k}".encode()] == [b"%d" % i for i in range(k, 200, 2)]


@aio
async def test_a_resent_batch_after_a_lost_reply_is_stored_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        real = AsyncTransport.execute  # the delayed sender's rounds (its own connections)
        lost: list[int] = []

        async def execute(self: AsyncTransport, steps: Any, *args: Any) -> Any:
            result = await real(self, steps, *args)
            scheduling = any(isinstance(s, ScriptCall) and s.script == "schedule" for s in steps)
            if scheduling and not lost:
                lost.append(1)
                # Lose the reply only once the messages were delivered: the re-sent batch
                # must meet the tombstones.
                await wait_until(lambda: env.sync.client.xlen(log) == 4, what="delivery")
                raise redis.ConnectionError("reply lost (test)")
            return result

        log = broker.keys.log("orders", 0)
        monkeypatch.setattr(AsyncTransport, "execute", execute)
        async with broker.producer(retry_backoff_ms=10) as producer:
            futures = [producer.send_async("orders", b"v%d" % i, delay_ms=100) for i in range(4)]
            metas = await asyncio.gather(*futures)
            await asyncio.sleep(0.3)
    assert lost == [1]
    assert all(m.duplicate and m.deliver_at_ms is None for m in metas)
    assert [m.value for m in env.sync.read("orders", 0)] == [b"v%d" % i for i in range(4)]


@aio
async def test_bad_input_is_refused_with_nothing_stored(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        naive = datetime.now() + timedelta(minutes=1)
        async with broker.producer() as producer:
            for options, error in [
                ({"delay_ms": 0}, InvalidConfig),
                ({"delay_ms": 3 * 24 * 3600 * 1000 + 1}, InvalidConfig),
                ({"delay_ms": 2.5}, TypeError),
                ({"deliver_at": naive}, TypeError),
                ({"delay_ms": 5, "deliver_at": datetime.now(UTC)}, InvalidConfig),
            ]:
                with pytest.raises(error):
                    await producer.send("orders", b"v", **options)
                # Before the topic's metadata is cached, range errors come through the future.
                producer._topics.clear()
                try:
                    future = producer.send_async("orders", b"v", **options)
                except (TypeError, InvalidConfig) as exc:
                    assert isinstance(exc, error)
                else:
                    with pytest.raises(error):
                        await future
            with pytest.raises(TypeError):
                producer.send_async("orders", 42, delay_ms=100)  # type: ignore[arg-type]
            with pytest.raises(redisq.TopicNotFound):
                await producer.send("missing", b"v", delay_ms=100)
            with pytest.raises(redisq.TopicNotFound):
                await producer.send_async("missing", b"v", delay_ms=100)
        assert (await broker.describe_topic("orders")).total_scheduled == 0


@aio
async def test_delayed_sends_to_a_deleted_topic_fail(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        async with broker.producer() as producer:
            await producer.send("orders", b"first", key="k", delay_ms=60_000)  # cached
            await broker.delete_topic("orders")
            with pytest.raises(redisq.TopicNotFound):
                await producer.send_async("orders", b"late", key="k", delay_ms=100)
            with pytest.raises(redisq.TopicNotFound):  # now known: read again, refused
                await producer.send("orders", b"again", key="k", delay_ms=100)
        assert env.sync.list_topics() == []


@aio
async def test_asyncio_and_thread_schedulers_side_by_side(env: Env) -> None:
    """An asyncio scheduler and a thread scheduler on one topic, the leases stolen all the
    while: each message appended once; closing hands the leases back."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=3)
        async with broker.producer() as producer:
            for i in range(600):
                producer.send_async("orders", b"%d" % i, key=f"k{i % 10}", delay_ms=400 + i)
        described = await broker.describe_topic("orders")
        assert described.total_scheduled == 600
        assert min(p.next_due_ms or 2**63 for p in described.partitions) > 0
        leases = [broker.keys.scheduler_lease("orders", p) for p in range(3)]
        in_threads = Scheduler(env.sync, ["orders"])
        try:
            async with AsyncScheduler(broker, ["orders"]) as in_tasks:
                deadline = time.monotonic() + 30
                while (await broker.describe_topic("orders")).total_scheduled:
                    assert time.monotonic() < deadline, "not delivered in time"
                    for lease in leases:
                        await broker.client.delete(lease)
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
        finally:
            in_threads.close()
        assert in_tasks.delivered + in_threads.delivered == 600
        counts = Counter(m.value for m in await read_all(broker, "orders"))
        assert set(counts) == {b"%d" % i for i in range(600)} and max(counts.values()) == 1
        assert [await broker.client.exists(lease) for lease in leases] == [0, 0, 0]
