"""What the views read (redisq.protocol.overview, redisq.protocol.waiting, the metrics, the
console's reads): a
command answered with an error is a ReadFailed naming what was read, never an empty partition,
no lag or nothing waiting. Real faults where they can be made (a key of another type where a
stream, hash or sorted set should be: WRONGTYPE), else an error put in place of a step's reply
at the pipeline boundary (the executor the operations are run with). A key that does not exist
is still nothing there."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis

import redisq
from redisq import metrics
from redisq.console import pages, producers
from redisq.console.browse import find_by_message_id
from redisq.errors import ReadFailed
from redisq.protocol import Command, ScriptCall, run_operation
from redisq.protocol.overview import group_snapshot, namespace_snapshot, topic_snapshot
from redisq.protocol.waiting import (
    scheduled_messages,
    schedules,
    transactions_snapshot,
    unresolved_messages,
)

pytestmark = pytest.mark.parametrize("backend", ["valkey", "valkey-cluster", "redis"])


def failing(broker: redisq.Broker, *command: str) -> Callable[[Any], Any]:
    """broker.scripts.execute, with a ConnectionError in place of the reply of every pipelined
    step that starts with `command` (a script's name for a script call)."""

    def matches(step: Any) -> bool:
        if isinstance(step, ScriptCall):
            return step.script == command[0]
        assert isinstance(step, Command)
        return tuple(str(a).upper() for a in step.args[: len(command)]) == command

    def execute(steps: Any) -> Any:
        results = broker.scripts.execute(steps)
        if not isinstance(steps, list):
            return results
        return [
            redis.ConnectionError("injected") if matches(step) else result
            for step, result in zip(steps, results, strict=True)
        ]

    return execute


def run(broker: redisq.Broker, operation: Any, *command: str) -> Any:
    execute = failing(broker, *command) if command else broker.scripts.execute
    return run_operation(operation, execute)


def a_group(
    broker: redisq.Broker,
    topic: str = "orders",
    group: str = "billing",
    entry_format: str | None = None,
) -> None:
    """A topic of two partitions with messages, a group that consumed some, a lease held."""
    broker.create_topic(topic, partitions=2, exist_ok=True, entry_format=entry_format)
    with broker.producer() as producer:
        for i in range(6):
            producer.send(topic, b"v%d" % i, partition=i % 2)
    with broker.consumer(topic, group=group, name="m1") as consumer:
        assert consumer.poll(timeout=5, max_messages=1)


def wrong_type(broker: redisq.Broker, key: str) -> None:
    """The key replaced by a list: the commands for a string, hash, sorted set or stream
    answer WRONGTYPE."""
    broker.client.delete(key)
    broker.client.rpush(key, b"not redisq's")


# -- inspect: every command of a namespace snapshot -----------------------------------------------
SNAPSHOT_COMMANDS = [
    ("XINFO", "STREAM"),
    ("ZCARD",),
    ("ZRANGE",),  # the schedules' first entry and the group's members
    ("XINFO", "GROUPS"),
    ("HGETALL",),  # group settings and per-partition state
    ("GET",),  # leases and their fencing counters
    ("PTTL",),
    ("HLEN",),
]


@pytest.mark.parametrize("command", SNAPSHOT_COMMANDS, ids=" ".join)
def test_namespace_snapshot_raises_on_a_failed_command(
    broker: redisq.Broker, command: tuple[str, ...]
) -> None:
    a_group(broker)
    run(broker, namespace_snapshot(broker.keys))  # reads fine without the fault
    with pytest.raises(ReadFailed, match="orders") as failed:
        run(broker, namespace_snapshot(broker.keys), *command)
    assert isinstance(failed.value.cause, redis.ConnectionError)


def test_lag_redis_cannot_tell_is_counted_or_the_snapshot_fails(broker: redisq.Broker) -> None:
    """A deleted entry after the position: Redis cannot tell the lag, count_range counts it; a
    failed count is an error, not a lag left unknown as if it were past the cap. (Message
    entries: a batch topic's lag comes from its partition counters, DESIGN §14.6.)"""
    a_group(broker, entry_format="message")
    log = broker.keys.log("orders", 1)
    newest = broker.client.xrevrange(log, count=1)[0][0]
    broker.client.xdel(log, newest)
    groups = run(broker, namespace_snapshot(broker.keys)).groups
    assert groups[("orders", "billing")].partitions[1].lag_counted
    with pytest.raises(ReadFailed, match="orders"):
        run(broker, namespace_snapshot(broker.keys), "count_range")


@pytest.mark.parametrize(
    "key",
    [
        lambda k: k.log("orders", 1),
        lambda k: k.scheduled("orders", 1),
        lambda k: k.lease("orders", 1, "billing"),
        lambda k: k.lease_fence("orders", 1, "billing"),
        lambda k: k.group_partition_state("orders", 1, "billing"),
        lambda k: k.parked_keys("orders", 1, "billing"),
        lambda k: k.held_messages("orders", 1, "billing"),
        lambda k: k.group_members("orders", "billing"),
        lambda k: k.group_meta("orders", "billing"),
    ],
    ids=["log", "schedule", "lease", "fence", "state", "parked", "held", "members", "meta"],
)
def test_a_key_of_another_type_fails_describe_and_metrics(
    broker: redisq.Broker, key: Callable[[Any], str]
) -> None:
    a_group(broker)
    wrong_type(broker, key(broker.keys))
    with pytest.raises(ReadFailed, match="WRONGTYPE"):
        run(broker, group_snapshot(broker.keys, "orders", "billing"))
    with pytest.raises(ReadFailed, match="orders"):
        metrics.collect(broker, clients=[])


def test_a_deleted_partition_stream_is_still_empty(broker: redisq.Broker) -> None:
    """XINFO STREAM and XINFO GROUPS answer 'no such key' for a stream deleted under the read
    (delete_topic between two round trips): nothing there, not a failure."""
    a_group(broker)
    broker.client.delete(broker.keys.log("orders", 1))
    snapshot = run(broker, topic_snapshot(broker.keys, "orders"))
    assert snapshot.topics["orders"].partitions[1].length == 0
    assert snapshot.groups[("orders", "billing")].partitions[1].lag == 0


# -- waiting: transactions, schedules, unresolved and delayed messages ---------------------------
def test_transactions_snapshot_raises_on_a_failed_record_or_count(broker: redisq.Broker) -> None:
    keys = broker.keys
    broker.client.zadd(keys.transactions(), {"tx-1": 1})
    broker.client.hset(keys.transaction("tx-1"), mapping={"state": "open", "created_ms": 1})
    assert run(broker, transactions_snapshot(keys)).total == 1
    with pytest.raises(ReadFailed, match="tx-1"):
        run(broker, transactions_snapshot(keys), "LLEN")
    wrong_type(broker, keys.transaction("tx-1"))  # was shown as "missing"
    with pytest.raises(ReadFailed, match="WRONGTYPE"):
        run(broker, transactions_snapshot(keys))


def test_schedules_raise_on_a_failed_count(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    assert run(broker, schedules(broker.keys)).partitions == []
    for command in [("HGET",), ("ZCARD",), ("ZRANGE",)]:
        with pytest.raises(ReadFailed, match="orders"):
            run(broker, schedules(broker.keys), *command)
    wrong_type(broker, broker.keys.scheduled("orders", 1))
    with pytest.raises(ReadFailed, match="WRONGTYPE"):
        run(broker, schedules(broker.keys))


def test_unresolved_and_scheduled_messages_raise_on_failed_reads(broker: redisq.Broker) -> None:
    keys = broker.keys
    (nothing,) = run(broker, unresolved_messages(keys, ["g~unresolved"]))
    assert (nothing.length, nothing.messages) == (0, [])  # no such topic: nothing there
    for command in [("XREVRANGE",), ("XLEN",)]:
        with pytest.raises(ReadFailed, match="g~unresolved"):
            run(broker, unresolved_messages(keys, ["g~unresolved"]), *command)
    broker.client.zadd(keys.scheduled("orders", 0), {b"m1": 5})
    broker.client.hset(keys.scheduled_messages("orders", 0), b"m1", b"x")
    assert run(broker, scheduled_messages(keys, {("orders", 0): 5})) == []  # not its stored form
    for command in [("ZRANGE",), ("HMGET",)]:
        with pytest.raises(ReadFailed, match="orders"):
            run(broker, scheduled_messages(keys, {("orders", 0): 5}), *command)


# -- the console's own reads ---------------------------------------------------------------------
def test_console_pending_entries_are_read_and_a_failed_read_raises(
    broker: redisq.Broker,
) -> None:
    """The group page's pending entries (concurrent mode): read in their detailed form (a plain
    XPENDING command was parsed by redis-py as the summary form and failed), and a partition
    whose read fails is an error, not 'nothing pending'."""
    broker.create_topic("orders", partitions=2)
    with broker.producer() as producer:
        for p in (0, 1):
            producer.send("orders", b"v", partition=p)
    console: Any = SimpleNamespace(broker=broker)
    with broker.consumer("orders", group="work", name="m1", mode="concurrent") as consumer:
        assert len(consumer.poll(timeout=5, max_messages=10)) == 2  # not acknowledged
        pending = pages._pending_entries(console, "orders", "work", [0, 1])
        assert sorted(pending) == [0, 1]
        assert [row["consumer"] for row in pending[1]] == ["m1"]
        assert pages._pending_entries(console, "orders", "other", [0, 1]) == {}  # NOGROUP
        wrong_type(broker, broker.keys.log("orders", 1))
        with pytest.raises(ReadFailed, match="WRONGTYPE"):
            pages._pending_entries(console, "orders", "work", [0, 1])


def test_console_parked_keys_raise(broker: redisq.Broker) -> None:
    a_group(broker)
    assert run(broker, pages._parked_keys(broker.keys, "orders", "billing", 2)) == {}
    wrong_type(broker, broker.keys.parked_keys("orders", 1, "billing"))
    with pytest.raises(ReadFailed, match="WRONGTYPE"):
        run(broker, pages._parked_keys(broker.keys, "orders", "billing", 2))


def test_console_producer_reads_raise(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    with broker.producer(name="shop") as producer:
        producer.send("orders", b"v", partition=1)
    assert [n.name for n in producers.named_producers(broker)] == ["shop"]
    assert producers.topic_producers(broker, "orders")
    wrong_type(broker, broker.keys.named_producer_topics("shop"))
    with pytest.raises(ReadFailed, match="shop"):
        producers.named_producers(broker)
    state = broker.keys.producer_state("orders", 1, producers.named_producer_id("shop"))
    wrong_type(broker, state)
    with pytest.raises(ReadFailed, match="orders"):
        producers.topic_producers(broker, "orders")


def test_console_message_id_lookup_raises(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    with broker.producer(idempotence="message_id") as producer:
        producer.send("orders", b"v", message_id=b"m-1", partition=1)
    assert len(find_by_message_id(broker, "orders", b"m-1").messages) == 1
    for p in range(2):
        for bucket in (0, 1):
            key = broker.keys.dedup_bucket("orders", p, bucket)
            if broker.client.type(key) == b"hash":
                wrong_type(broker, key)
    with pytest.raises(ReadFailed, match="WRONGTYPE"):
        find_by_message_id(broker, "orders", b"m-1")
    with pytest.raises(ReadFailed, match="dedup bucket"):
        producers.dedup_buckets(broker, "orders")


def test_console_pages_show_the_failed_read(broker: redisq.Broker) -> None:
    """A page whose read failed is an error page naming what failed (502), not zeros."""
    pytest.importorskip("uvicorn")
    import urllib.error
    import urllib.request

    from tests.console.test_http import running_console

    a_group(broker)
    wrong_type(broker, broker.keys.group_partition_state("orders", 1, "billing"))
    with running_console(broker) as base:
        for path in ("/", "/topics/orders", "/topics/orders/groups/billing", "/metrics"):
            with pytest.raises(urllib.error.HTTPError) as failed:
                urllib.request.urlopen(base + path, timeout=10)
            assert failed.value.code == 502, path
            body = failed.value.read().decode()
            assert "WRONGTYPE" in body and "billing" in body, path
