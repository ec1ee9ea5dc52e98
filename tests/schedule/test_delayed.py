"""Delayed messages (DESIGN §12) on real servers: acknowledged when stored, appended
once when due (never before, by the server's clock), per-key order of equal due times, re-sends
of one schedule id before and after delivery, schedulers killed (SIGKILL) and running side by
side, plain messages never held back, bad input refused with nothing stored, describe_topic and
delete_topic. Tests taking `api` run once per API (the thread API, and redisq.asyncio behind
tests/apis.py's Bridge). Tests run on each backend (valkey, valkey-cluster, redis,
valkey-cluster3): every key of a partition shares its hash tag, so schedule.lua and
deliver_due.lua run in one slot (a cluster refuses any undeclared key).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import redis

import redisq
from redisq.errors import InvalidConfig, LeaseLost, ProducerFenced
from redisq.protocol import ScriptCall
from redisq.protocol import schedule as calls
from redisq.protocol.produce import ProducerIdentity, encode_message
from redisq.schedule.scheduler import Scheduler
from redisq.server.transport import Transport
from redisq.server.transport_async import AsyncTransport
from tests.apis import failure, refused
from tests.marks import ONE_BACKEND

PARTITIONS = 3


def read_all(broker: redisq.Broker, topic: str) -> list[redisq.Message]:
    partitions = broker.describe_topic(topic).config.partitions
    return [m for p in range(partitions) for m in broker.read(topic, p)]


def wait_for(condition: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def delivered_values(broker: redisq.Broker, topic: str) -> Counter[bytes]:
    return Counter(m.value for m in read_all(broker, topic))


def schedule_keys(broker: redisq.Broker, topic: str, partitions: int) -> list[bytes]:
    keys = []
    for p in range(partitions):
        keys += [
            k
            for k in broker.client.scan_iter(match=broker.keys.partition_pattern(topic, p))
            if not k.endswith(b":log")
        ]
    return keys


# -- acknowledged, then delivered once when due ------------------------------------------------


def test_delivered_once_and_never_before_due(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    at = datetime.now(UTC) + timedelta(milliseconds=700)
    with api.broker.producer() as producer:
        first = producer.send("orders", b"first", key="k1", delay_ms=300)
        futures = [
            producer.send_async("orders", b"d%d" % i, key=f"k{i % 7}", delay_ms=300 + 3 * i)
            for i in range(100)
        ]
        futures.append(producer.send_async("orders", b"at", key="k0", deliver_at=at))
        metas = [api.result(f) for f in futures]
        # Acknowledged = stored in the schedule: no offset yet, nothing in the partitions.
        assert all(m.offset is None and not m.duplicate for m in [first, *metas])
        assert all(m.schedule_id and m.deliver_at_ms for m in [first, *metas])
        assert metas[-1].deliver_at_ms == int(at.timestamp() * 1000)
        wait_for(lambda: len(read_all(broker, "orders")) >= 102, what="delivery")
        time.sleep(0.3)  # a second delivery would come within a few ticks
    messages = read_all(broker, "orders")
    assert Counter(m.value for m in messages) == Counter(
        [b"first"] + [b"d%d" % i for i in range(100)] + [b"at"]
    )
    due = {(m.partition, m.schedule_id): m.deliver_at_ms for m in [first, *metas]}
    by_value = {f"d{i}".encode(): metas[i] for i in range(100)} | {
        b"at": metas[-1],
        b"first": first,
    }
    for message in messages:
        meta = by_value[message.value]
        assert message.partition == meta.partition
        # Both clocks are the server's: the stream ID's time and the due time.
        assert message.timestamp_ms >= due[(meta.partition, meta.schedule_id)], message
        assert message.producer_id is not None and message.sequence is None
    assert broker.describe_topic("orders").total_scheduled == 0


def test_a_consumer_delivers_what_a_closed_producer_scheduled(
    api: Any, broker: redisq.Broker
) -> None:
    """The producer is closed (its scheduler stopped): a consumer of the topic runs the
    scheduler of its partitions and delivers each message once, never before it is due."""
    broker.create_topic("orders", partitions=PARTITIONS)
    with api.broker.producer() as producer:
        futures = [
            producer.send_async("orders", b"m%d" % i, key=f"k{i}", delay_ms=200 + i)
            for i in range(30)
        ]
        producer.flush()
    due = {b"m%d" % i: api.result(f).deliver_at_ms for i, f in enumerate(futures)}
    assert broker.describe_topic("orders").total_scheduled == 30  # its scheduler stopped
    got: list[redisq.Message] = []
    with api.broker.consumer("orders", group="g") as consumer:
        deadline = time.monotonic() + 20
        while len(got) < 30 and time.monotonic() < deadline:
            for message in consumer.poll(timeout=0.2):
                got.append(message)
                consumer.ack(message)
        time.sleep(0.3)  # a second delivery would come within a few ticks
        got += consumer.poll(timeout=0.1)
    assert sorted(m.value for m in got) == sorted(b"m%d" % i for i in range(30))
    for message in got:
        assert message.timestamp_ms >= due[message.value]  # the server's clock, both
    assert Counter(m.value for m in read_all(broker, "orders")) == Counter(list(due))
    assert broker.describe_topic("orders").total_scheduled == 0
    # The consumer handed its scheduler leases back when it closed (not left to expire).
    assert not [k for k in schedule_keys(broker, "orders", PARTITIONS) if b"schedlease" in k]


def test_equal_due_times_keep_send_order_per_key(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    at = datetime.now(UTC) + timedelta(milliseconds=600)
    # Small batches: the order must hold across many schedule.lua calls, not only inside one.
    with api.broker.producer(max_batch_messages=7) as producer:
        for i in range(300):
            producer.send_async("orders", b"%d" % i, key=f"k{i % 3}", deliver_at=at)
        for i in range(100):  # the same delay, sent in order
            producer.send_async("orders", b"same-%d" % i, key="same", delay_ms=400)
        producer.flush()
        wait_for(lambda: len(read_all(broker, "orders")) >= 400, what="delivery")
    by_key: dict[bytes | None, list[bytes]] = {}
    for message in read_all(broker, "orders"):
        by_key.setdefault(message.key, []).append(message.value)
    for k in range(3):
        assert by_key[f"k{k}".encode()] == [b"%d" % i for i in range(k, 300, 3)]
    assert by_key[b"same"] == [b"same-%d" % i for i in range(100)]


def test_a_delayed_message_does_not_hold_back_others(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        later = producer.send("orders", b"later", key="k", delay_ms=60_000)
        plain = [producer.send("orders", b"now-%d" % i, key="k") for i in range(3)]
        soon = producer.send("orders", b"soon", key="k", delay_ms=100)
        wait_for(lambda: len(read_all(broker, "orders")) >= 4, what="the short delay")
    assert [m.value for m in read_all(broker, "orders")] == [b"now-0", b"now-1", b"now-2", b"soon"]
    assert [m.offset for m in plain] == [m.offset for m in read_all(broker, "orders")[:3]]
    [partition] = broker.describe_topic("orders").partitions
    assert partition.scheduled == 1 and partition.next_due_ms == later.deliver_at_ms
    assert soon.deliver_at_ms is not None and soon.deliver_at_ms < later.deliver_at_ms


def test_short_delays_are_delivered_within_the_tick(broker: redisq.Broker) -> None:
    """Messages scheduled one at a time, each due sooner than a scheduler tick: a scheduler
    learns of each within TICK_MS (50 ms), so the median lateness stays far below a second
    (lenient: the machine is shared)."""
    broker.create_topic("orders", partitions=1)
    metas = []
    with broker.producer() as producer:
        for i in range(25):
            metas.append(producer.send("orders", b"%d" % i, delay_ms=20))
            time.sleep(0.037)
        wait_for(lambda: len(read_all(broker, "orders")) == 25, what="delivery")
    late = sorted(
        m.timestamp_ms - meta.deliver_at_ms
        for m, meta in zip(read_all(broker, "orders"), metas, strict=True)
    )
    assert late[0] >= 0
    assert late[len(late) // 2] < 150, late


# -- re-sends of one schedule id ---------------------------------------------------------------


def _scheduled(sid: bytes, value: bytes, delay_ms: int = 1) -> calls.Scheduled:
    body = b"".join(encode_message(b"k", value, None, None))
    return calls.Scheduled(sid, delay_ms, None, 7, "kv", body)


def test_schedule_stores_an_id_once_before_and_after_delivery(broker: redisq.Broker) -> None:
    """The scripts themselves: a re-sent batch is "already scheduled" while it waits and
    "already delivered" (a tombstone) while its sender may still retry, then forgotten."""
    broker.create_topic("orders", partitions=1)
    keys, run = broker.keys, broker.scripts.run
    batch = [_scheduled(b"s:7:1:%012x" % i, b"v%d" % i) for i in range(3)]
    sender = ProducerIdentity(7, 1)

    def schedule(horizon_ms: int) -> calls.ScheduleResult:
        call = calls.schedule(
            keys, "orders", 0, batch, identity=sender, fenced=True, retry_horizon_ms=horizon_ms,
            nonce="n1",
        )  # fmt: skip
        return run(call)

    def deliver(token: str = "t") -> calls.Delivered:
        call = calls.deliver_due(
            keys, "orders", 0, token, limit=100, retention_messages=0, retention_ms=0,
            lease_ttl_ms=2000,
        )  # fmt: skip
        return run(call)

    first = schedule(1500)
    assert first.flags == "000" and all(first.due_ms)
    again = schedule(1500)
    assert again.flags == "111" and again.due_ms == first.due_ms
    time.sleep(0.01)
    assert deliver().count == 3
    assert deliver().count == 0
    after = schedule(1500)
    assert after.flags == "222" and after.due_ms == (None, None, None)
    assert [m.value for m in broker.read("orders", 0)] == [b"v0", b"v1", b"v2"]
    # Nothing of a delivered message is kept but its id in the tombstones.
    assert broker.client.zcard(keys.scheduled("orders", 0)) == 0
    assert broker.client.hlen(keys.scheduled_messages("orders", 0)) == 0
    assert broker.client.zcard(keys.scheduled_delivered("orders", 0)) == 3
    # Another scheduler cannot run the partition while the lease is held.
    with pytest.raises(LeaseLost):
        deliver("other")
    # Past the sender's retry horizon the tombstones go (bounded memory).
    time.sleep(1.6)
    deliver()
    assert broker.client.zcard(keys.scheduled_delivered("orders", 0)) == 0


def _lose_first_reply(
    api: Any, monkeypatch: pytest.MonkeyPatch, before_raising: Callable[[], None]
) -> list[int]:
    """The first schedule.lua call of the API under test runs, then its reply is lost
    (ConnectionError), after before_raising() returns (in a thread of its own for the asyncio
    API, whose loop delivers meanwhile); the producer must send the same batch again."""
    lost: list[int] = []

    def scheduling(steps: Any) -> bool:
        first = not lost and any(
            isinstance(s, ScriptCall) and s.script == "schedule" for s in steps
        )
        if first:
            lost.append(1)
        return first

    if api.name == "sync":
        real = Transport.execute  # the delayed sender's rounds (its own connections)

        def execute(self: Transport, steps: Any, *args: Any) -> Any:
            result = real(self, steps, *args)
            if scheduling(steps):
                before_raising()
                raise redis.ConnectionError("reply lost (test)")
            return result

        monkeypatch.setattr(Transport, "execute", execute)
    else:
        real_async = AsyncTransport.execute

        async def execute_async(self: AsyncTransport, steps: Any, *args: Any) -> Any:
            result = await real_async(self, steps, *args)
            if scheduling(steps):
                await asyncio.to_thread(before_raising)
                raise redis.ConnectionError("reply lost (test)")
            return result

        monkeypatch.setattr(AsyncTransport, "execute", execute_async)
    return lost


@pytest.mark.parametrize("when", ["before delivery", "after delivery"])
def test_a_resent_batch_is_stored_once(
    api: Any, broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    broker.create_topic("orders", partitions=1)

    def wait_delivered() -> None:
        if when == "after delivery":
            wait_for(lambda: broker.client.xlen(broker.keys.log("orders", 0)) == 5, what="it")

    lost = _lose_first_reply(api, monkeypatch, wait_delivered)
    # A long linger: the five go in one batch, whose reply is lost.
    with api.broker.producer(retry_backoff_ms=10, linger_ms=500) as producer:
        futures = [producer.send_async("orders", b"v%d" % i, delay_ms=200) for i in range(5)]
        metas = [api.result(f) for f in futures]
        wait_for(lambda: len(read_all(broker, "orders")) >= 5, what="delivery")
        time.sleep(0.3)
    assert lost == [1]
    assert all(m.duplicate for m in metas)  # answered by the re-sent batch
    if when == "after delivery":
        assert all(m.deliver_at_ms is None for m in metas)
    assert [m.value for m in read_all(broker, "orders")] == [b"v%d" % i for i in range(5)]


def test_message_id_mode_schedules_an_id_once(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    with broker.producer(idempotence="message_id") as producer:
        first = producer.send("orders", b"paid", message_id="order-42", delay_ms=300)
        second = producer.send("orders", b"paid again", message_id="order-42", delay_ms=300)
        assert not first.duplicate and second.duplicate
        assert first.schedule_id == second.schedule_id == "m:order-42"
        wait_for(lambda: read_all(broker, "orders"), what="delivery")
        time.sleep(0.2)
    [message] = read_all(broker, "orders")
    assert (message.value, message.message_id) == (b"paid", b"order-42")


def test_a_fenced_named_producer_cannot_schedule(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    old = broker.producer(name="svc")
    old.send("orders", b"old", key="k", delay_ms=60_000)
    with broker.producer(name="svc") as new:
        new.send("orders", b"new", key="k", delay_ms=60_000)
        with pytest.raises(ProducerFenced):
            old.send("orders", b"zombie", key="k", delay_ms=60_000)
    old.close()
    assert broker.describe_topic("orders").total_scheduled == 2


# -- bad input ---------------------------------------------------------------------------------


@ONE_BACKEND
def test_bad_input_is_refused_with_nothing_stored(api: Any, broker: redisq.Broker) -> None:
    """Each bad argument is refused by send() and send_async() with a typed error, nothing
    scheduled: the thread API's send_async at once; the asyncio API's at once, or through its
    future while the topic's metadata is not loaded (the range checks need it)."""
    broker.create_topic("orders", partitions=PARTITIONS)
    broker.create_topic("short", partitions=1, retention_ms=60_000)
    naive = datetime.now() + timedelta(minutes=1)
    now = datetime.now(UTC)
    cases: list[tuple[str, dict[str, Any], type[Exception]]] = [
        ("orders", {"delay_ms": 0}, InvalidConfig),
        ("orders", {"delay_ms": -5}, InvalidConfig),
        ("orders", {"delay_ms": 3 * 24 * 3600 * 1000 + 1}, InvalidConfig),
        ("short", {"delay_ms": 60_001}, InvalidConfig),  # past the topic's retention
        ("short", {"deliver_at": now + timedelta(minutes=2)}, InvalidConfig),
        ("orders", {"delay_ms": 1.5}, TypeError),
        ("orders", {"delay_ms": "100"}, TypeError),
        ("orders", {"delay_ms": True}, TypeError),
        ("orders", {"deliver_at": naive}, TypeError),
        ("orders", {"deliver_at": "2030-01-01T00:00:00Z"}, TypeError),
        ("orders", {"deliver_at": now.timestamp()}, TypeError),
        ("orders", {"delay_ms": 100, "deliver_at": now}, InvalidConfig),
        ("orders", {"delay_ms": 100, "partition": PARTITIONS}, redisq.PartitionOutOfRange),
        ("orders", {"delay_ms": 100, "value": 12}, TypeError),
        ("missing", {"delay_ms": 100}, redisq.TopicNotFound),
    ]
    for topic, options, error in cases:  # a producer that has loaded no topic yet
        kwargs = dict(options)
        value = kwargs.pop("value", b"v")
        with api.broker.producer(max_message_bytes=1000) as fresh:
            refused(
                api,
                error,
                lambda: fresh.send_async(topic, value, key="k", **kwargs),  # noqa: B023
                at_once=api.name == "sync",
            )
    with api.broker.producer(max_message_bytes=1000) as producer:
        producer.send("orders", b"v", key="k")  # both topics loaded: refused at once
        producer.send("short", b"v", key="k")
        for topic, options, error in cases:
            value = options.pop("value", b"v")
            with pytest.raises(error):
                producer.send(topic, value, key="k", **options)
            refused(
                api,
                error,
                lambda: producer.send_async(topic, value, key="k", **options),  # noqa: B023
                at_once=api.name == "sync" or topic != "missing",
            )
        with pytest.raises(redisq.MessageTooLarge):
            producer.send_async("orders", b"x" * 1001, delay_ms=100)
    assert broker.describe_topic("orders").total_scheduled == 0
    assert broker.describe_topic("short").total_scheduled == 0


def test_due_times_in_the_past_or_other_zones_are_accepted(api: Any, broker: redisq.Broker) -> None:
    """Within the limits: accepted; a deliver_at in the past is due at once, one before 1970
    reported due at 0 (None would say "delivered already")."""
    broker.create_topic("orders", partitions=PARTITIONS)
    broker.create_topic("short", partitions=1, retention_ms=60_000)
    now = datetime.now(UTC)
    with api.broker.producer() as producer:
        producer.send("short", b"ok", delay_ms=60_000)
        producer.send("orders", b"past", deliver_at=now - timedelta(hours=1))
        producer.send("orders", b"zone", deliver_at=datetime.now(timezone(timedelta(hours=-5))))
        ancient = producer.send("orders", b"1969", deliver_at=datetime(1969, 12, 31, tzinfo=UTC))
        assert ancient.deliver_at_ms == 0 and ancient.offset is None
        wait_for(lambda: len(read_all(broker, "orders")) == 3, what="the due ones")
    assert broker.describe_topic("orders").total_scheduled == 0
    assert broker.describe_topic("short").total_scheduled == 1


# -- describe and delete -----------------------------------------------------------------------


def test_describe_shows_scheduled_counts_and_next_due(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    with broker.producer() as producer:
        metas = [
            producer.send("orders", b"m", partition=i % 2, delay_ms=60_000 + 1000 * i)
            for i in range(5)
        ]
        described = broker.describe_topic("orders")
    assert [p.scheduled for p in described.partitions] == [3, 2, 0]
    assert [p.next_due_ms for p in described.partitions] == [
        metas[0].deliver_at_ms,
        metas[1].deliver_at_ms,
        None,
    ]
    assert described.total_scheduled == 5 and described.total_messages == 0


def test_delete_topic_deletes_the_schedule(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    with broker.producer() as producer:
        for i in range(6):
            producer.send("orders", b"later", key=f"k{i}", delay_ms=60_000)
        for i in range(6):  # delivered while the sender may retry: tombstones remain
            producer.send("orders", b"soon", key=f"k{i}", delay_ms=50)
        wait_for(lambda: len(read_all(broker, "orders")) == 6, what="the short ones")
        kinds = {k.rsplit(b":", 1)[-1] for k in schedule_keys(broker, "orders", PARTITIONS)}
        assert {b"schedule", b"scheduled", b"delivered", b"schedlease"} <= kinds
    broker.delete_topic("orders")
    assert schedule_keys(broker, "orders", PARTITIONS) == []
    with broker.producer() as producer, pytest.raises(redisq.TopicNotFound):
        producer.send("orders", b"after", delay_ms=100)


def test_delayed_sends_to_a_deleted_topic_fail(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    with api.broker.producer() as producer:
        producer.send("orders", b"first", key="k", delay_ms=60_000)  # the topic is cached
        broker.delete_topic("orders")
        late = producer.send_async("orders", b"late", key="k", delay_ms=100)
        assert isinstance(failure(api, late), redisq.TopicNotFound)
        with pytest.raises(redisq.TopicNotFound):  # now known: read again, refused
            producer.send("orders", b"again", key="k", delay_ms=100)
        # The thread API refuses at once; the asyncio API reads the topic again first.
        refused(
            api,
            redisq.TopicNotFound,
            lambda: producer.send_async("orders", b"again", key="k", delay_ms=100),
            at_once=api.name == "sync",
        )
    assert schedule_keys(broker, "orders", 2) == []
    assert broker.list_topics() == []


# -- schedulers: killed, side by side ------------------------------------------------------------


def _start_scheduler_process(url: str, namespace: str, *topics: str) -> subprocess.Popen[str]:
    """`redisq scheduler` in a process of its own, once it runs."""
    options = [arg for topic in topics for arg in ("--topic", topic)]
    child = subprocess.Popen(
        [sys.executable, "-m", "redisq.cli", "scheduler", "--url", url, "--namespace", namespace]
        + options,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert child.stderr is not None
    assert "delivering delayed messages" in child.stderr.readline()
    return child


def test_the_scheduler_command_stops_cleanly(broker: redisq.Broker, server_url: str) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    broker.create_topic("other", partitions=1)
    with broker.producer() as producer:
        for topic in ("orders", "other"):
            for i in range(10):
                producer.send_async(topic, b"%d" % i, key=f"k{i}", delay_ms=1500)
    child = _start_scheduler_process(server_url, broker.namespace)  # every topic
    try:
        wait_for(lambda: len(read_all(broker, "orders")) + len(read_all(broker, "other")) == 20)
        leases = [broker.keys.scheduler_lease("orders", p) for p in range(PARTITIONS)]
        assert all(broker.client.exists(lease) for lease in leases)
    finally:
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=20)
    assert child.returncode == 0
    assert "20 delayed messages delivered" in err
    # Handed back, not left to expire.
    assert [k for k in schedule_keys(broker, "orders", PARTITIONS) if b"schedlease" in k] == []
    missing = subprocess.run(
        [sys.executable, "-m", "redisq.cli", "scheduler", "--url", server_url,
         "--namespace", broker.namespace, "--topic", "missing"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert missing.returncode == 3 and "TopicNotFound" in missing.stderr


def test_a_sigkilled_scheduler_loses_and_doubles_nothing(
    broker: redisq.Broker, server_url: str
) -> None:
    """History check: every acknowledged delayed message appears exactly once, though the
    scheduler delivering them is SIGKILLed mid-run (its lease held) and another takes over."""
    broker.create_topic("orders", partitions=PARTITIONS)
    n = 1500
    with broker.producer() as producer:  # its scheduler stops (leases handed back) on close
        futures = [
            producer.send_async("orders", b"%d" % i, key=f"k{i % 50}", delay_ms=800 + 2 * i)
            for i in range(n)
        ]
        acknowledged = {b"%d" % i for i, f in enumerate(futures) if f.exception(30) is None}
    assert len(acknowledged) == n
    first = _start_scheduler_process(server_url, broker.namespace, "orders")
    try:
        wait_for(lambda: len(read_all(broker, "orders")) > n // 4, what="deliveries")
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    at_kill = len(read_all(broker, "orders"))
    assert at_kill < n, "the scheduler was killed after it had finished: nothing was tested"
    # Its leases outlive it: the next scheduler takes over once they expire.
    second = _start_scheduler_process(server_url, broker.namespace, "orders")
    try:
        wait_for(lambda: broker.describe_topic("orders").total_scheduled == 0, what="the rest")
        time.sleep(0.3)
    finally:
        os.kill(second.pid, signal.SIGKILL)
        second.wait()
    counts = delivered_values(broker, "orders")
    assert set(counts) == acknowledged
    assert [v for v, c in counts.items() if c > 1] == []


def test_two_schedulers_side_by_side_deliver_each_message_once(
    api: Any, broker: redisq.Broker, server_url: str
) -> None:
    """A scheduler of the API under test and a thread scheduler on its own connection, while a
    thief keeps deleting the partitions' leases (so both keep taking them): each message is
    still appended exactly once, and closing hands the leases back."""
    broker.create_topic("orders", partitions=PARTITIONS)
    n = 1000
    with broker.producer() as producer:
        for i in range(n):
            producer.send_async("orders", b"%d" % i, key=f"k{i % 20}", delay_ms=600 + i)
    described = broker.describe_topic("orders")
    assert described.total_scheduled == n
    other = redisq.connect(server_url, namespace=broker.namespace)
    schedulers = [api.scheduler(["orders"]), Scheduler(other, ["orders"])]
    stop = threading.Event()
    leases = [broker.keys.scheduler_lease("orders", p) for p in range(PARTITIONS)]

    def steal_leases() -> None:
        while not stop.is_set():
            for lease in leases:
                broker.client.delete(lease)
            time.sleep(0.005)

    thief = threading.Thread(target=steal_leases, daemon=True)
    thief.start()
    try:
        wait_for(lambda: broker.describe_topic("orders").total_scheduled == 0, what="delivery")
        time.sleep(0.3)
    finally:
        stop.set()
        thief.join()
        for scheduler in schedulers:
            scheduler.close()
        other.close()
    counts = delivered_values(broker, "orders")
    assert set(counts) == {b"%d" % i for i in range(n)}
    assert [v for v, c in counts.items() if c > 1] == []
    assert sum(s.delivered for s in schedulers) == n
    assert [broker.client.exists(lease) for lease in leases] == [0] * PARTITIONS


def test_one_scheduler_per_partition_and_a_takeover(broker: redisq.Broker, server_url: str) -> None:
    broker.create_topic("orders", partitions=PARTITIONS)
    first = Scheduler(broker, ["orders"])
    wait_for(lambda: len(first.held()) == PARTITIONS, what="the leases")
    other = redisq.connect(server_url, namespace=broker.namespace)
    second = Scheduler(other, ["orders"])
    try:
        with broker.producer() as producer:  # its own scheduler knocks in vain too
            for i in range(50):
                producer.send_async("orders", b"%d" % i, key=f"k{i}", delay_ms=100)
            producer.send("orders", b"after", key="k0", delay_ms=1500)
        wait_for(lambda: first.delivered == 50, what="the first scheduler's deliveries")
        assert second.delivered == 0 and second.held() == []
        first.close()  # hands its leases back: the second takes over at its next knock
        wait_for(lambda: second.delivered == 1, timeout=5, what="the takeover")
        assert len(second.held()) == PARTITIONS
    finally:
        first.close()
        second.close()
        other.close()
    assert delivered_values(broker, "orders")[b"after"] == 1
