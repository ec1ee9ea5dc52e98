"""What only the asyncio API (redisq.asyncio) has, on every backend: coroutine handlers awaited
on the event loop (plain ones run in worker threads, never on it), run() cancelled as asyncio code
stops things, close() when a cancel is swallowed on its way, close() while start() is joining.
The behaviours both APIs share run once through the `api` fixture (tests/consume/
test_consumer.py, test_seek_and_pause.py, test_guards.py, test_foreign_entries.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from tests.aio import FAST, Env, Recorder, aio, produce, run_until, start_running, wait_until


@aio
async def test_coroutine_handlers_run_on_the_loop_in_key_order(env: Env) -> None:
    """run() awaits a coroutine handler on the loop (a plain one goes to a worker thread): in
    per-key order, one call at a time per partition, nothing handled twice."""
    async with env.connect() as broker:
        await broker.create_topic("orders", partitions=4)
        await produce(broker, "orders", keys=10, per_key=30)
        recorder = Recorder(sleep=0.001)
        async with broker.consumer("orders", "billing", **FAST) as consumer:
            handled = await consumer.run(recorder.handle, idle_timeout=1.5)
    assert handled == 300 == recorder.handled() == consumer.stats.handled
    assert sorted(recorder.done) == list(range(10))
    assert all(ns == list(range(30)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    assert {attempt for *_, attempt in recorder.calls} == {1}  # nothing handled twice
    assert recorder.threads == {threading.main_thread().name}  # the loop's thread
    description = env.sync.describe_group("orders", "billing")
    assert description.total_lag == 0 and description.total_pending == 0
    assert all(p.owner is None for p in description.partitions)  # leases released on close


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
        description = env.sync.describe_group("orders", "g")
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
        description = env.sync.describe_group("orders", "g")
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
        assert env.sync.describe_group("orders", "g").members == []
