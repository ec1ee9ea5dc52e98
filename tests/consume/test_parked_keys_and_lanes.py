"""Parked keys, lanes and blocking on every backend, each scenario written once and run
through both APIs (the `api` fixture; a key parked beforehand is parked through the thread
API): the committed position never passes a message that was not handled (or acked), a parked
key's messages wait for its release however the batch that held them ended, lanes block at the
lowest malformed entry of a read, and poll() delivers what a release frees. The core's part of
it (OrderlyPartition) is also checked with no server.

Each test steps through its scenario on events and on what Redis shows (describe_group), never
on a sleep that hopes; what it asserts is what a user checks: every message handled, each key
in order, nothing of a parked key before its release, nothing lost to a close and a new member.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Callable
from typing import Any

import pytest

import redisq
from redisq.consume.deadletter import release_key
from redisq.consume.dispatch import OrderlyPartition
from redisq.model.offsets import offset_parts
from redisq.model.records import Message
from redisq.protocol.group import Grant, Lease
from tests.aio import FAST
from tests.conftest import wait_until
from tests.consume.test_consumer import run_in_thread
from tests.consume.test_foreign_entries import FOREIGN, xadd

PARK = {"failure_policy": "park_key", "max_attempts": 1, **FAST}
GATE_S = 60.0  # the most a gated handler waits (a test that goes wrong fails, never hangs)


def key_in_lane(lane: int, prefix: str, lanes: int = 2) -> bytes:
    """A key that key_concurrency=`lanes` puts in lane `lane`."""
    i = 0
    while zlib.crc32(f"{prefix}{i}".encode()) % lanes != lane:
        i += 1
    return f"{prefix}{i}".encode()


def send(broker: redisq.Broker, *messages: tuple[bytes, bytes]) -> list[str]:
    """(value, key) in order to partition 0 of "orders"; their offsets."""
    with broker.producer() as producer:
        return [producer.send("orders", value, key=key).offset for value, key in messages]


def partition(broker: redisq.Broker) -> Any:
    return broker.describe_group("orders", "g").partitions[0]


def before(position: str | None, offset: str) -> bool:
    """The committed position is before `offset`: a new member reads it again."""
    return position is None or offset_parts(position) < offset_parts(offset)


def keyed(values: list[bytes], prefix: bytes) -> list[bytes]:
    return [v for v in values if v.startswith(prefix)]


def poison(message: Message) -> None:
    if message.value.startswith(b"K1"):
        raise RuntimeError("poison")


def park_key_k(broker: redisq.Broker) -> None:
    """Key K parked in group g (its message K1 failed under park_key), by a member now gone."""
    broker.create_topic("orders", partitions=1)
    send(broker, (b"K1", b"K"))
    consumer = broker.consumer("orders", "g", **PARK)
    thread = run_in_thread(consumer, poison)
    wait_until(lambda: partition(broker).parked_keys == 1, what="K parked")
    consumer.close()
    thread.join(30)


class Handled:
    """Records the values handled, in order; a value in `gates` waits for its event first."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.started: dict[bytes, threading.Event] = {}
        self.gates: dict[bytes, threading.Event] = {}

    def gate(self, value: bytes) -> threading.Event:
        self.started[value] = threading.Event()
        self.gates[value] = threading.Event()
        return self.gates[value]

    def __call__(self, message: Message) -> None:
        if message.value in self.gates:
            self.started[message.value].set()
            assert self.gates[message.value].wait(GATE_S)
        poison(message)
        self.values.append(message.value)

    async def handle(self, message: Message) -> None:
        """The same as a coroutine function, awaited on the asyncio API's loop (a gate's wait
        does not hold the loop)."""
        if message.value in self.gates:
            self.started[message.value].set()
            assert await asyncio.to_thread(self.gates[message.value].wait, GATE_S)
        poison(message)
        self.values.append(message.value)

    def on(self, api: Any) -> Callable[[Message], Any]:
        """The handler for the API under test: on the asyncio API, the coroutine function."""
        return self.handle if api.name == "async" else self

    def of(self, prefix: bytes) -> list[bytes]:
        return keyed(self.values, prefix)


# -- poll --------------------------------------------------------------------------------------
def test_poll_close_before_ack_then_release(api: Any, broker: redisq.Broker) -> None:
    park_key_k(broker)
    a1, _k2 = send(broker, (b"A1", b"A"), (b"K2", b"K"))
    member = api.broker.consumer("orders", "g", **PARK, enable_auto_commit=False)
    got = member.poll(timeout=10)
    assert [m.value for m in got] == [b"A1"]  # K2 is held behind K
    member.close()  # A1 not acked: the position must stay before it
    assert before(partition(broker).last_delivered, a1)

    values: list[bytes] = []
    member = api.broker.consumer("orders", "g", **PARK)
    try:
        got = member.poll(timeout=10)
        assert [m.value for m in got] == [b"A1"]  # again: it was never acked
        member.ack(got)
        values += [m.value for m in got]
        assert member.poll(timeout=0.5) == []  # K2 still held
        assert release_key(broker, "orders", "g", "K") == 1
        send(broker, (b"K3", b"K"), (b"A2", b"A"))

        def polled_all() -> bool:
            got = member.poll(timeout=0.2)
            member.ack(got)
            values.extend(m.value for m in got)
            return len(values) >= 4

        wait_until(polled_all, what="the released key's messages through poll()")
    finally:
        member.close()
    assert keyed(values, b"A") == [b"A1", b"A2"] and keyed(values, b"K") == [b"K2", b"K3"]
    assert partition(broker).held == 0


# -- run(): a close during a retry -------------------------------------------------------------
SLOW_RETRY = {**PARK, "max_attempts": 5, "retry_backoff_ms": 60_000, "max_retry_backoff_ms": 60_000}


class FailsOnce(Handled):
    def __init__(self) -> None:
        super().__init__()
        self.failed = threading.Event()

    def __call__(self, message: Message) -> None:
        if message.value == b"A1" and not self.failed.is_set():
            self.failed.set()
            raise RuntimeError("transient")
        super().__call__(message)


def test_close_during_a_retry_keeps_the_message(api: Any, broker: redisq.Broker) -> None:
    """The handlers are plain functions (on the asyncio API, run in a worker thread)."""
    park_key_k(broker)
    a1, _k2 = send(broker, (b"A1", b"A"), (b"K2", b"K"))
    handler = FailsOnce()
    member = api.broker.consumer("orders", "g", **SLOW_RETRY)
    thread = run_in_thread(member, handler)
    assert handler.failed.wait(30)  # A1 failed once: now in its retry backoff
    member.close()
    thread.join(30)
    assert not thread.is_alive()
    assert before(partition(broker).last_delivered, a1)

    heir = Handled()
    member = api.broker.consumer("orders", "g", **PARK)
    thread = run_in_thread(member, heir)
    try:
        wait_until(lambda: heir.values == [b"A1"], what="A1 handled by the next member")
        assert partition(broker).held == 1  # K2: not before K is released
        assert release_key(broker, "orders", "g", "K") == 1
        wait_until(lambda: heir.values == [b"A1", b"K2"], what="K2 after the release")
    finally:
        member.close()
        thread.join(30)


# -- lanes: a close while a lane is busy -------------------------------------------------------
def lanes_batch(broker: redisq.Broker, parked: str) -> tuple[bytes, bytes, str]:
    """A batch for two lanes: key A in lane 0, key K in lane 1. K parked "before" the batch is
    read (its K2 held when read), or "in the batch" (K1 fails there, K2 is then held)."""
    key_a, key_k = key_in_lane(0, "A"), key_in_lane(1, "K")
    broker.create_topic("orders", partitions=1)
    if parked == "before":
        send(broker, (b"K1", key_k))
        consumer = broker.consumer("orders", "g", **PARK)
        thread = run_in_thread(consumer, poison)
        wait_until(lambda: partition(broker).parked_keys == 1, what="K parked")
        consumer.close()
        thread.join(30)
        a1 = send(broker, (b"A1", key_a), (b"A2", key_a), (b"K2", key_k))[0]
    else:
        a1 = send(broker, (b"A1", key_a), (b"K1", key_k), (b"A2", key_a), (b"K2", key_k))[0]
    return key_a, key_k, a1


def held_recorded(broker: redisq.Broker, commit: Callable[[], Any]) -> bool:
    commit()  # from another thread (or task) than the one handling: it commits what it may
    part = partition(broker)
    return part.parked_keys == 1 and part.held == 1


@pytest.mark.parametrize("parked", ["before", "in the batch"])
def test_lanes_close_while_a_lane_is_busy(api: Any, broker: redisq.Broker, parked: str) -> None:
    """On the asyncio API the busy member's handler is a coroutine function awaited on the loop
    (the heir's a plain function, run in a worker thread)."""
    _key_a, key_k, a1 = lanes_batch(broker, parked)
    handler = Handled()
    gate = handler.gate(b"A1")
    member = api.broker.consumer("orders", "g", key_concurrency=2, **PARK)
    thread = run_in_thread(member, handler.on(api))
    try:
        assert handler.started[b"A1"].wait(30)
        wait_until(lambda: held_recorded(broker, member.commit), what="K2 held, recorded")
        assert before(partition(broker).last_delivered, a1)  # A1 is still being handled
        assert not member.closed
        closing = threading.Thread(target=member.close)
        closing.start()  # the batch stops: K2 stays held, the position before the batch
        wait_until(lambda: member.closed, what="close() under way")
    finally:
        gate.set()
    closing.join(30)
    thread.join(30)
    assert not closing.is_alive() and not thread.is_alive()

    heir = Handled()
    member = api.broker.consumer("orders", "g", key_concurrency=2, **PARK)
    thread = run_in_thread(member, heir)
    try:
        wait_until(lambda: heir.of(b"A") == [b"A1", b"A2"], what="A1, A2 by the next member")
        member.commit()
        assert heir.of(b"K") == [] and partition(broker).parked_keys == 1
        assert release_key(broker, "orders", "g", key_k) == 1
        wait_until(lambda: heir.of(b"K")[-1:] == [b"K2"], what="K2 after the release")
    finally:
        member.close()
        thread.join(30)
    assert heir.of(b"K") == [b"K2"]  # K1 was dead-lettered: not handled again


# -- lanes: policy block on two malformed entries ----------------------------------------------
def block_batch(broker: redisq.Broker) -> dict[str, str]:
    """A0 M1 A1..A5 X M2 Z: keys A (lane 0) and X (lane 1), two foreign (malformed) entries
    that two lanes meet (keyless entries spread by their place in the read)."""
    key_a, key_x = key_in_lane(0, "A"), key_in_lane(1, "X")
    broker.create_topic("orders", partitions=1)
    offsets = dict(zip(["A0"], send(broker, (b"A0", key_a)), strict=True))
    offsets["M1"] = xadd(broker, "orders", 0, FOREIGN["no value"])  # lane 1
    sent = send(broker, *[(b"A%d" % n, key_a) for n in range(1, 6)], (b"X", key_x))
    offsets["X"] = sent[-1]
    offsets["M2"] = xadd(broker, "orders", 0, FOREIGN["no value"])  # lane 0, after A5
    offsets["Z"] = send(broker, (b"Z", key_a))[0]
    return offsets


BLOCK = {"failure_policy": "block", "key_concurrency": 2, **FAST}
A_ALL = [b"A0", b"A1", b"A2", b"A3", b"A4", b"A5"]


def blocked_at(broker: redisq.Broker, offset: str) -> Callable[[], bool]:
    return lambda: partition(broker).blocked_offset == offset


def test_lanes_block_at_the_lowest_malformed_entry(api: Any, broker: redisq.Broker) -> None:
    """On the asyncio API the handler is a coroutine function awaited on the loop (the heir's
    a plain function, run in a worker thread)."""
    offsets = block_batch(broker)
    log = broker.keys.log("orders", 0)
    handler = Handled()
    gate = handler.gate(b"A5")  # lane 0 reaches M2 only after the partition showed its block
    member = api.broker.consumer("orders", "g", **BLOCK)
    thread = run_in_thread(member, handler.on(api))
    try:
        wait_until(blocked_at(broker, offsets["M1"]), what="blocked at M1")
        gate.set()
        assert handler.values == [b"A0"]  # nothing after M1 before it
        broker.client.xdel(log, offsets["M1"])  # the operator removes what the group shows
        wait_until(blocked_at(broker, offsets["M2"]), what="blocked at M2")
        assert handler.of(b"A") == A_ALL and handler.of(b"X") == [b"X"]
        broker.client.xdel(log, offsets["M2"])
        wait_until(lambda: handler.of(b"Z") == [b"Z"], what="Z after M2 is gone")
    finally:
        gate.set()
        member.close()
        thread.join(30)
    assert partition(broker).last_delivered == offsets["Z"]
    heir = Handled()
    with api.broker.consumer("orders", "g", **BLOCK) as member:
        member.run(heir, idle_timeout=0.5)
    assert heir.values == []  # nothing left behind
    assert handler.of(b"A") == A_ALL and handler.of(b"X") == [b"X"]
    assert handler.of(b"Z") == [b"Z"]


# -- the core, with no server ------------------------------------------------------------------
def reader_at(position: str) -> OrderlyPartition:
    return OrderlyPartition(Grant(Lease("t", "g", 0, "1:x"), position, 10))


def message(offset: str, key: bytes) -> Message:
    return Message("t", 0, offset, key, b"")


@pytest.mark.parametrize("order", [["3-0", "2-0"], ["2-0", "3-0"]])
def test_lanes_meeting_two_malformed_entries_block_at_the_lower(order: list[str]) -> None:
    reader = reader_at("1-0")
    reader.admit([message("2-0", b"a"), message("5-0", b"b")], 0.0)  # a read up to 5-0
    shown = [offset for offset in order if reader.block_on(offset)]
    assert reader.next_range() == ("2-0", True) and reader.blocked == "2-0"
    assert shown == (order if order[0] == "3-0" else ["2-0"])  # the lower one is shown last
    assert not reader.block_on("2-0")  # read again, still blocked: counted and shown once


def test_held_messages_are_passed_once_what_came_before_them_is_done() -> None:
    reader = reader_at("1-0")
    reader.parked = {b"K"}
    keys = [b"K", b"A", b"K", b"K", b"A", b"K"]
    read = [message(f"{n}-0", key) for n, key in enumerate(keys, start=2)]  # 2-0 .. 7-0
    assert [m.offset for m in reader.admit(read, 0.0)] == ["3-0", "6-0"]
    assert reader.done == "2-0"  # held at the head of the read: nothing before it outstanding
    commit = reader.take_commit()
    assert commit is not None and commit.position == "2-0" and len(commit.held) == 4
    reader.committed(commit)
    assert reader.take_commit() is None  # 3-0 not handled: the position stays before it
    reader.handled(read[1], 0.0)
    assert reader.done == "5-0"  # 3-0, then the held 4-0 and 5-0
    reader.handled(read[4], 0.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "7-0" and commit.entries_read == 16
