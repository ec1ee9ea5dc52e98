"""The asyncio API reads error replies as errors, never as data (the twin of the thread API's
rule: redisq.consume.partition_io's fenced/offset_entries/hashes, redisq.errors.read_reply). Each
path
that reads raw or pipelined replies under redisq/asyncio: the executor of protocol steps
(AsyncScripts.execute, a pipeline or a cluster's step-by-step run), the consumer's exchange on
the partition's node (AsyncPartitionIO: the fenced range read, the commit on a cluster, the
parked-keys load at a grant, the concurrent group read). Real faults where they can be made (a
key of another type: WRONGTYPE; a lease taken over: LEASE_LOST); else an error put in place of
one reply at AsyncPartitionIO._exchange, the rest real."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from redis.exceptions import ResponseError

import redisq
from redisq.consume.partition_io_async import AsyncPartitionIO
from redisq.errors import LeaseLost, RedisqError
from redisq.protocol import group as calls
from redisq.protocol import topics as admin
from tests.aio import FAST, Env, aio, wait_until

pytestmark = pytest.mark.parametrize("backend", ["valkey", "valkey-cluster", "redis"])

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


def _send(env: Env, topic: str, values: list[bytes], partitions: int = 1) -> None:
    env.sync.create_topic(topic, partitions=partitions, exist_ok=True)
    with env.sync.producer() as producer:
        for value in values:
            producer.send(topic, value, partition=0)


async def _poll_until(member: Any, count: int, what: str) -> list[redisq.Message]:
    got: list[redisq.Message] = []

    async def enough() -> bool:
        got.extend(await member.poll(timeout=0.2))
        return len(got) >= count

    await wait_until(enough, what=what)
    return got


async def _values(member: Any, count: int, what: str) -> list[bytes]:
    return [m.value for m in await _poll_until(member, count, what)]


# -- the executor of protocol steps (AsyncScripts.execute) ---------------------------------------


@aio
async def test_pipelined_error_reply_raises(env: Env) -> None:
    """describe_topic pipelines XINFO STREAM, ZCARD and ZRANGE per partition (a pipeline, or a
    cluster pipeline): the schedule's ZCARD answered WRONGTYPE raises, it is no '0 scheduled'."""
    env.sync.create_topic("orders", partitions=2)
    env.sync.client.set(env.sync.keys.scheduled("orders", 1), b"not a sorted set")
    async with env.connect() as broker:
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await broker.describe_topic("orders")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await broker.run(admin.describe_topic(broker.keys, "orders"))


@aio
async def test_script_error_replies_come_back_typed(env: Env) -> None:
    """A list of script calls (one pipeline; one call at a time on a cluster) answered with
    our error codes: each step's result is the typed error in its place (LeaseLost), never a
    decoded value."""
    env.sync.create_topic("orders")
    async with env.connect() as broker:
        keys = broker.keys
        lease = calls.Lease("orders", "g", 0, "7:nobody")  # never granted: LEASE_LOST
        step = calls.commit_position(keys, lease, calls.Commit(position="1-0", seq=1))
        results = await broker.scripts.execute([step, step])
        assert [type(r) for r in results] == [LeaseLost, LeaseLost], results


# -- the consumer's exchange on the partition's node (AsyncPartitionIO) --------------------------


@aio
async def test_commit_answered_lease_lost_raises(env: Env) -> None:
    """The commit (on a cluster: EVALSHA through the exchange on the partition's node; else
    through the scripts) of a lease another grant holds now raises LeaseLost."""
    _send(env, "orders", [b"a", b"b"])
    async with env.connect() as broker:
        member = broker.consumer(
            "orders", "g", **FAST, ack_interval_ms=60_000, enable_auto_commit=False
        )
        try:
            messages = await _poll_until(member, 2, "both messages")
            assert [m.value for m in messages] == [b"a", b"b"]
            assert await member.ack(messages[0]) == 1  # committed later (ack_interval_ms)
            # the script is loaded on the node now (no NOSCRIPT detour); commit() acks b too
            await member.commit()
            assert await member.ack(messages[1]) == 0  # acked already
            member.seek(0, messages[1].offset)  # b again, from the committed position
            (again,) = await _poll_until(member, 1, "b again")
            env.sync.client.set(env.sync.keys.lease("orders", 0, "g"), b"999:someone-else")
            assert await member.ack(again) == 1
            with pytest.raises(LeaseLost):
                await member.commit()
        finally:
            await member.close()


@aio
async def test_range_read_error_inside_exec_raises(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fenced range read (MULTI / GET lease / XRANGE / EXEC) whose XRANGE is answered with
    an error inside the EXEC's array: a RedisqError naming the partition, not 'no entries'."""
    _send(env, "orders", [b"a"])
    original = AsyncPartitionIO._exchange
    injected = {"left": 1}

    async def exchange(self: AsyncPartitionIO, key: str, commands: list[Any], **kw: Any) -> Any:
        replies = await original(self, key, commands, **kw)
        if commands[0] == ("MULTI",) and injected["left"] and isinstance(replies[-1], list):
            injected["left"] -= 1
            replies[-1] = [replies[-1][0], ResponseError(WRONGTYPE)]
        return replies

    monkeypatch.setattr(AsyncPartitionIO, "_exchange", exchange)
    async with env.connect() as broker:
        member = broker.consumer("orders", "g", **FAST)
        try:

            async def failed() -> bool:
                try:
                    assert await member.poll(timeout=0.2) == []
                except RedisqError as exc:
                    assert "reading orders/0 failed" in str(exc) and "WRONGTYPE" in str(exc)
                    return True
                return False

            await wait_until(failed, what="the range read's error raised")
            assert await _values(member, 1, "the message, read again") == [b"a"]
        finally:
            await member.close()


@aio
async def test_parked_keys_read_error_holds_the_grant(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The grant's load of the parked keys and held messages (two HGETALLs in one exchange)
    answered WRONGTYPE: the partition is not handed out as if nothing were parked (a warning,
    the acquire tried again); once the hash reads again, its messages come."""
    _send(env, "orders", [b"a"])
    parked = env.sync.keys.parked_keys("orders", 0, "g")
    env.sync.client.set(parked, b"not a hash")
    async with env.connect() as broker:
        member = broker.consumer("orders", "g", **FAST)
        try:
            with caplog.at_level(logging.WARNING, logger="redisq.consumer"):

                async def logged() -> bool:
                    assert await member.poll(timeout=0.1) == []
                    return any("WRONGTYPE" in r.getMessage() for r in caplog.records)

                await wait_until(logged, what="the failed load logged")
                assert await member.poll(timeout=0.3) == []
                assert ("orders", 0) not in member._readers
            env.sync.client.delete(parked)
            assert await _values(member, 1, "the message after the hash reads") == [b"a"]
        finally:
            await member.close()


@aio
async def test_group_read_error_reply_is_logged_not_empty(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Concurrent mode: XREADGROUP answered with an error is a failed read (logged, read again),
    not a read of nothing; the message still comes."""
    _send(env, "orders", [b"a"])
    original = AsyncPartitionIO._exchange
    injected = {"left": 1}

    async def exchange(self: AsyncPartitionIO, key: str, commands: list[Any], **kw: Any) -> Any:
        if commands[-1][0] == "XREADGROUP" and injected["left"]:
            injected["left"] -= 1
            return [ResponseError(WRONGTYPE)] * len(commands)
        return await original(self, key, commands, **kw)

    monkeypatch.setattr(AsyncPartitionIO, "_exchange", exchange)
    async with env.connect() as broker:
        member = broker.consumer("orders", "g", mode="concurrent", **FAST)
        try:
            with caplog.at_level(logging.WARNING, logger="redisq.consumer"):
                assert await _values(member, 1, "the message") == [b"a"]
            assert injected["left"] == 0
            assert any("WRONGTYPE" in r.getMessage() for r in caplog.records)
        finally:
            await member.close()
