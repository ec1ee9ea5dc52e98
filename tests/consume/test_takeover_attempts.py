"""What counts as an attempt at a message, for the failure policy (max_attempts), when the
partition changes hands, thread and asyncio consumers, on every backend.

A member that is granted a partition and hands it back before it read anything (a close before
its first poll, a rebalance right after the grant) made no attempt at the message waiting there:
the next owner hands that message out as attempt 1, and the policy gives up only after
max_attempts real handler calls. (An owner that dies while handling the message does count:
tests/consume/test_members_in_processes.py kills one.) Before, every grant at the same position
counted, so members coming and going ran a message's attempts up without calling a handler once.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import redisq
from redisq.model.keys import dead_letter_topic
from redisq.model.records import Message
from tests.aio import Env, aio
from tests.aio import wait_until as async_wait_until
from tests.conftest import wait_until

LEFT = 3  # members that are granted the partition and leave before reading it


# poll()'s messages are acked by hand here (a close without an ack gives them back)
OPTIONS = {
    "max_attempts": 2,
    "retry_backoff_ms": 10,
    "max_retry_backoff_ms": 10,
    "enable_auto_commit": False,
}


def dead_letters(broker: redisq.Broker) -> list[bytes]:
    try:
        return [m.value for m in broker.read(dead_letter_topic("t", "g"), 0)]
    except redisq.TopicNotFound:
        return []


def test_members_that_leave_before_reading_make_no_attempt(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"poison", key="k")
    for _ in range(LEFT):
        member = broker.consumer("t", "g", **OPTIONS)  # type: ignore[arg-type]
        wait_until(lambda m=member: m.assignment == [0], what="the partition granted")
        member.close()
    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    with broker.consumer("t", "g", **OPTIONS) as member:  # type: ignore[arg-type]
        member.run(handler, idle_timeout=1.0)
    # Before: [4] (three grants counted as attempts), then dead-lettered after one call.
    assert attempts == [1, 2]
    assert dead_letters(broker) == [b"poison"]


@aio
async def test_asyncio_members_that_leave_before_reading_make_no_attempt(env: Env) -> None:
    env.sync.create_topic("t", partitions=1)
    with env.sync.producer() as producer:
        producer.send("t", b"poison", key="k")
    attempts: list[int] = []

    async def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    async with env.connect() as broker:
        for _ in range(LEFT):
            member = broker.consumer("t", "g", **OPTIONS)  # type: ignore[arg-type]
            await member.start()
            await async_wait_until(
                lambda m=member: m.assignment == [0], what="the partition granted"
            )
            await member.close()
        member = broker.consumer("t", "g", **OPTIONS)  # type: ignore[arg-type]
        await member.start()
        try:
            await member.run(handler, idle_timeout=1.0)
        finally:
            await member.close()
    assert attempts == [1, 2]
    assert dead_letters(env.sync) == [b"poison"]


def test_a_member_that_gave_the_message_out_counts(broker: redisq.Broker) -> None:
    """The count is taken back only for an owner that gave nothing out: one that handed the
    message to poll()'s caller and left without acking it made that attempt."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"poison", key="k")
    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    first = broker.consumer("t", "g", max_attempts=3, enable_auto_commit=False)
    polled = first.poll(10, 1)  # given out: an attempt, though never acked
    assert [m.attempt for m in polled] == [1]
    first.close()
    with broker.consumer("t", "g", max_attempts=3, retry_backoff_ms=10) as member:
        member.run(handler, idle_timeout=1.0)
    assert attempts == [2, 3]
    assert dead_letters(broker) == [b"poison"]


# -- a hand-over while poll()'s read is in flight ----------------------------------------------
def test_close_while_polls_read_is_in_flight_gives_nothing_out(broker: redisq.Broker) -> None:
    """Owner 2's poll() has read the message on the server (under its lease) and the reply is
    still on its way when close() hands the partition back. The read is dropped: poll() gives
    nothing out after the hand-back, so taking the grant's count back is right, and the next
    owner sees attempt 2 (owner 1 was given it). Before, poll() gave the message out after the
    lease was released while its attempt was taken back. The reply's delay is made by holding
    the read's return until close() has returned (white-box: the partition reader's I/O)."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"poison", key="k")
    options = {
        "max_attempts": 3,
        "retry_backoff_ms": 10,
        "max_retry_backoff_ms": 10,
        "enable_auto_commit": False,
    }
    first = broker.consumer("t", "g", **options)  # type: ignore[arg-type]
    assert [m.attempt for m in first.poll(10, 1)] == [1]  # given out, never acked: counts
    first.close()

    second = broker.consumer("t", "g", **options)  # type: ignore[arg-type]
    wait_until(lambda: second.assignment == [0], what="owner 2 granted")
    read_done, closed = threading.Event(), threading.Event()
    real_read = second.io.read_range

    def read_then_wait(reader: Any, count: int) -> Any:
        entries = real_read(reader, count)  # ran on the server, under owner 2's lease
        read_done.set()
        assert closed.wait(30)
        return entries

    second.io.read_range = read_then_wait  # type: ignore[method-assign]
    polled: list[Message] = []
    poller = threading.Thread(target=lambda: polled.extend(second.poll(5, 1)))
    poller.start()
    assert read_done.wait(30)
    second.close()
    closed.set()
    poller.join(30)
    assert polled == []  # before: [poison] (attempt 2), given out after the lease was released

    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    with broker.consumer("t", "g", **options) as third:  # type: ignore[arg-type]
        third.run(handler, idle_timeout=1.0)
    assert attempts == [2, 3]
    assert dead_letters(broker) == [b"poison"]


@aio
async def test_asyncio_close_while_polls_read_is_in_flight_gives_nothing_out(env: Env) -> None:
    env.sync.create_topic("t", partitions=1)
    with env.sync.producer() as producer:
        producer.send("t", b"poison", key="k")
    options = {
        "max_attempts": 3,
        "retry_backoff_ms": 10,
        "max_retry_backoff_ms": 10,
        "enable_auto_commit": False,
    }
    attempts: list[int] = []

    async def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    async with env.connect() as broker:
        first = broker.consumer("t", "g", **options)  # type: ignore[arg-type]
        assert [m.attempt for m in await first.poll(10, 1)] == [1]
        await first.close()

        second = broker.consumer("t", "g", **options)  # type: ignore[arg-type]
        await second.start()
        await async_wait_until(lambda: second.assignment == [0], what="owner 2 granted")
        read_done, closed = asyncio.Event(), asyncio.Event()
        real_read = second.io.read_range

        async def read_then_wait(reader: Any, count: int) -> Any:
            entries = await real_read(reader, count)
            read_done.set()
            await asyncio.wait_for(closed.wait(), 30)
            return entries

        second.io.read_range = read_then_wait  # type: ignore[method-assign]
        poll = asyncio.ensure_future(second.poll(5, 1))
        await asyncio.wait_for(read_done.wait(), 30)
        await second.close()
        closed.set()
        assert await asyncio.wait_for(poll, 30) == []

        third = broker.consumer("t", "g", **options)  # type: ignore[arg-type]
        await third.start()
        try:
            await third.run(handler, idle_timeout=1.0)
        finally:
            await third.close()
    assert attempts == [2, 3]
    assert dead_letters(env.sync) == [b"poison"]


def test_a_poll_that_races_close_returns_nothing_of_a_handed_back_partition(
    broker: redisq.Broker,
) -> None:
    """poll() has screened one partition's messages and reads the next when close() (from
    another thread) hands both back: the first partition's messages are not returned either
    (before, poll() returned them after close() had released their lease, and the next owner
    handled them too). White-box: close() runs inside the second read."""
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for partition in (0, 1):
            producer.send("t", b"m%d" % partition, partition=partition)
    member = broker.consumer("t", "g", enable_auto_commit=False)
    wait_until(lambda: member.assignment == [0, 1], what="both partitions granted")
    real_read = member.io.read_range
    reads = []

    def close_at_the_second_read(reader: Any, count: int) -> Any:
        reads.append(reader.tp)
        if len(reads) == 2:
            closing = threading.Thread(target=member.close)
            closing.start()
            closing.join(30)
        return real_read(reader, count)

    member.io.read_range = close_at_the_second_read  # type: ignore[method-assign]
    assert member.poll(5, 10) == []  # before: the first partition's message
    assert len(reads) == 2 and member.closed
    with broker.consumer("t", "g", enable_auto_commit=False) as heir:
        got: list[Message] = []
        wait_until(lambda: bool(got.extend(heir.poll(0.2, 10))) or len(got) == 2, what="both")
    assert sorted(m.value for m in got) == [b"m0", b"m1"]


@aio
async def test_asyncio_a_poll_that_races_close_returns_nothing_of_a_handed_back_partition(
    env: Env,
) -> None:
    env.sync.create_topic("t", partitions=2)
    with env.sync.producer() as producer:
        for partition in (0, 1):
            producer.send("t", b"m%d" % partition, partition=partition)
    async with env.connect() as broker:
        member = broker.consumer("t", "g", enable_auto_commit=False)
        await member.start()
        await async_wait_until(lambda: member.assignment == [0, 1], what="both granted")
        real_read = member.io.read_range
        reads = []

        async def close_at_the_second_read(reader: Any, count: int) -> Any:
            reads.append(reader.tp)
            if len(reads) == 2:
                await member.close()
            return await real_read(reader, count)

        member.io.read_range = close_at_the_second_read  # type: ignore[method-assign]
        assert await member.poll(5, 10) == []
        assert len(reads) == 2 and member.closed
        heir = broker.consumer("t", "g", enable_auto_commit=False)
        got: list[Message] = []
        try:
            for _ in range(100):  # 20 s at most
                got.extend(await heir.poll(0.2, 10))
                if len(got) == 2:
                    break
        finally:
            await heir.close()
    assert sorted(m.value for m in got) == [b"m0", b"m1"]
