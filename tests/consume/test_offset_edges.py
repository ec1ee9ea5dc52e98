"""Offsets at the edges of what Redis takes, on every backend; the tests with a consumer or a
read run through both APIs (the `api` fixture), but for a refused seek from a handler and
reset_offsets, on the thread API:

* seek() refuses a stream ID Redis would refuse (a part above 2**64 - 1, a non-ASCII digit) with
  InvalidConfig, and nothing moves: the reads go on from where they were;
* an error reply inside a fenced read (the EXEC's array, or a pipeline's) is a RedisqError naming
  the partition, never a TypeError from decoding an error as entries;
* an entry another client XADDs at the largest stream ID is handled once, then reads after it
  find nothing (no error) in poll() and run(), and reset_offsets works around it;
* committed() of a partition the topic lacks, or of a topic the group does not read, raises
  what seek() and reset_offsets raise for it, not a raw "no such key".
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
import redis

import redisq
from redisq.consume.partition_io import PartitionIO
from redisq.errors import InvalidConfig, PartitionOutOfRange, RedisqError
from redisq.model.keys import KeySpace
from redisq.model.offsets import MAX_STREAM_ID, offset_after, offset_at
from redisq.model.records import Message, decode_entries
from redisq.protocol import group as calls
from redisq.protocol.group import Lease
from tests.apis import coroutine_on_asyncio
from tests.conftest import wait_until

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}
TOP = "18446744073709551615"  # 2**64 - 1, the largest part of a stream ID
REFUSED_BY_REDIS = [
    "99999999999999999999-0",  # 20 digits, above 2**64 - 1
    "18446744073709551616",  # 2**64
    f"1-{int(TOP) + 1}",
    "\u0661-0",  # ARABIC-INDIC DIGIT ONE: \d takes it, Redis does not
    "1\uff10-0",  # FULLWIDTH DIGIT ZERO
    "-1",
    "1-2-3",
    " 1-0",
    "1-0\n",
    "",
    None,
    5,
]


def values(messages: list[Message]) -> list[str]:
    return [m.value.decode() for m in messages]


def send_values(broker: redisq.Broker, topic: str, items: list[str]) -> list[str]:
    with broker.producer() as producer:
        return [str(producer.send(topic, item, partition=0).offset) for item in items]


def xadd_at_max_id(broker: redisq.Broker, topic: str) -> None:
    """A foreign entry (a valid message: a value, nothing else) at the largest stream ID: after
    it nothing can be appended, and no exclusive range may start at it."""
    stream = broker.keys.log(topic, 0)
    assert broker.client.xadd(stream, {"v": "foreign"}, id=MAX_STREAM_ID).decode() == MAX_STREAM_ID


def poll_all(consumer: Any, seconds: float) -> tuple[list[Message], list[str]]:
    """Poll and ack for `seconds`, keeping every message and every error raised."""
    got: list[Message] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            messages = consumer.poll(timeout=0.2)
            consumer.ack(messages)
            got += messages
        except Exception as exc:  # counted: there must be none
            errors.append(f"{type(exc).__name__}: {exc}")
    return got, errors


def worker_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "worker failed" in r.getMessage()]


# -- without a server ----------------------------------------------------------------------------
def test_the_id_after_carries_and_ends_at_the_largest() -> None:
    assert offset_after("5-7") == "5-8"
    assert offset_after("5") == "5-1"
    assert offset_after("0-0") == "0-1"
    assert offset_after(f"5-{TOP}") == "6-0"  # the sequence carries, as XADD's IDs do
    assert offset_after(f"{TOP}-{int(TOP) - 1}") == MAX_STREAM_ID
    assert offset_after(MAX_STREAM_ID) is None  # nothing comes after it
    assert offset_after("5-7", 0) == "5-7"
    assert offset_after(f"5-{int(TOP) - 1}", 3) == "6-1"
    assert offset_at("1700000000000-5", 3) == "1700000000000-8"
    assert offset_at(f"5-{int(TOP) - 1}", 3) == "6-1"
    with pytest.raises(ValueError):
        offset_after("\u0661-0")


@pytest.mark.parametrize("offset", REFUSED_BY_REDIS)
def test_seek_offsets_are_parsed_as_redis_parses_them(offset: Any) -> None:
    with pytest.raises(InvalidConfig, match="expected a stream ID"):
        PartitionIO.check_offset(offset)


def test_seek_offsets_redis_takes_are_kept() -> None:
    assert PartitionIO.check_offset("1700000000000-5") == "1700000000000-5"
    assert PartitionIO.check_offset("1700000000000") == "1700000000000-0"
    assert PartitionIO.check_offset(MAX_STREAM_ID) == MAX_STREAM_ID
    assert PartitionIO.check_offset("007-01") == "7-1"


LEASE = Lease("orders", "g", 3, "7:member:0")


def test_an_error_inside_the_exec_reply_is_a_typed_error_naming_the_partition() -> None:
    wrongtype = redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    exec_reply = [LEASE.value.encode(), wrongtype]
    with pytest.raises(RedisqError, match="orders/3.*WRONGTYPE") as raised:
        PartitionIO.fenced(LEASE, [b"OK", b"QUEUED", b"QUEUED", exec_reply], calls.range_read_reply)
    assert not isinstance(raised.value, TypeError)
    assert raised.value.__cause__ is wrongtype
    # A top-level error (a waiting read's XREAD) too.
    with pytest.raises(RedisqError, match="orders/3"):
        PartitionIO.waited(LEASE, [wrongtype, LEASE.value.encode()])
    # The lease read first, then its error in place of the entries: not LeaseLost either.
    with pytest.raises(RedisqError, match="orders/3") as raised:
        PartitionIO.fenced(
            LEASE, [b"OK", b"QUEUED", b"QUEUED", [None, wrongtype]], calls.range_read_reply
        )
    assert not isinstance(raised.value, redisq.LeaseLost)


def test_a_read_after_the_largest_id_is_the_lease_alone() -> None:
    keys = KeySpace("ns")
    commands = calls.fenced_range_commands(keys, LEASE, MAX_STREAM_ID, 10)
    assert [c[0] for c in commands] == ["MULTI", "GET", "EXEC"]
    assert calls.range_read_reply([b"OK", b"QUEUED", [LEASE.value.encode()]]).entries == []
    # At the largest ID (a seek to it), the read takes that entry.
    commands = calls.fenced_range_commands(keys, LEASE, MAX_STREAM_ID, 10, inclusive=True)
    assert commands[2][2] == MAX_STREAM_ID
    # Before it, the read starts at the ID after the position.
    commands = calls.fenced_range_commands(keys, LEASE, f"5-{TOP}", 10)
    assert commands[2][2] == "6-0"


# -- 1. seek to an offset Redis refuses ----------------------------------------------------------
def test_seek_refuses_what_redis_refuses_and_nothing_moves(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    offsets = send_values(broker, "t", ["m0", "m1", "m2", "m3"])
    with api.broker.consumer("t", "g", **FAST) as consumer:
        first = consumer.poll(timeout=10, max_messages=2)
        assert values(first) == ["m0", "m1"]
        consumer.ack(first)
        consumer.commit()
        assert consumer.committed(0) == offsets[1]
        for offset in REFUSED_BY_REDIS:
            with pytest.raises(InvalidConfig, match="expected a stream ID"):
                consumer.seek(0, offset)
            assert consumer.position(0) == offsets[1]
        with pytest.raises(InvalidConfig):
            consumer.seek_to_time(0, 2**70)
        consumer.commit()
        assert consumer.committed(0) == offsets[1]  # nothing moved by a refused seek
        rest = consumer.poll(timeout=10)
        assert values(rest) == ["m2", "m3"]
        consumer.ack(rest)
        started = time.monotonic()
        assert consumer.poll(timeout=0.3) == []  # no error, and the timeout is kept
        assert time.monotonic() - started >= 0.25
        consumer.seek(0, MAX_STREAM_ID)  # the largest ID is one Redis takes: nothing there
        assert consumer.poll(timeout=0.3) == []


def test_a_refused_seek_from_a_handler_leaves_run_going(
    broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    broker.create_topic("t", partitions=1)
    send_values(broker, "t", [json.dumps({"n": n}) for n in range(5)])
    seen: list[int] = []
    refused: list[str] = []
    with broker.consumer("t", "g", **FAST) as consumer:

        def handler(message: Message) -> None:
            seen.append(json.loads(message.value)["n"])
            if len(seen) == 1:
                try:
                    consumer.seek(0, "99999999999999999999-0")
                except InvalidConfig as exc:
                    refused.append(str(exc))

        with caplog.at_level(logging.ERROR, logger="redisq"):
            consumer.run(handler, idle_timeout=1.5)
    assert len(refused) == 1
    assert seen == [0, 1, 2, 3, 4]  # each once, in order: the read went on
    assert worker_failures(caplog) == []


# -- 2. an error reply inside a fenced read ------------------------------------------------------
def replace_stream_with_a_string(broker: redisq.Broker, topic: str) -> str:
    """Another client puts a string where the partition's stream was (kept aside, same slot)."""
    stream = broker.keys.log(topic, 0)
    aside = stream + ":aside"
    broker.client.rename(stream, aside)
    broker.client.set(stream, "not a stream")
    return aside


def restore_stream(broker: redisq.Broker, topic: str, aside: str) -> None:
    stream = broker.keys.log(topic, 0)
    broker.client.delete(stream)
    broker.client.rename(aside, stream)


def test_an_error_in_the_read_is_a_typed_error_and_nothing_moves(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("t", partitions=1)
    offsets = send_values(broker, "t", ["m0", "m1", "m2"])
    with api.broker.consumer("t", "g", **FAST) as consumer:
        first = consumer.poll(timeout=10, max_messages=1)
        consumer.ack(first)
        consumer.commit()
        aside = replace_stream_with_a_string(broker, "t")
        try:
            with pytest.raises(RedisqError, match="t/0.*WRONGTYPE") as raised:
                consumer.poll(timeout=0.5)
            assert not isinstance(raised.value, TypeError)
        finally:
            restore_stream(broker, "t", aside)
        assert consumer.committed(0) == offsets[0]
        assert consumer.position(0) == offsets[0]
        rest = consumer.poll(timeout=10)
        assert values(rest) == ["m1", "m2"]


# -- 3. an entry at the largest stream ID --------------------------------------------------------
def test_an_entry_at_the_largest_id_is_polled_once_then_nothing(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("t", partitions=1)
    send_values(broker, "t", ["before"])
    xadd_at_max_id(broker, "t")
    with api.broker.consumer("t", "g", **FAST) as consumer:
        got, errors = poll_all(consumer, 1.5)
        assert errors == []
        assert values(got) == ["before", "foreign"]
        assert got[-1].offset == MAX_STREAM_ID
        consumer.commit()
        assert consumer.committed(0) == MAX_STREAM_ID
        started = time.monotonic()
        assert consumer.poll(timeout=0.3) == []
        assert time.monotonic() - started >= 0.25  # the timeout is kept: no error loop
    # The next member resumes from the committed largest ID: nothing, no error.
    with api.broker.consumer("t", "g", **FAST) as consumer:
        got, errors = poll_all(consumer, 1.0)
        assert (got, errors) == ([], [])


def test_an_entry_at_the_largest_id_is_run_once(
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """On the asyncio API the handler is a coroutine function awaited on the loop."""
    broker.create_topic("t", partitions=1)
    send_values(broker, "t", ["before"])
    xadd_at_max_id(broker, "t")
    handled: list[str] = []
    handler = coroutine_on_asyncio(api, lambda m: handled.append(m.value.decode()))
    with caplog.at_level(logging.ERROR, logger="redisq"):
        with api.broker.consumer("t", "g", **FAST) as consumer:
            consumer.run(handler, timeout=2.0)
        # The second member resumes at the largest ID.
        with api.broker.consumer("t", "g", **FAST) as consumer:
            consumer.run(handler, timeout=1.0)
    assert handled == ["before", "foreign"]
    assert worker_failures(caplog) == []
    group = broker.client.xinfo_groups(broker.keys.log("t", 0))[0]
    assert group["last-delivered-id"].decode() == MAX_STREAM_ID


def test_reset_offsets_around_an_entry_at_the_largest_id(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    (before,) = send_values(broker, "t", ["before"])
    xadd_at_max_id(broker, "t")
    with broker.consumer("t", "g", **FAST) as consumer:
        consumer.run(lambda m: None, timeout=1.5)
    for dry_run in (True, False):
        (latest,) = broker.reset_offsets("t", "g", to_latest=True, dry_run=dry_run)
        assert (latest.after, latest.lag_after) == (MAX_STREAM_ID, 0)
    (shifted,) = broker.reset_offsets("t", "g", shift_by=1)  # nothing after the largest ID
    assert (shifted.before, shifted.after, shifted.lag_after) == (MAX_STREAM_ID, MAX_STREAM_ID, 0)
    (earliest,) = broker.reset_offsets("t", "g", to_earliest=True, dry_run=True)
    assert (earliest.after, earliest.lag_before, earliest.lag_after) == ("0-0", 0, 2)
    (back,) = broker.reset_offsets("t", "g", shift_by=-1)
    assert (back.after, back.lag_after) == (before, 1)
    (at_max,) = broker.reset_offsets("t", "g", to_offset=MAX_STREAM_ID)
    assert (at_max.after, at_max.lag_after) == (before, 1)
    (forward,) = broker.reset_offsets("t", "g", shift_by=5)
    assert (forward.after, forward.lag_after) == (MAX_STREAM_ID, 0)
    (earliest,) = broker.reset_offsets("t", "g", to_earliest=True)
    assert earliest.lag_after == 2
    with broker.consumer("t", "g", **FAST) as consumer:
        got, errors = poll_all(consumer, 1.0)
    assert errors == []
    assert values(got) == ["before", "foreign"]


# -- 4. committed() of a partition or topic the consumer does not read ---------------------------
def test_committed_refuses_what_seek_refuses(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    broker.create_topic("other", partitions=1)
    offsets = send_values(broker, "t", ["m0"])
    with api.broker.consumer("t", "g", **FAST) as consumer:
        consumer.ack(consumer.poll(timeout=10))
        consumer.commit()
        wait_until(lambda: consumer.assignment == [0, 1], what="the leases")
        assert consumer.committed(0) == offsets[0]
        assert consumer.committed(("t", 1)) in (None, "0-0")
        for partition in (2, -1, "x"):
            with pytest.raises(PartitionOutOfRange):
                consumer.committed(partition)  # type: ignore[arg-type]
            with pytest.raises(InvalidConfig):  # what seek raises for it
                consumer.seek(partition, "0-0")  # type: ignore[arg-type]
        with pytest.raises(PartitionOutOfRange):  # as reset_offsets: a bool is no partition
            consumer.committed(True)
        for tp in (("nope", 0), ("other", 0)):
            with pytest.raises(InvalidConfig, match="not read by group"):
                consumer.committed(tp)
        assert consumer.committed(0) == offsets[0]


def test_decoding_an_entry_at_the_largest_id() -> None:
    (message,) = decode_entries("t", 0, [(MAX_STREAM_ID.encode(), [b"v", b"x"])])
    assert type(message) is Message and message.offset == MAX_STREAM_ID


def test_read_pages_past_an_entry_at_the_largest_id(api: Any, broker: redisq.Broker) -> None:
    """Broker.read pages by "the ID after the last one": at the largest ID there is none, and
    the read ends there instead of sending a range Redis refuses."""
    broker.create_topic("t", partitions=1)
    send_values(broker, "t", ["before"])
    xadd_at_max_id(broker, "t")
    assert values(list(api.broker.read("t", 0, batch=1))) == ["before", "foreign"]
    assert values(list(api.broker.read("t", 0, start=MAX_STREAM_ID, batch=1))) == ["foreign"]
