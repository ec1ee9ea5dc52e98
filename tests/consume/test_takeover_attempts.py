"""What counts as an attempt at a message, for the failure policy (max_attempts), when the
partition changes hands, on every backend; each test runs through both APIs (the `api` fixture)
but one, on the thread API (a member that gave the message out counts).

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
from tests.apis import Bridge, coroutine_on_asyncio
from tests.conftest import wait_until

LEFT = 3  # members that are granted the partition and leave before reading it


# poll()'s messages are acked by hand here (a close without an ack gives them back)
OPTIONS: dict[str, Any] = {
    "max_attempts": 2,
    "retry_backoff_ms": 10,
    "max_retry_backoff_ms": 10,
    "enable_auto_commit": False,
}


def unbridged(consumer: Any) -> Any:
    """The consumer itself: the thread API's, or the asyncio one behind its Bridge (white-box
    tests replace its partition reader's I/O)."""
    return object.__getattribute__(consumer, "_obj") if isinstance(consumer, Bridge) else consumer


def dead_letters(broker: redisq.Broker) -> list[bytes]:
    try:
        return [m.value for m in broker.read(dead_letter_topic("t", "g"), 0)]
    except redisq.TopicNotFound:
        return []


def test_members_that_leave_before_reading_make_no_attempt(api: Any, broker: redisq.Broker) -> None:
    """On the asyncio API the failing handler is a coroutine function awaited on the loop."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"poison", key="k")
    for _ in range(LEFT):
        member = api.broker.consumer("t", "g", **OPTIONS)
        wait_until(lambda m=member: m.assignment == [0], what="the partition granted")
        member.close()
    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    with api.broker.consumer("t", "g", **OPTIONS) as member:
        member.run(coroutine_on_asyncio(api, handler), idle_timeout=1.0)
    # Before: [4] (three grants counted as attempts), then dead-lettered after one call.
    assert attempts == [1, 2]
    assert dead_letters(broker) == [b"poison"]


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
def test_close_while_polls_read_is_in_flight_gives_nothing_out(
    api: Any, broker: redisq.Broker
) -> None:
    """Owner 2's poll() has read the message on the server (under its lease) and the reply is
    still on its way when close() hands the partition back. The read is dropped: poll() gives
    nothing out after the hand-back, so taking the grant's count back is right, and the next
    owner sees attempt 2 (owner 1 was given it). Before, poll() gave the message out after the
    lease was released while its attempt was taken back. The reply's delay is made by holding
    the read's return until close() has returned (white-box: the partition reader's I/O, a
    coroutine on the asyncio API)."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        producer.send("t", b"poison", key="k")
    options = {
        "max_attempts": 3,
        "retry_backoff_ms": 10,
        "max_retry_backoff_ms": 10,
        "enable_auto_commit": False,
    }
    first = api.broker.consumer("t", "g", **options)
    assert [m.attempt for m in first.poll(10, 1)] == [1]  # given out, never acked: counts
    first.close()

    second = api.broker.consumer("t", "g", **options)
    wait_until(lambda: second.assignment == [0], what="owner 2 granted")
    read_done, closed = threading.Event(), threading.Event()
    io = unbridged(second).io
    real_read = io.read_range

    def read_then_wait(reader: Any, count: int) -> Any:
        entries = real_read(reader, count)  # ran on the server, under owner 2's lease
        read_done.set()
        assert closed.wait(30)
        return entries

    async def read_then_wait_asyncio(reader: Any, count: int) -> Any:
        entries = await real_read(reader, count)
        read_done.set()
        assert await asyncio.to_thread(closed.wait, 30)  # the loop goes on: close() runs there
        return entries

    io.read_range = read_then_wait_asyncio if api.name == "async" else read_then_wait
    polled: list[Message] = []
    poller = threading.Thread(target=lambda: polled.extend(second.poll(5, 1)))
    poller.start()
    assert read_done.wait(30)
    second.close()
    closed.set()
    poller.join(30)
    assert not poller.is_alive()
    assert polled == []  # before: [poison] (attempt 2), given out after the lease was released

    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("fails every time")

    with api.broker.consumer("t", "g", **options) as third:
        third.run(coroutine_on_asyncio(api, handler), idle_timeout=1.0)
    assert attempts == [2, 3]
    assert dead_letters(broker) == [b"poison"]


def test_a_poll_that_races_close_returns_nothing_of_a_handed_back_partition(
    api: Any, broker: redisq.Broker
) -> None:
    """poll() has screened one partition's messages and reads the next when close() hands both
    back: the first partition's messages are not returned either (before, poll() returned them
    after close() had released their lease, and the next owner handled them too). White-box:
    close() runs inside the second read (from another thread on the thread API; awaited in the
    read, on the poll's own task, on the asyncio API)."""
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for partition in (0, 1):
            producer.send("t", b"m%d" % partition, partition=partition)
    member = api.broker.consumer("t", "g", enable_auto_commit=False)
    wait_until(lambda: member.assignment == [0, 1], what="both partitions granted")
    inner = unbridged(member)
    real_read = inner.io.read_range
    reads = []

    def close_at_the_second_read(reader: Any, count: int) -> Any:
        reads.append(reader.tp)
        if len(reads) == 2:
            closing = threading.Thread(target=member.close)
            closing.start()
            closing.join(30)
        return real_read(reader, count)

    async def close_at_the_second_read_asyncio(reader: Any, count: int) -> Any:
        reads.append(reader.tp)
        if len(reads) == 2:
            await inner.close()
        return await real_read(reader, count)

    inner.io.read_range = (
        close_at_the_second_read_asyncio if api.name == "async" else close_at_the_second_read
    )
    assert member.poll(5, 10) == []  # before: the first partition's message
    assert len(reads) == 2 and member.closed
    with api.broker.consumer("t", "g", enable_auto_commit=False) as heir:
        got: list[Message] = []
        wait_until(lambda: bool(got.extend(heir.poll(0.2, 10))) or len(got) == 2, what="both")
    assert sorted(m.value for m in got) == [b"m0", b"m1"]
