"""The asyncio consumer (redisq.asyncio) on real servers: the guarantees of tests/test_consumer.py,
tests/test_guards.py and tests/test_malformed.py through `async with broker.consumer(...)`.

Orderly run() (async and thread-run sync handlers) in per-key order with one handler call at a
time per partition; key lanes; start="latest"; poll() gating a partition until acked; async
iteration; the fenced read and the fenced commit (LeaseLost, nothing committed) when the lease
moved; a member SIGKILLed and the heir redelivering from the committed position; a member cut off
from renewals stopping before its lease deadline; dead letters, park_key and block; foreign
entries never reaching a handler; concurrent mode competing and reclaiming idle entries; seek,
seek_to_time, position, committed; pause/resume; on_assign/on_revoke around a rebalance;
several topics; connections killed under an orderly consumer.

Tests taking `env` run on each backend (valkey, valkey-cluster, redis, valkey-cluster3); the
dead-letter, group and parked-key views are read with the sync API on the same namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
from redisq.deadletter import dead_letter_topic, list_dead_letters, release_key, replay_dead_letters
from redisq.errors import (
    ConsumerClosed,
    GroupModeMismatch,
    GroupNotFound,
    InvalidConfig,
    LeaseLost,
)
from redisq.group import describe_group
from redisq.protocol.group import Grant, Lease, parse_lease
from redisq.records import MalformedMessage, Message, offset_parts
from tests.aio import (
    FAST,
    Env,
    Killer,
    Recorder,
    aio,
    async_poll_then_crash,
    produce,
    run_until,
    start_running,
    wait_until,
)
from tests.crash import poll_then_crash
from tests.servers import ServerProcess
from tests.test_consumer import assert_seek_took_effect, seek_back_after
from tests.test_malformed import EXPECTED, FOREIGN, assert_dead_lettered, fill, xadd


def numbers(messages: list[Message]) -> list[int]:
    return [json.loads(m.value)["n"] for m in messages]


async def poll_and_ack(consumer: rq.Consumer, count: int, timeout: float = 30) -> list[Message]:
    """Poll, acking each batch (as an orderly poll loop must), until count messages came."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        messages = await consumer.poll(timeout=0.2, max_messages=count - len(got))
        if messages:
            await consumer.ack(messages)
            got.extend(messages)
    return got


# -- options -------------------------------------------------------------------------------------
@aio
async def test_parameters_are_validated(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t")
        with pytest.raises(InvalidConfig, match="mode="):
            broker.consumer("t", "g", mode="fast")
        with pytest.raises(InvalidConfig, match="park_key"):
            broker.consumer("t", "g", mode="concurrent", failure_policy="park_key")
        with pytest.raises(InvalidConfig, match="lease_ttl_ms=10"):
            broker.consumer("t", "g", lease_ttl_ms=10)
        with pytest.raises(redisq.InvalidName):
            broker.consumer("t", "bad:group")
        with pytest.raises(TypeError):
            broker.consumer("t", "g", no_such_option=1)  # type: ignore[call-arg]
        missing = broker.consumer("missing", "g")
        with pytest.raises(redisq.TopicNotFound):
            await missing.start()
        await missing.close()
        idle = broker.consumer("t", "g")
        with pytest.raises(TypeError):
            await idle.run("not a handler")  # type: ignore[arg-type]
        await idle.close()
        with pytest.raises(GroupNotFound):  # none of them joined
            describe_group(env.sync, "t", "g")


# -- orderly run -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["async", "sync"])
@aio
async def test_run_orderly_handles_everything_in_key_order(env: Env, kind: str) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=4)
        await produce(broker, "orders", keys=10, per_key=30)
        recorder = Recorder(sleep=0.001)
        async with broker.consumer("orders", "billing", **FAST) as consumer:
            handled = await consumer.run(recorder.handler(kind), idle_timeout=1.5)
    assert handled == 300 == recorder.handled() == consumer.stats.handled
    assert sorted(recorder.done) == list(range(10))
    assert all(ns == list(range(30)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    assert {attempt for *_, attempt in recorder.calls} == {1}  # nothing handled twice
    if kind == "sync":  # plain functions run in worker threads, never on the event loop
        assert threading.main_thread().name not in recorder.threads
    else:
        assert recorder.threads == {threading.main_thread().name}
    description = describe_group(env.sync, "orders", "billing")
    assert description.total_lag == 0 and description.total_pending == 0
    assert description.mode == "orderly" and description.members == []
    assert all(p.owner is None for p in description.partitions)  # leases released on close
    info = env.sync.client.xinfo_groups(env.sync.keys.log("orders", 0))
    assert [g["name"] for g in info] == [b"billing"] and info[0]["pending"] == 0


@aio
async def test_key_concurrency_keeps_each_key_in_order(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=8, per_key=10)
        recorder = Recorder(sleep=0.005)
        per_key: dict[bytes | None, int] = defaultdict(int)
        active, peak, key_overlaps = [0], [0], [0]

        async def handler(message: Message) -> None:
            active[0] += 1
            per_key[message.key] += 1
            peak[0] = max(peak[0], active[0])
            if per_key[message.key] > 1:
                key_overlaps[0] += 1
            try:
                await recorder.handle(message)
            finally:
                active[0] -= 1
                per_key[message.key] -= 1

        consumer = broker.consumer("orders", "g", key_concurrency=4, **FAST)
        await run_until(consumer, handler, lambda: recorder.handled() == 80, what="80 handled")
    assert all(ns == list(range(10)) for ns in recorder.done.values()) and len(recorder.done) == 8
    assert key_overlaps[0] == 0  # one call at a time per key
    assert peak[0] > 1  # different keys of one partition ran in parallel
    assert describe_group(env.sync, "orders", "g").total_lag == 0


@aio
async def test_start_latest_skips_what_was_there(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        await produce(broker, "orders", keys=4, per_key=5)
        recorder = Recorder()
        consumer = broker.consumer("orders", "late", start="latest", **FAST)
        await consumer.start()  # the group is created now: it starts after what is there
        async with broker.producer() as producer:
            for p in (0, 1):  # behind the old messages of each partition
                await producer.send("orders", json.dumps({"k": 90 + p, "n": 0}), partition=p)
        await run_until(consumer, recorder.handle, lambda: recorder.handled() >= 2, what="new")
    assert dict(recorder.done) == {90: [0], 91: [0]}


@aio
async def test_cancelling_run_leaves_the_group_cleanly(env: Env) -> None:
    """run() cancelled mid-stream (task.cancel(), as asyncio code stops things): the member
    commits what it handled, hands its leases back and leaves, so the next member starts at
    once after the last handled message and repeats nothing."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        await produce(broker, "orders", keys=8, per_key=50)
        first = Recorder(sleep=0.005)
        consumer = broker.consumer("orders", "g", **FAST)
        task = await start_running(consumer, first.handle)
        await wait_until(lambda: first.handled() >= 40, what="first member going")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert first.handled() < 400, "precondition: cancelled mid-stream"
        description = describe_group(env.sync, "orders", "g")
        assert description.members == [] and all(p.owner is None for p in description.partitions)
        assert description.total_lag == 400 - first.handled()
        heir = Recorder()
        started = time.monotonic()
        consumer = broker.consumer("orders", "g", **FAST)
        await run_until(consumer, heir.handle, lambda: first.handled() + heir.handled() >= 400)
        assert time.monotonic() - started < 5  # no lease left to run out
    for k in range(8):
        assert first.done[k] + heir.done[k] == list(range(50)), k


@aio
async def test_close_ends_the_coordinator_when_its_cancel_is_swallowed(env: Env) -> None:
    """A cancel can be lost on its way through a redis call (redis-py's read timeout firing
    with it turns it into redis.TimeoutError, which the coordinator logs and survives): close()
    still returns, hands the lease back and leaves the group (before, it awaited the cancelled
    coordinator for ever). White-box: the coordinator's tick is made to swallow the cancel."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        consumer = broker.consumer("orders", "g", **FAST)
        await consumer.poll(0.05)
        await wait_until(lambda: consumer.assignment == [0], what="the partition taken")
        tick = consumer._coordinate_once
        inside, swallowed = asyncio.Event(), []

        async def swallowing(now: float) -> None:
            await tick(now)
            if not swallowed:
                inside.set()
                try:
                    await asyncio.sleep(60)  # as a redis call would wait
                except asyncio.CancelledError:
                    swallowed.append(True)
                    raise redis.TimeoutError("Timeout reading from the server") from None

        consumer._coordinate_once = swallowing  # type: ignore[method-assign]
        await asyncio.wait_for(inside.wait(), 10)
        await asyncio.wait_for(consumer.close(), 10)
        assert swallowed == [True], "precondition: the cancel was swallowed"
        description = describe_group(env.sync, "orders", "g")
        assert description.members == [] and all(p.owner is None for p in description.partitions)


@aio
async def test_close_while_starting_leaves_nothing_behind(env: Env) -> None:
    """close() while start() is still joining: start() then starts no coordinator and leaves
    the group it joined after close(), so another member gets every partition at once (not
    after session_timeout_ms)."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        consumer = broker.consumer("orders", "g", "m1", session_timeout_ms=60_000, **FAST)
        starting = asyncio.ensure_future(consumer.start())
        await asyncio.sleep(0)  # start() is on its way (reading the topic's config)
        await consumer.close()
        await starting
        assert consumer._coordinator is None
        assert describe_group(env.sync, "orders", "g").members == []


# -- poll / ack / commit -------------------------------------------------------------------------
@aio
async def test_poll_gates_a_partition_until_acked(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=1, per_key=10)
        async with broker.consumer("orders", "g", **FAST) as consumer:
            first = await consumer.poll(timeout=10, max_messages=4)
            assert numbers(first) == [0, 1, 2, 3]
            assert await consumer.poll(timeout=0.3) == []  # orderly: nothing until acked
            assert await consumer.ack(first[:2]) == 2
            assert await consumer.poll(timeout=0.3) == []  # still two outstanding
            assert await consumer.ack(first[2:]) == 2
            rest = await consumer.poll(timeout=10, max_messages=100)
            assert numbers(rest) == list(range(4, 10))
            await consumer.ack(*rest)
            await consumer.commit()
            assert await consumer.committed(0) == rest[-1].offset
            with pytest.raises(InvalidConfig):
                await consumer.run(lambda m: None)
        with pytest.raises(ConsumerClosed):
            await consumer.poll()
        # A new member resumes after the committed position: nothing is left.
        async with broker.consumer("orders", "g", **FAST) as again:
            await wait_until(lambda: again.assignment == [0], what="the lease")
            assert await again.poll(timeout=0.5) == []


@aio
async def test_async_iteration_with_acks_commits_each_partition(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        await produce(broker, "orders", keys=8, per_key=5)  # keys 0-3 on 0, 4-7 on 1
        got: list[Message] = []
        async with broker.consumer("orders", "g", ack_interval_ms=60_000, **FAST) as consumer:
            async for message in consumer:
                got.append(message)
                await consumer.ack(message)
                if len(got) == 40:
                    break
            await consumer.commit()
            for p in (0, 1):
                mine = [m.offset for m in got if m.partition == p]
                assert mine == sorted(mine, key=offset_parts)
                assert await consumer.committed(p) == mine[-1]
    by_key: dict[bytes | None, list[int]] = defaultdict(list)
    for message in got:
        by_key[message.key].append(json.loads(message.value)["n"])
    assert all(ns == list(range(5)) for ns in by_key.values()) and len(by_key) == 8


# -- the fenced read and the fenced commit ---------------------------------------------------
# Leases so long that A renews nothing and sees no other member during a test (renewal after
# ttl / 3 = 200 s, next heartbeat after 300 s): only the read and commit paths can notice that
# the lease moved.
LONG_LEASE = {"lease_ttl_ms": 600_000, "heartbeat_interval_ms": 300_000}


async def send_values(broker: rq.Broker, topic: str, values: range) -> None:
    async with broker.producer() as producer:
        for i in values:
            producer.send_async(topic, b"%d" % i)


def values(messages: list[Message]) -> list[int]:
    return [int(m.value) for m in messages]


@aio
async def test_member_whose_lease_moved_reads_nothing_of_that_partition(env: Env) -> None:
    """A polled, acked and committed; its lease then expired (deleted here, as a pause past the
    ttl leaves it) and B was granted it. A has not noticed: its next poll returns nothing of the
    partition, its acks are refused, and B gets the new messages."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        await send_values(broker, "t", range(0, 5))
        a = broker.consumer("t", "g", "z-a", **LONG_LEASE)
        b = broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        try:
            first = await poll_and_ack(a, 5)
            assert values(first) == [0, 1, 2, 3, 4]
            await a.commit()
            assert env.sync.client.delete(env.sync.keys.lease("t", 0, "g")) == 1
            await b.start()  # b sorts first among [b, z-a]: the partition is b's
            await wait_until(lambda: b.assignment == [0], what="B holding the lease")
            await send_values(broker, "t", range(5, 10))
            assert a.assignment == [0], "precondition: A has not noticed the new grant"
            assert await a.poll(timeout=0.5) == []
            assert a.assignment == []
            with pytest.raises(LeaseLost):
                await a.ack(first)
            assert values(await poll_and_ack(b, 5)) == [5, 6, 7, 8, 9]
        finally:
            await a.close()
            await b.close()


@aio
async def test_commit_after_the_lease_moved_raises_and_commits_nothing(env: Env) -> None:
    """A polled 0..4 and had not acked them when its lease went to B: the ack is recorded, the
    commit is refused by Redis (LeaseLost, the committed position unchanged), later acks raise
    LeaseLost, and B handles 0..4 again (the first counted as a second delivery), then 5..9."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        await send_values(broker, "t", range(0, 5))
        a = broker.consumer("t", "g", "z-a", ack_interval_ms=60_000, **LONG_LEASE)
        b = broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        try:
            stale = await a.poll(timeout=10)
            assert values(stale) == [0, 1, 2, 3, 4]
            assert env.sync.client.delete(env.sync.keys.lease("t", 0, "g")) == 1
            await b.start()
            await wait_until(lambda: b.assignment == [0], what="B holding the lease")
            await send_values(broker, "t", range(5, 10))

            position = await a.committed(0)
            assert await a.ack(stale) == 5  # commitAsync: Redis decides at the commit
            with pytest.raises(LeaseLost):
                await a.commit()
            assert await a.committed(0) == position  # nothing was committed
            assert await b.committed(0) == position
            with pytest.raises(LeaseLost):
                await a.ack(stale)  # and A knows it now
            assert a.stats.fenced_commits >= 2
            redelivered = await poll_and_ack(b, 10)
            assert values(redelivered) == list(range(10))
            assert [m.attempt for m in redelivered[:5]] == [2, 1, 1, 1, 1]
        finally:
            await a.close()
            await b.close()


@aio
async def test_a_partition_lost_while_polling_is_taken_again_once_free(env: Env) -> None:
    """A's poll found its lease granted to B (the fenced read): A stops reading the partition.
    Once B leaves, the partition is A's again (A is the only member left): A must take the
    lease back and read on, or the group never reads that partition again."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        await send_values(broker, "t", range(0, 5))
        a = broker.consumer("t", "g", "z-a", **LONG_LEASE)
        b = broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        try:
            assert values(await poll_and_ack(a, 5)) == [0, 1, 2, 3, 4]
            await a.commit()
            assert env.sync.client.delete(env.sync.keys.lease("t", 0, "g")) == 1
            await b.start()
            await wait_until(lambda: b.assignment == [0], what="B holding the lease")
            await send_values(broker, "t", range(5, 10))
            assert await a.poll(timeout=0.5) == [] and a.assignment == []  # fenced
            assert values(await poll_and_ack(b, 5)) == [5, 6, 7, 8, 9]
            await b.close()  # commits, releases the lease, leaves the group
            await send_values(broker, "t", range(10, 15))
            assert values(await poll_and_ack(a, 5, timeout=6)) == [10, 11, 12, 13, 14]
            assert a.assignment == [0]
        finally:
            await a.close()
            await b.close()


# -- crashes and takeover ------------------------------------------------------------------------
@aio
async def test_crashed_member_is_taken_over_from_the_committed_position(env: Env) -> None:
    """An asyncio member polls three of six messages and is SIGKILLed (no commit, release or
    leave); the heir handles all six from the committed position, in order, the first counted
    as a second delivery, once the victim's lease ran out."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=1, per_key=6)
        got = await asyncio.to_thread(
            async_poll_then_crash, env.url, env.namespace, "orders", "g", "victim", 3, **FAST
        )
        assert len(got) == 3
        assert describe_group(env.sync, "orders", "g").partitions[0].owner == "victim"
        recorder = Recorder()
        started = time.monotonic()
        heir = broker.consumer("orders", "g", "heir", **FAST)
        await run_until(heir, recorder.handle, lambda: recorder.handled() >= 6, what="all six")
    assert recorder.done[0] == [0, 1, 2, 3, 4, 5]
    assert [a for _k, n, a in recorder.calls if n < 3] == [2, 1, 1]
    assert time.monotonic() - started < 30


# -- the lease deadline --------------------------------------------------------------------------
DEADLINE_TTL_MS = 1500
COORDINATION = {"heartbeat", "acquire_lease", "extend_lease", "release_lease"}


class CutOff:
    """Cuts one asyncio broker (one member's) off from its group's coordination once it holds a
    lease: heartbeats, lease grants, renewals and releases raise ConnectionError, while its
    reads, commits and handlers go on. Records the leases it was granted."""

    def __init__(self, broker: rq.Broker) -> None:
        self.cut = False
        self.grants: list[Lease] = []
        real_run = broker.scripts.run

        async def run(call: Any) -> Any:
            if self.cut and call.script in COORDINATION:
                raise redis.ConnectionError("cut off by the test")
            result = await real_run(call)
            if call.script == "acquire_lease" and isinstance(result, Grant):
                self.grants.append(result.lease)
                self.cut = True
            return result

        broker.scripts.run = run  # type: ignore[method-assign]


class Timed:
    """Records the wall-clock start of every call and the offsets handled successfully (the
    servers run on this host: time.time() and the server's TIME read the same clock)."""

    def __init__(self, sleep: float, fail: bool = False) -> None:
        self.sleep = sleep
        self.fail = fail
        self.starts: list[float] = []
        self.done: set[str] = set()

    def __call__(self, message: Message) -> None:
        self.starts.append(time.time())
        if self.fail:
            raise RuntimeError("downstream unavailable")
        time.sleep(self.sleep)
        self.done.add(message.offset)

    async def handle(self, message: Message) -> None:
        self.starts.append(time.time())
        if self.fail:
            raise RuntimeError("downstream unavailable")
        await asyncio.sleep(self.sleep)
        self.done.add(message.offset)


@pytest.mark.parametrize("backend", ["valkey"])
@pytest.mark.parametrize(
    "variant",
    [
        # One lane, a sync handler: a 500-message batch takes 2.5 s, so the deadline falls
        # inside it.
        pytest.param({"lanes": 1, "sleep": 0.005, "kind": "sync"}, id="one-lane"),
        # Key lanes, an async handler: each lane checks before every message.
        pytest.param({"lanes": 4, "sleep": 0.02, "kind": "async"}, id="key-lanes"),
        # Policy block on a handler that always fails: retries would go on for ever.
        pytest.param({"lanes": 1, "sleep": 0.0, "kind": "async", "fail": True}, id="retrying"),
    ],
)
@aio
async def test_member_that_cannot_renew_stops_before_its_lease_deadline(
    env: Env, variant: dict[str, Any]
) -> None:
    """A holds the only partition; then none of its renewals (nor heartbeats) arrive, while its
    reads and commits still work and messages keep coming. No handler call of A may start after
    its lease expires in Redis (grant time + ttl, server clock); B then takes the partition and
    every message is handled."""
    fail = bool(variant.get("fail"))
    options: dict[str, Any] = {
        "lease_ttl_ms": DEADLINE_TTL_MS,
        "batch_size": 500,
        "ack_interval_ms": 1000,
        "key_concurrency": variant["lanes"],
        "retry_backoff_ms": 50,
        "max_retry_backoff_ms": 50,
        "failure_policy": "block" if fail else "dead_letter",
    }
    a_handler, b_handler = Timed(variant["sleep"], fail=fail), Timed(0.0005)
    flowing = asyncio.Event()
    flowing.set()
    async with env.connect() as a_broker, env.connect() as b_broker:
        cut = CutOff(a_broker)
        await b_broker.create_topic("t", partitions=1)
        async with b_broker.producer() as producer:
            for i in range(600):
                producer.send_async("t", b"%d" % i, key=f"key{i % 16}")

        async def produce_continuously() -> None:
            async with b_broker.producer(linger_ms=0) as producer:
                i = 600
                while flowing.is_set():
                    await producer.send("t", b"%d" % i, key=f"key{i % 16}")
                    i += 1
                    await asyncio.sleep(0.005)

        a = a_broker.consumer("t", "g", "a", **options)
        b = b_broker.consumer("t", "g", "b", **options)
        a_handle = a_handler.handle if variant["kind"] == "async" else a_handler
        a_task = await start_running(a, a_handle)
        producing = asyncio.ensure_future(produce_continuously())
        b_task: asyncio.Future[int] | None = None
        try:
            await wait_until(lambda: cut.cut, what="A granted the lease")
            (lease,) = cut.grants
            parsed = parse_lease(lease.value)
            assert parsed is not None
            expiry = (parsed[2] + DEADLINE_TTL_MS) / 1000  # the lease's PX runs from its grant
            b_task = await start_running(b, b_handler.handle)
            await wait_until(
                lambda: len([t for t in b_handler.starts if t > expiry]) >= 50,
                what="B handling the partition after A's lease ran out",
            )
        finally:
            flowing.clear()
            await producing
        offsets = {m.offset async for m in b_broker.read("t", 0)}
        await wait_until(
            lambda: offsets <= a_handler.done | b_handler.done, what="every message handled"
        )
        await a.close()
        await b.close()
        await a_task
        if b_task is not None:
            await b_task
    assert a_handler.starts, "A handled nothing before its deadline"
    late = [round(t - expiry, 3) for t in a_handler.starts if t >= expiry]
    assert late == [], f"{len(late)} handler calls of A started after its lease ran out (s)"
    assert cut.grants == [lease], "A was granted the partition again"
    assert b.stats.leases_acquired >= 1, "B never took the partition over"


# -- failures ----------------------------------------------------------------------------------
@aio
async def test_poison_message_reaches_the_dead_letter_topic(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=2)
        await produce(broker, "orders", keys=6, per_key=5)  # keys 0-3 on 0, 4-5 on 1
        recorder = Recorder(fail=lambda r: r["k"] == 0 and r["n"] == 2)
        consumer = broker.consumer("orders", "g", max_attempts=3, **FAST)
        await run_until(
            consumer,
            recorder.handle,
            lambda: recorder.handled() == 29 and consumer.stats.dead_letters == 1,
            what="all but one handled, one dead letter",
        )
        assert [a for k, n, a in recorder.calls if (k, n) == (0, 2)] == [1, 2, 3]
        assert recorder.done[0] == [0, 1, 3, 4]
        assert all(recorder.done[k] == list(range(5)) for k in range(1, 6))
        letters = list_dead_letters(env.sync, "orders", "g")
        assert len(letters) == 1
        letter = letters[0]
        assert letter.attempts == 3 and "cannot handle key0#2" in letter.error
        assert letter.topic == "orders" and letter.group == "g" and letter.message.key == b"key0"
        assert json.loads(letter.message.value) == {"k": 0, "n": 2}
        description = describe_group(env.sync, "orders", "g")
        assert description.dead_letter_messages == 1
        assert sum(p.dead_letters for p in description.partitions) == 1
        assert description.total_lag == 0
        dlq = dead_letter_topic("orders", "g")
        assert dlq in await broker.list_topics()
        assert len([m async for m in broker.read(dlq, 0)]) == 1
        # Replayed (sync API, same namespace): handled again by the group, here by a sync
        # handler run in a thread.
        assert replay_dead_letters(env.sync, "orders", "g") == 1
        assert list_dead_letters(env.sync, "orders", "g") == []
        again = Recorder()
        consumer = broker.consumer("orders", "g", **FAST)
        await run_until(consumer, again, lambda: again.handled() >= 1, what="the replayed one")
    assert dict(again.done) == {0: [2]}


@aio
async def test_park_key_holds_that_key_and_lets_others_go(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=3, per_key=6)
        recorder = Recorder(fail=lambda r: r["k"] == 1 and r["n"] == 1)
        consumer = broker.consumer("orders", "g", max_attempts=2, failure_policy="park_key", **FAST)
        task = await start_running(consumer, recorder.handle)
        try:
            await wait_until(
                lambda: recorder.done[0] == list(range(6)) and recorder.done[2] == list(range(6)),
                what="the other keys done",
            )
            assert recorder.done[1] == [0]  # key1 parked at #1: #2..#5 held

            def parked_and_held() -> bool:
                part = describe_group(env.sync, "orders", "g").partitions[0]
                return part.parked_keys == 1 and part.held == 4

            await wait_until(parked_and_held, what="parked key and held messages committed")
            recorder.fail = None
            assert release_key(env.sync, "orders", "g", "key1") == 1
            await wait_until(
                lambda: recorder.done[1] == [0, 2, 3, 4, 5], what="held messages after release"
            )
        finally:
            await consumer.close()
            await task
    assert len(list_dead_letters(env.sync, "orders", "g")) == 1
    assert recorder.overlaps == 0


@aio
async def test_block_policy_shows_the_poison_message_and_goes_on_when_fixed(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=1, per_key=3)
        recorder = Recorder(fail=lambda r: r["n"] == 1)
        consumer = broker.consumer("orders", "g", max_attempts=2, failure_policy="block", **FAST)
        task = await start_running(consumer, recorder)  # a sync handler, in a thread
        try:
            await wait_until(
                lambda: (
                    describe_group(env.sync, "orders", "g").partitions[0].blocked_offset is not None
                ),
                what="blocked state",
            )
            part = describe_group(env.sync, "orders", "g").partitions[0]
            assert part.blocked_attempts >= 2 and "cannot handle" in (part.blocked_error or "")
            assert recorder.done[0] == [0]
            recorder.fail = None  # the cause is fixed: the partition goes on by itself
            await wait_until(lambda: recorder.done[0] == [0, 1, 2], what="unblocked")
        finally:
            await consumer.close()
            await task
    assert describe_group(env.sync, "orders", "g").partitions[0].blocked_offset is None
    assert list_dead_letters(env.sync, "orders", "g") == []


# -- foreign (malformed) entries -----------------------------------------------------------------
@pytest.mark.parametrize("lanes", [1, 3])
@aio
async def test_orderly_run_dead_letters_each_foreign_entry(env: Env, lanes: int) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        offsets = fill(env.sync, "orders")
        seen: list[Message] = []

        async def handler(message: Message) -> None:
            seen.append(message)

        consumer = broker.consumer("orders", "g", key_concurrency=lanes, **FAST)
        await run_until(
            consumer,
            handler,
            lambda: len(seen) == len(EXPECTED) and consumer.stats.dead_letters == len(FOREIGN),
            what="good messages handled, foreign ones dead-lettered",
        )
    assert not any(isinstance(m, MalformedMessage) for m in seen)
    got = [json.loads(m.value)["n"] if m.value != b"extra" else "extra" for m in seen]
    assert (got if lanes == 1 else sorted(got, key=str)) == (
        EXPECTED if lanes == 1 else sorted(EXPECTED, key=str)
    )
    assert consumer.stats.malformed == len(FOREIGN) == consumer.stats.dead_letters
    assert_dead_lettered(env.sync, "orders", "g", offsets)
    description = describe_group(env.sync, "orders", "g")
    assert description.total_lag == 0 and description.total_pending == 0
    assert description.partitions[0].dead_letters == len(FOREIGN)
    assert description.total_malformed == len(FOREIGN)


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
@aio
async def test_poll_returns_the_good_messages_in_order(env: Env, mode: str) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        offsets = fill(env.sync, "orders")
        got: list[Message] = []
        async with broker.consumer("orders", "g", mode=mode, **FAST) as consumer:
            deadline = time.monotonic() + 60
            while len(got) < len(EXPECTED) and time.monotonic() < deadline:
                messages = await consumer.poll(timeout=0.5, max_messages=4)
                got += messages
                await consumer.ack(messages)
            assert consumer.stats.malformed == len(FOREIGN)
    assert not any(isinstance(m, MalformedMessage) for m in got)
    assert [m.offset for m in got] == sorted((m.offset for m in got), key=offset_parts)
    assert [json.loads(m.value)["n"] if m.value != b"extra" else "extra" for m in got] == EXPECTED
    assert_dead_lettered(env.sync, "orders", "g", offsets)
    assert describe_group(env.sync, "orders", "g").total_pending == 0


@aio
async def test_block_in_poll_returns_what_came_before_and_waits(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        async with broker.producer() as producer:
            await producer.send("orders", json.dumps({"n": 0}), key="a")
            bad = xadd(env.sync, "orders", 0, FOREIGN["non-numeric sequence"])
            await producer.send("orders", json.dumps({"n": 1}), key="b")
        async with broker.consumer("orders", "g", failure_policy="block", **FAST) as consumer:
            first = await consumer.poll(timeout=10)
            assert numbers(first) == [0]
            await consumer.ack(first)
            assert await consumer.poll(timeout=1.0) == []  # blocked
            part = describe_group(env.sync, "orders", "g").partitions[0]
            assert part.blocked_offset == bad
            assert (part.blocked_error or "").startswith("MalformedEntry")
            env.sync.client.xdel(env.sync.keys.log("orders", 0), bad)  # the operator removes it
            rest = await consumer.poll(timeout=10)
            assert numbers(rest) == [1]
            await consumer.ack(rest)
    assert describe_group(env.sync, "orders", "g").partitions[0].blocked_offset is None
    assert list_dead_letters(env.sync, "orders", "g") == []


@pytest.mark.parametrize("backend", ["valkey"])
@aio
async def test_foreign_entries_are_logged_bounded_and_counted(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """200 foreign entries: a line or two with a count (as the thread consumer logs them),
    never silence and never a line or a traceback each."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        pipe = env.sync.client.pipeline(transaction=False)
        for n in range(200):
            pipe.execute_command("XADD", env.sync.keys.log("orders", 0), "*", "v", str(n), "p", "x")
        pipe.execute()
        async with broker.producer() as producer:
            await producer.send("orders", json.dumps({"n": 0}))
        seen: list[Message] = []

        async def handler(message: Message) -> None:
            seen.append(message)

        caplog.set_level(logging.INFO, logger="redisq")
        consumer = broker.consumer("orders", "g", **FAST)
        await run_until(
            consumer,
            handler,
            lambda: len(seen) == 1 and consumer.stats.dead_letters == 200,
            what="the good message handled, 200 dead letters",
        )
    assert numbers(seen) == [0] and consumer.stats.malformed == 200
    assert describe_group(env.sync, "orders", "g").total_malformed == 200
    assert not any(r.exc_info for r in caplog.records)
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(lines) <= 4, lines
    counts = [re.search(r"(\d+) (?:more )?malformed entr", line) for line in lines]
    assert sum(int(m.group(1)) for m in counts if m) == 200, lines


# -- concurrent mode ---------------------------------------------------------------------------
@aio
async def test_concurrent_members_compete_and_reclaim_idle_entries(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("jobs", partitions=2)
        await produce(broker, "jobs", keys=8, per_key=12)  # keys 0-3 on 0, 4-7 on 1
        taken = await asyncio.to_thread(
            poll_then_crash, env.url, env.namespace, "jobs", "w", "victim", 10,
            mode="concurrent", **FAST,
        )  # fmt: skip
        assert len(taken) == 10  # left pending by the killed (sync) member
        recorder = Recorder()
        a = broker.consumer("jobs", "w", "a", mode="concurrent", claim_idle_ms=500, **FAST)
        b = broker.consumer("jobs", "w", "b", mode="concurrent", claim_idle_ms=500, **FAST)
        tasks = [
            await start_running(a, recorder.handle),
            await start_running(b, recorder),  # a sync handler, in a thread
        ]
        try:
            await wait_until(
                lambda: recorder.complete(keys=8, per_key=12),
                what="all jobs, including the reclaimed ones",
            )
        finally:
            await a.close()
            await b.close()
            await asyncio.gather(*tasks)
        assert describe_group(env.sync, "jobs", "w").total_pending == 0
        with pytest.raises(GroupModeMismatch):
            await broker.consumer("jobs", "w", mode="orderly").start()
    assert all(sorted(set(ns)) == list(range(12)) for ns in recorder.done.values())


# -- seek, position, committed, pause ------------------------------------------------------------
@aio
async def test_seek_seek_to_time_position_and_committed(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer() as producer:
            for n in range(10):
                await producer.send("t", json.dumps({"n": n}), key=f"k{n % 3}")
        consumer = broker.consumer("t", "g", ack_interval_ms=60_000, **FAST)
        try:
            read = await poll_and_ack(consumer, 10)
            assert numbers(read) == list(range(10))
            assert consumer.position(0) == read[-1].offset
            committed = await consumer.committed(0)
            assert committed is None or offset_parts(committed) < offset_parts(read[0].offset)
            await consumer.commit()
            assert await consumer.committed(0) == read[-1].offset

            consumer.seek(0, read[3].offset)
            assert consumer.position(0) == read[3].offset
            again = await poll_and_ack(consumer, 7)
            assert numbers(again) == list(range(3, 10))

            ts = read[6].timestamp_ms
            consumer.seek_to_time(0, ts)
            expected = [m.offset for m in read if m.timestamp_ms >= ts]
            assert [m.offset for m in await poll_and_ack(consumer, len(expected))] == expected

            consumer.seek(0, read[2].offset)  # back: the committed position follows
            back = await poll_and_ack(consumer, 1)
            assert numbers(back) == [2]
            await consumer.commit()
            assert await consumer.committed(0) == read[2].offset

            with pytest.raises(InvalidConfig):
                consumer.seek(0, "not-an-offset")
            with pytest.raises(InvalidConfig):
                consumer.seek(5, read[0].offset)
            with pytest.raises(InvalidConfig):
                consumer.seek_to_time(0, -1)
            with pytest.raises(InvalidConfig):
                consumer.position(5)
        finally:
            await consumer.close()
        # The next member starts after the committed position.
        async with broker.consumer("t", "g", **FAST) as heir:
            assert numbers(await poll_and_ack(heir, 7)) == list(range(3, 10))


@aio
async def test_seek_from_the_handler_takes_effect_before_the_rest_of_the_read(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer() as producer:
            for n in range(500):
                producer.send_async("t", json.dumps({"n": n}), key=f"k{n % 5}")
        seen: list[int] = []
        consumer_ref: list[object] = [None]
        record = seek_back_after(10, consumer_ref, seen, [])

        async def handler(message: Message) -> None:
            record(message)

        consumer = broker.consumer("t", "g", batch_size=1000, **FAST)
        consumer_ref[0] = consumer
        try:
            await consumer.run(handler, idle_timeout=1.5)
        finally:
            await consumer.close()
    assert_seek_took_effect(seen, 10, 500)


@aio
async def test_pause_and_resume(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        async with broker.producer() as producer:
            for p in (0, 1):
                for n in range(5):
                    producer.send_async("t", json.dumps({"k": p, "n": n}), partition=p)
        # poll(): a paused partition gives nothing, its lease is kept.
        async with broker.consumer("t", "polling", **FAST) as consumer:
            await wait_until(lambda: consumer.assignment == [0, 1], what="both leases")
            consumer.pause(1)
            first = await poll_and_ack(consumer, 5)
            assert {m.partition for m in first} == {0} and numbers(first) == list(range(5))
            assert await consumer.poll(timeout=0.5) == []
            assert consumer.assignment == [0, 1]
            consumer.resume(1)
            rest = await poll_and_ack(consumer, 5)
            assert {m.partition for m in rest} == {1} and numbers(rest) == list(range(5))
            with pytest.raises(InvalidConfig):
                consumer.pause(7)
        # run(): partition 0 paused as soon as it is assigned (on_assign), then resumed.
        recorder = Recorder()
        running: list[rq.Consumer] = []

        def pause_zero(tps: list[tuple[str, int]]) -> None:
            if ("t", 0) in tps:
                running[0].pause(0)

        consumer = broker.consumer("t", "running", on_assign=pause_zero, **FAST)
        running.append(consumer)
        task = await start_running(consumer, recorder.handle)
        try:
            await wait_until(lambda: len(recorder.done[1]) == 5, what="partition 1 handled")
            assert recorder.done[0] == []
            consumer.resume(0)
            await wait_until(lambda: len(recorder.done[0]) == 5, what="partition 0 after resume")
        finally:
            await consumer.close()
            await task
    assert recorder.done == {0: list(range(5)), 1: list(range(5))}


# -- rebalancing and callbacks -------------------------------------------------------------------
@aio
async def test_rebalance_hands_partitions_over_with_callbacks(env: Env) -> None:
    """first runs alone; second joins and takes half; first leaves and second takes the rest.
    Every partition is handled by one member at a time, and only between its on_assign and its
    on_revoke; on_revoke comes after the member's last commit of the partition; each key in order
    (a clean hand-over repeats nothing). Callbacks may be coroutine functions or plain ones."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=4)
        await produce(broker, "orders", keys=16, per_key=60)
        recorder = Recorder(sleep=0.01)
        events: list[tuple[Any, ...]] = []
        consumers: dict[str, rq.Consumer] = {}

        def handler_of(member: str) -> Callable[[Message], Any]:
            async def handle(message: Message) -> None:
                events.append(
                    ("handle", member, (message.topic, message.partition), message.offset)
                )
                await recorder.handle(message)

            return handle

        async def assigned_async(member: str, tps: list[tuple[str, int]]) -> None:
            await asyncio.sleep(0)
            events.extend(("assign", member, tp) for tp in tps)

        async def revoked_async(member: str, tps: list[tuple[str, int]]) -> None:
            for tp in tps:
                events.append(("revoke", member, tp, await consumers[member].committed(tp)))

        def revoked_sync(member: str, tps: list[tuple[str, int]]) -> None:
            for tp in tps:
                info = env.sync.client.xinfo_groups(env.sync.keys.log(*tp))
                last = [g["last-delivered-id"] for g in info if g["name"] == b"g"][0]
                events.append(("revoke", member, tp, last.decode()))

        first = broker.consumer(
            "orders", "g", "first",
            on_assign=lambda tps: assigned_async("first", tps),
            on_revoke=lambda tps: revoked_sync("first", tps),
            **FAST,
        )  # fmt: skip
        second = broker.consumer(
            "orders", "g", "second",
            on_assign=lambda tps: events.extend(("assign", "second", tp) for tp in tps),
            on_revoke=lambda tps: revoked_async("second", tps),
            **FAST,
        )  # fmt: skip
        consumers.update(first=first, second=second)
        t1 = await start_running(first, handler_of("first"))
        t2: asyncio.Future[int] | None = None
        try:
            await wait_until(lambda: recorder.handled() >= 40, what="first member going")
            t2 = await start_running(second, handler_of("second"))
            await wait_until(
                lambda: len(second.assignment) == 2 and len(first.assignment) == 2,
                what="second member gets half",
            )
            assert not set(first.assignment) & set(second.assignment)
            assert recorder.handled() < 16 * 60 - 160, "precondition: first leaves mid-stream"
            await first.close()  # a clean leave: second takes the rest without waiting for a ttl
            await t1
            await wait_until(lambda: len(second.assignment) == 4, what="second takes over")
            await wait_until(lambda: recorder.complete(16, 60), what="everything handled")
        finally:
            await first.close()
            await second.close()
            await t1
            if t2 is not None:
                await t2
    assert recorder.overlaps == 0
    for ns in recorder.done.values():  # each key in order, nothing repeated
        assert ns == list(range(60))
    holder: dict[tuple[str, int], str | None] = {}
    last_handled: dict[tuple[str, tuple[str, int]], str] = {}
    handed_over = 0
    for event in events:
        kind, member, tp = event[0], event[1], event[2]
        if kind == "assign":
            assert holder.get(tp) is None, f"{tp} assigned to {member} while {holder[tp]} held it"
            holder[tp] = member
        elif kind == "handle":
            assert holder.get(tp) == member, f"{member} handled {tp} without holding it"
            last_handled[(member, tp)] = event[3]
        else:
            assert holder.get(tp) == member, f"{member} revoked {tp} it did not hold"
            holder[tp] = None
            if (member, tp) in last_handled:  # committed through what it handled, then revoked
                assert event[3] == last_handled[(member, tp)], (member, tp)
            handed_over += member == "first"
    assert handed_over == 4  # two at the rebalance, two at the leave
    assert all(member is None for member in holder.values())  # every partition revoked at close


# -- several topics ------------------------------------------------------------------------------
@aio
async def test_one_consumer_of_several_topics(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("a", partitions=2)
        await broker.create_topic("b", partitions=3)
        await broker.create_topic("other", partitions=1)
        async with broker.producer() as producer:
            for n in range(5):
                for k in range(4):
                    producer.send_async("a", json.dumps({"k": k, "n": n}), key=f"a{k}")
                for k in range(10, 16):
                    producer.send_async("b", json.dumps({"k": k, "n": n}), key=f"b{k}")
            foreign = await producer.send("other", json.dumps({"k": 99, "n": 0}))
        recorder = Recorder()
        consumer = broker.consumer(["a", "b"], "g", **FAST)
        task = await start_running(consumer, recorder.handle)
        try:
            await wait_until(lambda: len(consumer.assignment) == 5, what="five leases")
            assert sorted(consumer.assignment) == [  # type: ignore[type-var]
                ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2),
            ]  # fmt: skip
            with pytest.raises(InvalidConfig, match="several topics"):
                consumer.position(0)
            [other] = [m async for m in broker.read("other", foreign.partition)]
            with pytest.raises(ValueError):
                await consumer.ack(other)
            await wait_until(lambda: recorder.handled() == 50, what="both topics handled")
        finally:
            await consumer.close()
            await task
    assert sorted(recorder.done) == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert all(ns == list(range(5)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    assert describe_group(env.sync, "a", "g").total_lag == 0
    assert describe_group(env.sync, "b", "g").total_lag == 0


# -- connections killed under an orderly consumer ------------------------------------------------
@pytest.mark.fault
def test_orderly_run_while_connections_are_killed() -> None:
    """CLIENT KILL every 20 ms while an orderly member runs over 3000 messages: everything is
    handled, one handler call at a time per partition, and no key ever skips ahead (a key's
    next message is never handled before the one before it; repeats only restart earlier)."""
    server = ServerProcess().start()
    killer = Killer(server, interval=0.02)
    recorder = Recorder(sleep=0.002)

    async def scenario() -> None:
        async with await rq.connect(server.url, namespace=f"k{uuid.uuid4().hex[:8]}") as broker:
            await broker.create_topic("orders", partitions=4)
            await produce(broker, "orders", keys=50, per_key=60)
            killer.start()
            consumer = broker.consumer("orders", "g", lease_ttl_ms=3000, batch_size=50)
            try:
                await run_until(
                    consumer,
                    recorder.handle,
                    lambda: recorder.complete(keys=50, per_key=60),
                    timeout=120,
                    what="every message handled",
                )
            finally:
                killer.stop()

    try:
        asyncio.run(scenario())
    finally:
        killer.stop()
        server.stop()
    assert killer.killed > 0
    assert recorder.overlaps == 0
    for key, ns in recorder.done.items():
        assert ns[0] == 0, key
        skipped = [(a, b) for a, b in zip(ns, ns[1:], strict=False) if b > a + 1]
        assert not skipped, f"key {key} skipped ahead: {skipped[:3]}"


@aio
async def test_idempotent_helper_skips_done_and_reruns_failed(env: Env) -> None:
    """The thread test's twin (tests/test_consumer.py): README, Consuming:
    `consumer.run(consumer.idempotent(handle))`; a coroutine function or a plain one."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=1)
        await produce(broker, "orders", keys=1, per_key=3)
        effects: list[int] = []
        fail_once = {1}

        async def effect(message: Message) -> None:
            n = json.loads(message.value)["n"]
            if n in fail_once:
                fail_once.discard(n)
                raise RuntimeError("transient")
            effects.append(n)

        async with broker.consumer("orders", "g", **FAST) as consumer:
            handler = consumer.idempotent(effect, processing_ttl_ms=500)
            messages = await consumer.poll(timeout=10)
            assert len(messages) == 3
            for message in messages:
                try:
                    await handler(message)
                except RuntimeError:
                    await handler(message)  # the failed run left no marker: it runs again
            for message in messages:  # a redelivery of everything: all done, all skipped
                await handler(message)
            assert effects == [0, 1, 2] and handler.skipped == 3 and handler.ran == 3
            plain = consumer.idempotent(lambda message: effects.append(-1))  # a plain function
            for message in messages:
                await plain(message)
            assert plain.skipped == 3 and effects == [0, 1, 2]
            await consumer.ack(messages)
        async with broker.consumer("orders", "g2", **FAST) as consumer:  # another group: run
            ran: list[int] = []
            wrapped = consumer.idempotent(
                lambda message: ran.append(json.loads(message.value)["n"])
            )
            assert await consumer.run(wrapped, idle_timeout=1.0) == 3
            assert ran == [0, 1, 2] and wrapped.ran == 3
