"""What counts as an attempt at a message, for the failure policy (max_attempts), when the
partition changes hands, thread and asyncio consumers, on every backend.

A member that is granted a partition and hands it back before it read anything (a close before
its first poll, a rebalance right after the grant) made no attempt at the message waiting there:
the next owner hands that message out as attempt 1, and the policy gives up only after
max_attempts real handler calls. (An owner that dies while handling the message does count:
tests/test_consumer_processes.py kills one.) Before, every grant at the same position counted,
so members coming and going ran a message's attempts up without calling a handler once.
"""

from __future__ import annotations

import pytest

import redisq
from redisq.keys import dead_letter_topic
from redisq.records import Message
from tests.aio import Env, aio
from tests.aio import wait_until as async_wait_until
from tests.test_consumer import wait_until

LEFT = 3  # members that are granted the partition and leave before reading it


@pytest.fixture
def env(broker: redisq.Broker, server_url: str) -> Env:
    return Env(server_url, broker)


OPTIONS = {"max_attempts": 2, "retry_backoff_ms": 10, "max_retry_backoff_ms": 10}


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

    first = broker.consumer("t", "g", max_attempts=3)
    polled = first.poll(10, 1)  # given out: an attempt, though never acked
    assert [m.attempt for m in polled] == [1]
    first.close()
    with broker.consumer("t", "g", max_attempts=3, retry_backoff_ms=10) as member:
        member.run(handler, idle_timeout=1.0)
    assert attempts == [2, 3]
    assert dead_letters(broker) == [b"poison"]
