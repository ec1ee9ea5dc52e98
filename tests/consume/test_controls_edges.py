"""Adversarial tests of the consumer controls (seek/pause/commit) beyond the happy path, on
standalone Valkey and Redis: a message blocked by failure_policy="block" is sought past or
deleted from another thread while run() retries it (both APIs); thread API only: close(timeout)
returning while a handler still runs hands nothing over, a seek while a key lane is blocked, and
a bool or float is no partition to seek or pause (nor a NaN a poll timeout)."""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

import pytest

import redisq
from redisq.model.records import Message
from tests.apis import coroutine_on_asyncio
from tests.conftest import wait_until
from tests.consume.test_consumer import run_in_thread


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def send(broker: redisq.Broker, *values: bytes, key: str = "k") -> list[str]:
    with broker.producer() as producer:
        return [producer.send("t", v, key=key).offset for v in values]  # type: ignore[misc]


FAST = {"retry_backoff_ms": 10, "max_retry_backoff_ms": 20}


# -- a message blocked by failure_policy="block", sought past or deleted in run() ---------------
def poison_then(api: Any, broker: redisq.Broker, act: Any, after: str) -> None:
    """poison, m1, m2 on t/0, handled by run() under failure_policy="block" (the poison never
    works); once the poison was retried 5 times, act(consumer, offsets) from this thread (on the
    asyncio API the consumer's calls run on the loop, and the handler is a coroutine function):
    m1 and m2 are then handled, in order, once."""
    broker.create_topic("t", partitions=1)
    offsets = send(broker, b"poison", b"m1", b"m2")
    seen: list[bytes] = []
    calls = [0]

    def handler(message: Message) -> None:
        calls[0] += 1
        if message.value == b"poison":
            raise RuntimeError("never works")
        seen.append(message.value)

    consumer = api.broker.consumer("t", "g", failure_policy="block", max_attempts=1, **FAST)
    thread = run_in_thread(consumer, coroutine_on_asyncio(api, handler))
    try:
        wait_until(lambda: calls[0] >= 5, what="the poison retried")
        act(consumer, offsets)
        wait_until(lambda: len(seen) >= 2, timeout=30, what=f"m1 and m2 handled {after}")
        assert seen == [b"m1", b"m2"], f"{after}: {seen}, {calls[0]} calls"
    finally:
        consumer.close(timeout=5)
        thread.join(10)
    assert not thread.is_alive()
    assert seen == [b"m1", b"m2"], f"{after}: {seen}, {calls[0]} calls"


def seek_past(consumer: Any, offsets: list[str]) -> None:
    consumer.seek(0, offsets[1])


def deleter(broker: redisq.Broker) -> Any:
    def delete(consumer: Any, offsets: list[str]) -> None:
        assert broker.client.xdel(broker.keys.log("t", 0), offsets[0]) == 1

    return delete


def test_seek_past_a_blocked_message_in_run(api: Any, broker: redisq.Broker) -> None:
    """README: block "retries forever ... until it is handled, deleted, or sought past", and a
    seek from another thread takes effect after at most the messages being handled."""
    poison_then(api, broker, seek_past, "after the seek past it")


def test_deleting_a_blocked_message_in_run_unblocks(api: Any, broker: redisq.Broker) -> None:
    poison_then(api, broker, deleter(broker), "after deleting it")


# -- close(timeout) while a handler is still running -----------------------------------------------
def test_close_with_timeout_does_not_hand_over_a_partition_still_being_handled(
    broker: redisq.Broker,
) -> None:
    """close(timeout) returns while a handler is still inside a message: the partition must not
    be handed to another member while that handler runs (one handler per partition at a
    time)."""
    broker.create_topic("t", partitions=1)
    send(broker, b"m0", b"m1")
    inside = threading.Event()
    release = threading.Event()
    running: set[str] = set()
    overlaps: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def make(member: str) -> Any:
        def handler(message: Message) -> None:
            with lock:
                if running:
                    overlaps.append((member, message.value))
                running.add(member)
            try:
                if member == "a":
                    inside.set()
                    release.wait(10)
            finally:
                with lock:
                    running.discard(member)

        return handler

    a = broker.consumer("t", "g", "a", lease_ttl_ms=3000)
    ta = threading.Thread(target=a.run, args=(make("a"),), daemon=True)
    ta.start()
    try:
        assert inside.wait(20)
        a.close(timeout=0.5)
        b = broker.consumer("t", "g", "b", lease_ttl_ms=3000)
        tb = threading.Thread(target=b.run, args=(make("b"),), kwargs={"idle_timeout": 2.5})
        tb.start()
        time.sleep(2.0)  # a's handler is still inside m0 (it waits for `release`)
        assert not overlaps, f"two handlers of t/0 at once: {overlaps}"
    finally:
        release.set()
        ta.join(10)
        tb.join(20)


def test_seek_during_retries_with_key_lanes(broker: redisq.Broker) -> None:
    """key_concurrency=4: one lane blocks on a poison message; a seek past the whole read from
    another thread takes effect (every lane's message handled once, then those after the
    seek's offset)."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        offsets = [
            producer.send("t", f"{k}-{i}".encode(), key=f"k{k}").offset  # type: ignore[misc]
            for i in range(5)
            for k in range(4)
        ]
    later = send(broker, b"after1", b"after2", key="z")
    seen: list[bytes] = []
    lock = threading.Lock()

    def handler(message: Message) -> None:
        if message.value == b"0-2":
            raise RuntimeError("poison")
        with lock:
            seen.append(message.value)

    consumer = broker.consumer(
        "t", "g", failure_policy="block", max_attempts=1, key_concurrency=4, **FAST
    )
    thread = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    thread.start()

    # A key keeps its lane (crc32 of the key, as redisq.consume.chunks.lanes): the messages read
    # after
    # the poison in its lane wait behind it, every other one is handled.
    def lane(k: int) -> int:
        return zlib.crc32(b"k%d" % k) % 4

    stuck = {b"%d-%d" % (k, i) for k in range(4) for i in range(2, 5) if lane(k) == lane(0)}
    others = {b"%d-%d" % (k, i) for k in range(4) for i in range(5)} - stuck
    try:
        wait_until(lambda: set(seen) >= others, what="the other lanes")
        assert not stuck & set(seen) and len(seen) == len(others)  # each once, none behind it
        consumer.seek(0, later[0])
        wait_until(lambda: b"after2" in seen, timeout=10, what="the messages after the seek")
        assert seen.count(b"after1") == 1 and offsets and not stuck & set(seen)
    finally:
        consumer.close(timeout=5)
        thread.join(10)


# -- bad input to the controls ---------------------------------------------------------------
def test_a_bool_or_float_is_no_partition_to_seek_or_pause(broker: redisq.Broker) -> None:
    """seek(True, ...) moved partition 1 (True == 1, same hash), while committed(True) refuses
    it; poll(timeout=nan) never returned."""
    broker.create_topic("t", partitions=2)
    with broker.consumer("t", "g", lease_ttl_ms=1500) as consumer:
        wait_until(lambda: len(consumer.assignment) == 2, what="both partitions")
        before = consumer.position(1)
        for partition in (True, 1.0, ("t", True)):
            with pytest.raises(redisq.errors.InvalidConfig):
                consumer.seek(partition, "1-0")  # type: ignore[arg-type]
            with pytest.raises(redisq.errors.InvalidConfig):
                consumer.pause(partition)  # type: ignore[arg-type]
        assert consumer.position(1) == before
        assert consumer.paused() == []
        with pytest.raises(redisq.errors.InvalidConfig):
            consumer.poll(timeout=float("nan"))
