"""Where a member reads (both APIs, every backend): seek(), seek_to_time(), position() and
committed() from a poll loop, a seek from the handler taking effect before the rest of the read
under way, and pause()/resume() in a poll loop and in run() (a partition paused from on_assign).
Argument checks of these controls are in test_parameters_of_the_controls_are_checked."""

from __future__ import annotations

import json
from typing import Any

import redisq
from redisq.model.offsets import offset_parts
from tests.aio import Recorder
from tests.apis import coroutine_on_asyncio, poll_and_ack
from tests.conftest import wait_until
from tests.consume.test_consumer import numbers, run_in_thread

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}


def seek_back_after(count: int, consumer_ref: list[object], seen: list[int], offsets: list[str]):
    """A handler recording each message's number that, after `count` messages, seeks the
    partition back to the first one (the consumer is looked up when it is needed)."""

    def handler(message: redisq.Message) -> None:
        seen.append(json.loads(message.value)["n"])
        offsets.append(message.offset)
        if len(seen) == count:
            consumer_ref[0].seek(0, offsets[0])  # type: ignore[attr-defined]

    return handler


def assert_seek_took_effect(seen: list[int], count: int, total: int) -> None:
    """The messages after the seek's: the rest of the read under way is not handled first (a
    chunk of it may be), then everything again from the seek's offset, in order."""
    assert seen[:count] == list(range(count))
    restart = seen.index(0, count)
    assert seen[count:restart] == list(range(count, restart))
    assert restart - count < 100, f"{restart - count} messages of the old read after the seek"
    assert seen[restart:] == list(range(total))


def test_seek_from_the_handler_takes_effect_before_the_rest_of_the_read(
    api: Any, broker: redisq.Broker
) -> None:
    """On the asyncio API the handler is a coroutine function: the seek is made on the loop."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for n in range(500):
            producer.send_async("t", json.dumps({"n": n}), key=f"k{n % 5}")
    seen: list[int] = []
    consumer_ref: list[object] = [None]
    handler = coroutine_on_asyncio(api, seek_back_after(10, consumer_ref, seen, []))
    with api.broker.consumer("t", "g", batch_size=1000, **FAST) as consumer:
        consumer_ref[0] = consumer
        consumer.run(handler, idle_timeout=1.5)
    assert_seek_took_effect(seen, 10, 500)


def test_seek_seek_to_time_position_and_committed(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for n in range(10):
            producer.send("t", json.dumps({"n": n}), key=f"k{n % 3}")
    consumer = api.broker.consumer("t", "g", ack_interval_ms=60_000, **FAST)
    try:
        read = poll_and_ack(consumer, 10)
        assert numbers(read) == list(range(10))
        assert consumer.position(0) == read[-1].offset
        committed = consumer.committed(0)
        assert committed is None or offset_parts(committed) < offset_parts(read[0].offset)
        consumer.commit()
        assert consumer.committed(0) == read[-1].offset

        consumer.seek(0, read[3].offset)
        assert consumer.position(0) == read[3].offset
        again = poll_and_ack(consumer, 7)
        assert numbers(again) == list(range(3, 10))

        ts = read[6].timestamp_ms
        consumer.seek_to_time(0, ts)
        expected = [m.offset for m in read if m.timestamp_ms >= ts]
        assert [m.offset for m in poll_and_ack(consumer, len(expected))] == expected

        consumer.seek(0, read[2].offset)  # back: the committed position follows
        back = poll_and_ack(consumer, 1)
        assert numbers(back) == [2]
        consumer.commit()
        assert consumer.committed(0) == read[2].offset
    finally:
        consumer.close()
    # The next member starts after the committed position.
    with api.broker.consumer("t", "g", **FAST) as heir:
        assert numbers(poll_and_ack(heir, 7)) == list(range(3, 10))


def test_pause_and_resume(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for p in (0, 1):
            for n in range(5):
                producer.send_async("t", json.dumps({"k": p, "n": n}), partition=p)
    # poll(): a paused partition gives nothing, its lease is kept.
    with api.broker.consumer("t", "polling", **FAST) as consumer:
        wait_until(lambda: consumer.assignment == [0, 1], what="both leases")
        consumer.pause(1)
        first = poll_and_ack(consumer, 5)
        assert {m.partition for m in first} == {0} and numbers(first) == list(range(5))
        assert consumer.poll(timeout=0.5) == []
        assert consumer.assignment == [0, 1]
        consumer.resume(1)
        rest = poll_and_ack(consumer, 5)
        assert {m.partition for m in rest} == {1} and numbers(rest) == list(range(5))
    # run(): partition 0 paused as soon as it is assigned (on_assign), then resumed.
    recorder = Recorder()
    running: list[Any] = []

    def pause_zero(tps: list[tuple[str, int]]) -> None:
        if ("t", 0) in tps:
            running[0].pause(0)

    consumer = api.broker.consumer("t", "running", on_assign=pause_zero, **FAST)
    running.append(consumer)
    thread = run_in_thread(consumer, recorder)
    try:
        wait_until(lambda: len(recorder.done[1]) == 5, what="partition 1 handled")
        assert recorder.done[0] == []
        consumer.resume(0)
        wait_until(lambda: len(recorder.done[0]) == 5, what="partition 0 after resume")
    finally:
        consumer.close()
        thread.join(30)
    assert recorder.done == {0: list(range(5)), 1: list(range(5))}
