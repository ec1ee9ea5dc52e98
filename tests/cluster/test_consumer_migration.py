# ruff: noqa: F811  (the broker and cluster3 fixtures come from tests.cluster.test_three_masters)
"""A consumer's own reads while its partition's slot is half migrated, on three masters (Valkey
and Redis, the `cluster3` fixture).

The consumer reads a partition's keys on a connection of the slot's node (partition.PartitionIO
and its asyncio twin), not through redis-py's cluster client, so a read there meets the
migration's error replies itself: ASK while the slot is MIGRATING and the key already moved,
MOVED once it is handed over. An error reply is not data: a message policy `block` holds the
partition on must not be passed over as "deleted" because the read that looked for it was
answered ASK (it is the next message to handle, and it was never handled), and held messages
of a released key must come back, in key order, whatever reply their read met.

The slot is moved by hand here, one stage held as long as the test needs it: MIGRATING with the
stream alone on the target ("split": the partition's other keys still on the source), or every
key on the target before SETSLOT NODE ("moved").
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from redis.exceptions import TryAgainError

import redisq
import redisq.asyncio as rq
from redisq.consume.deadletter import release_key
from redisq.consume.partition_io import PartitionIO
from redisq.consume.partition_io_async import AsyncPartitionIO
from redisq.model.offsets import offset_parts
from tests.aio import aio
from tests.cluster.test_three_masters import (  # noqa: F401
    PARTITIONS,
    KeyOrder,
    broker,
    cluster3,
    hand_over,
    migrate_slot,
    node_id,
    owner_of,
    produce_keyed,
)
from tests.cluster.test_three_masters import TOPIC as KEYED_TOPIC
from tests.conftest import wait_until as wait_for
from tests.consume.test_consumer import run_in_thread
from tests.consume.test_parked_keys_and_lanes import PARK, Handled, park_key_k, partition, send
from tests.servers import ServerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

TOPIC = "blocking"
GROUP = "billing"
COUNT = 10
POISON = 3  # the message the handler fails on until it is healed


@contextmanager
def slot_held_mid_migration(
    broker: redisq.Broker, nodes: list[ServerProcess], stage: str
) -> Iterator[None]:
    """The slot of partition 0 MIGRATING to another master, the stream alone moved ("split"),
    every key moved ("moved") or none yet ("none"), for the body of the with; the slot is
    handed over after it."""
    stream = broker.keys.log(TOPIC, 0)
    slot = broker.client.keyslot(stream)
    source = owner_of(nodes, slot)
    target = next(n for n in nodes if n is not source)
    source_id, target_id = node_id(source), node_id(target)
    with source.client() as src, target.client() as dst:

        def migrate(keys: list[bytes | str]) -> None:
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "KEYS", *keys)

        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        if stage == "split":
            migrate([stream])
        elif stage == "moved":
            migrate(src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000))
        try:
            yield
        finally:
            rest = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if rest:
                migrate(rest)
    hand_over(nodes, slot, source, target)


class Flaky:
    """A handler failing on message POISON until healed; records every call and each message's
    first success, in order."""

    def __init__(self) -> None:
        self.healed = threading.Event()
        self.calls: list[int] = []
        self.succeeded: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, message: redisq.Message) -> None:
        index = int(message.value)
        with self.lock:
            self.calls.append(index)
        if index == POISON and not self.healed.is_set():
            raise RuntimeError("poison")
        with self.lock:
            if index not in self.succeeded:
                self.succeeded.append(index)


OPTIONS = {
    "failure_policy": "block",
    "max_attempts": 2,
    "retry_backoff_ms": 20,
    "max_retry_backoff_ms": 100,
    "lease_ttl_ms": 3000,
}


def setup_topic(broker: redisq.Broker) -> list[str]:
    broker.create_topic(TOPIC, partitions=1)
    with broker.producer() as producer:
        metas = [producer.send(TOPIC, b"%d" % i, key=b"k") for i in range(COUNT)]
    return [meta.offset for meta in metas]


def blocked_offset(broker: redisq.Broker) -> str | None:
    state = broker.client.hgetall(broker.keys.group_partition_state(TOPIC, 0, GROUP))
    value = state.get(b"blocked_offset")
    return value.decode() if value else None


def group_position(broker: redisq.Broker) -> str | None:
    for info in broker.client.xinfo_groups(broker.keys.log(TOPIC, 0)):
        if info["name"] in (GROUP, GROUP.encode()):
            last = info["last-delivered-id"]
            return last.decode() if isinstance(last, bytes) else str(last)
    return None


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def check_outcome(broker: redisq.Broker, handler: Flaky, offsets: list[str]) -> None:
    """Every message handled, first successes in offset (= key) order, the poison message
    among them; the group's position at the last offset and no lag."""
    assert handler.succeeded == list(range(COUNT)), (handler.succeeded, handler.calls)
    assert group_position(broker) == offsets[-1]
    description = broker.describe_group(TOPIC, GROUP)
    assert [p.lag for p in description.partitions] == [0]
    assert blocked_offset(broker) is None


@pytest.mark.parametrize("stage", ["split", "moved"])
def test_blocked_message_is_not_passed_over_mid_migration(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    stage: str,
) -> None:
    """Policy block holds the partition on message POISON; while it is retried the slot is
    caught mid-migration, so the worker's "was it deleted?" read (XRANGE of its offset) is
    answered ASK. The message stays blocked and is handled once the handler heals."""
    offsets = setup_topic(broker)
    handler = Flaky()
    consumer = broker.consumer(TOPIC, group=GROUP, **OPTIONS)  # type: ignore[arg-type]
    failures: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(handler)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_until(lambda: blocked_offset(broker) == offsets[POISON], 30, "the block")
        with slot_held_mid_migration(broker, cluster3, stage):
            calls = len(handler.calls)
            wait_until(lambda: len(handler.calls) >= calls + 3, 30, "retries mid-migration")
        handler.healed.set()
        wait_until(
            lambda: len(handler.succeeded) == COUNT and group_position(broker) == offsets[-1],
            30,
            f"every message handled and committed ({handler.succeeded}, {handler.calls})",
        )
    finally:
        consumer.close()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert not failures, failures
    check_outcome(broker, handler, offsets)


@pytest.mark.parametrize("stage", ["split", "moved"])
@aio
async def test_async_blocked_message_is_not_passed_over_mid_migration(
    broker: redisq.Broker, cluster3: list[ServerProcess], stage: str
) -> None:
    """test_blocked_message_is_not_passed_over_mid_migration with the asyncio consumer."""
    offsets = setup_topic(broker)
    handler = Flaky()

    async def handle(message: redisq.Message) -> None:
        handler(message)

    async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    url = f"redis://127.0.0.1:{cluster3[0].port}"
    async with await rq.connect(url, namespace=broker.namespace) as client:
        consumer = client.consumer(TOPIC, group=GROUP, **OPTIONS)  # type: ignore[arg-type]
        task = asyncio.ensure_future(consumer.run(handle))
        try:
            await until(lambda: blocked_offset(broker) == offsets[POISON], 30, "the block")
            with slot_held_mid_migration(broker, cluster3, stage):
                calls = len(handler.calls)
                await until(lambda: len(handler.calls) >= calls + 3, 30, "retries mid-migration")
            handler.healed.set()
            await until(
                lambda: len(handler.succeeded) == COUNT and group_position(broker) == offsets[-1],
                30,
                "every message handled and committed",
            )
        finally:
            await consumer.close()
            await asyncio.wait_for(task, 30)
        task.result()
    check_outcome(broker, handler, offsets)


# -- a whole migration under one member: no failure, no hand-over, nothing redelivered -----------

MIGRATED = 5


def migration_noise(records: list[logging.LogRecord]) -> list[str]:
    """What a member logged at WARNING or above (the handler never fails here)."""
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("entry_format", ["message", "batch"])
@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
def test_one_member_rides_out_a_slot_migration(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    mode: str,
    entry_format: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A single member (nothing to rebalance) consumes while the slot of one partition migrates
    with redisq's reads on that node meeting ASK, TRYAGAIN and MOVED: it follows them, so the
    migration makes no worker fail, no lease move and no message come twice; it logs nothing
    at WARNING or above."""
    caplog.set_level(logging.WARNING, logger="redisq")
    broker.create_topic(KEYED_TOPIC, partitions=PARTITIONS, entry_format=entry_format)
    sent = produce_keyed(broker, 6000, keys=300)
    slot = broker.client.keyslot(broker.keys.log(KEYED_TOPIC, MIGRATED))
    handler = KeyOrder(sleep_every=20)
    consumer = broker.consumer(KEYED_TOPIC, group="billing", mode=mode, batch_size=50)
    thread = threading.Thread(target=consumer.run, args=(handler,), kwargs={"idle_timeout": 4.0})
    thread.start()
    wait_until(lambda: handler.count >= 800, 60, "consumption to start")
    assert handler.count < len(sent), "consumed everything before the migration"
    source, _, moved = migrate_slot(cluster3, slot)
    thread.join(timeout=180)
    assert not thread.is_alive()
    assert moved >= 1
    redelivered = handler.check(sent)  # every message; first deliveries in key order
    assert redelivered == 0
    assert not migration_noise(caplog.records), migration_noise(caplog.records)
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


@pytest.mark.parametrize("entry_format", ["message", "batch"])
@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
@aio
async def test_async_one_member_rides_out_a_slot_migration(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    mode: str,
    entry_format: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """test_one_member_rides_out_a_slot_migration with the asyncio consumer."""
    caplog.set_level(logging.WARNING, logger="redisq")
    broker.create_topic(KEYED_TOPIC, partitions=PARTITIONS, entry_format=entry_format)
    sent = produce_keyed(broker, 6000, keys=300)
    slot = broker.client.keyslot(broker.keys.log(KEYED_TOPIC, MIGRATED))
    handler = KeyOrder(sleep_every=20)

    async def handle(message: redisq.Message) -> None:
        handler(message)

    url = f"redis://127.0.0.1:{cluster3[0].port}"
    async with await rq.connect(url, namespace=broker.namespace) as client:
        consumer = client.consumer(KEYED_TOPIC, group="billing", mode=mode, batch_size=50)
        task = asyncio.ensure_future(consumer.run(handle, idle_timeout=4.0))
        deadline = time.monotonic() + 60
        while handler.count < 800 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert 800 <= handler.count < len(sent), "migration not mid-stream"
        source, _, moved = await asyncio.to_thread(migrate_slot, cluster3, slot)
        await asyncio.wait_for(task, 180)
        task.result()
    assert moved >= 1
    redelivered = handler.check(sent)
    assert redelivered == 0
    assert not migration_noise(caplog.records), migration_noise(caplog.records)
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


# -- released held messages whose read fails -----------------------------------------------------


def test_released_messages_whose_read_fails_still_go_first(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Key K parked, K2 held behind it; K is released, and the read of K2 (XRANGE of its offset)
    is answered TRYAGAIN twice (a redirection still there when the exchange's budget ran out),
    while K3 comes in: K2 stays held and is handled before K3, which the member reads after
    the release (K no longer parked). Read as "no entry", K3 went first. The worker keeps the
    partition (no failure logged)."""
    park_key_k(broker)
    send(broker, (b"K2", b"K"))
    caplog.clear()  # the dead letter that parked K was logged at ERROR
    failures = {"left": 2}
    original = PartitionIO._exchange

    def flaky(self: PartitionIO, key: str, commands: list[Any], **options: Any) -> list[Any]:
        if commands[0][0] in ("XRANGE", "XREVRANGE") and failures["left"]:
            if failures["left"] == 2:
                send(broker, (b"K3", b"K"))  # after the release was seen, before K2 is read
            failures["left"] -= 1
            return [TryAgainError("Multiple keys request during rehashing of slot")] * len(commands)
        return original(self, key, commands, **options)

    monkeypatch.setattr(PartitionIO, "_exchange", flaky)
    handled = Handled()
    member = broker.consumer("orders", "g", **PARK)
    thread = run_in_thread(member, handled)
    try:
        wait_for(lambda: partition(broker).held == 1, what="K2 held")
        assert release_key(broker, "orders", "g", "K") == 1
        wait_for(lambda: len(handled.values) >= 2, what="K2 and K3 handled")
    finally:
        member.close()
        thread.join(30)
    assert failures["left"] == 0
    assert handled.values == [b"K2", b"K3"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@aio
async def test_async_released_messages_whose_read_fails_still_go_first(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """test_released_messages_whose_read_fails_still_go_first with the asyncio consumer."""
    park_key_k(broker)
    send(broker, (b"K2", b"K"))
    caplog.clear()
    failures = {"left": 2}
    original = AsyncPartitionIO._exchange

    async def flaky(
        self: AsyncPartitionIO, key: str, commands: list[Any], **options: Any
    ) -> list[Any]:
        if commands[0][0] in ("XRANGE", "XREVRANGE") and failures["left"]:
            if failures["left"] == 2:
                send(broker, (b"K3", b"K"))  # after the release was seen, before K2 is read
            failures["left"] -= 1
            return [TryAgainError("Multiple keys request during rehashing of slot")] * len(commands)
        return await original(self, key, commands, **options)

    monkeypatch.setattr(AsyncPartitionIO, "_exchange", flaky)
    values: list[bytes] = []

    async def handle(message: redisq.Message) -> None:
        values.append(message.value)

    async def until(predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    url = f"redis://127.0.0.1:{cluster3[0].port}"
    async with await rq.connect(url, namespace=broker.namespace) as client:
        member = client.consumer("orders", "g", **PARK)
        task = asyncio.ensure_future(member.run(handle))
        try:
            await until(lambda: partition(broker).held == 1, "K2 held")
            assert release_key(broker, "orders", "g", "K") == 1
            await until(lambda: len(values) >= 2, "K2 and K3 handled")
        finally:
            await member.close()
            await asyncio.wait_for(task, 30)
    assert failures["left"] == 0
    assert values == [b"K2", b"K3"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- a slot that stays MIGRATING for long, nothing moved yet ------------------------------------

LONG_COUNT = 5000


@pytest.mark.parametrize("api", ["thread", "asyncio"])
def test_commits_land_while_the_slot_stays_migrating(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    api: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A migration can hold a slot MIGRATING for long before its keys move (a large slot, a slow
    MIGRATE). The orderly owner's commits must land meanwhile. commit_position.lua used to
    declare the group's parked-keys and held-messages hashes, which usually do not exist, and the
    cluster answers TRYAGAIN to a script declaring a key its node does not hold while the slot
    migrates: no commit landed until the slot moved, and after 3 s of retries the member logged
    "commit failed" (a crash then would have redelivered all it handled since)."""
    broker.create_topic(TOPIC, partitions=1)
    with broker.producer() as producer:
        for i in range(LONG_COUNT):
            producer.send_async(TOPIC, b"%d" % i, key=b"k%d" % (i % 10))
    handled: list[int] = []
    options: dict[str, Any] = {"ack_interval_ms": 100, "lease_ttl_ms": 3000}

    def handle(message: redisq.Message) -> None:
        time.sleep(0.002)  # the run outlasts the migration
        handled.append(int(message.value))

    def run_thread_api() -> None:
        broker.consumer(TOPIC, group=GROUP, **options).run(handle, idle_timeout=2.0)

    def run_asyncio_api() -> None:
        async def main() -> None:
            url = f"redis://127.0.0.1:{cluster3[0].port}"
            async with await rq.connect(url, namespace=broker.namespace) as client:
                consumer = client.consumer(TOPIC, group=GROUP, **options)

                async def handle_async(message: redisq.Message) -> None:
                    await asyncio.sleep(0.002)
                    handled.append(int(message.value))

                await consumer.run(handle_async, idle_timeout=2.0)

        asyncio.run(main())

    caplog.set_level(logging.WARNING)
    caplog.clear()
    thread = threading.Thread(target=run_thread_api if api == "thread" else run_asyncio_api)
    thread.start()
    try:
        wait_until(lambda: group_position(broker) not in (None, "0-0"), 30, "a first commit")
        with slot_held_mid_migration(broker, cluster3, "none"):
            at_start, handled_at_start = group_position(broker), len(handled)
            time.sleep(4.0)  # longer than a member retries a redirection (3 s)
            during, handled_during = group_position(broker), len(handled) - handled_at_start
        assert handled_during > 0 and len(handled) < LONG_COUNT, "the run spans the migration"
        assert during is not None and at_start is not None
        assert offset_parts(during) > offset_parts(at_start), (
            f"no commit landed in 4 s of MIGRATING ({handled_during} messages handled)"
        )
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert sorted(handled) == list(range(LONG_COUNT))  # each once: no redelivery
    last = list(broker.read(TOPIC, 0))[-1]  # the last message's offset (in a batch entry too)
    assert group_position(broker) == last.offset
    assert migration_noise(caplog.records) == []


# -- a concurrent read whose commands meet the migration apart -----------------------------------

SPLIT_TOPIC = "split-read"


class MigrateOnLastOf:
    """A handler that puts the partition's slot MIGRATING (no key moved) when it handles the last
    message of the first batch entry, and records every message it handles."""

    def __init__(self, broker: redisq.Broker, nodes: list[ServerProcess], first: int) -> None:
        self.values: list[bytes] = []
        self.first = first
        self.slot = broker.client.keyslot(broker.keys.log(SPLIT_TOPIC, 0))
        self.source = owner_of(nodes, self.slot)
        self.target = next(n for n in nodes if n is not self.source)

    def __call__(self, message: redisq.Message) -> None:
        self.values.append(message.value)
        if len(self.values) == self.first:
            with self.source.client() as src, self.target.client() as dst:
                dst.execute_command(
                    "CLUSTER", "SETSLOT", self.slot, "IMPORTING", node_id(self.source)
                )
                src.execute_command(
                    "CLUSTER", "SETSLOT", self.slot, "MIGRATING", node_id(self.target)
                )

    def finish_migration(self, nodes: list[ServerProcess]) -> None:
        with self.source.client() as src:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 1000)
            if keys:
                src.execute_command(
                    "MIGRATE", "127.0.0.1", self.target.port, "", 0, 10_000, "KEYS", *keys
                )
        hand_over(nodes, self.slot, self.source, self.target)


def split_read_topic(broker: redisq.Broker) -> list[bytes]:
    """A topic of batch entries whose one partition holds two entries of ten messages each."""
    broker.create_topic(SPLIT_TOPIC, partitions=1, entry_format="batch")
    values = [b"m%d" % i for i in range(20)]
    with broker.producer(linger_ms=30_000) as producer:
        for half in (values[:10], values[10:]):
            for value in half:
                producer.send_async(SPLIT_TOPIC, value)
            producer.flush()
    return values


def test_a_read_whose_settled_bitmap_write_meets_ask_gives_what_it_read(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    """A concurrent member's read is one write of XACK, the settled bitmaps' HDEL and XREADGROUP;
    with the slot MIGRATING and the bitmap key not on the source, the HDEL meets ASK while the
    XREADGROUP ran there. Only the HDEL is sent again: the entry the read took is given (sent
    again whole, the XREADGROUP ran a second time and the first run's entry stayed pending,
    never handled while the member lived: claim_idle_ms is ten minutes here)."""
    values = split_read_topic(broker)
    handler = MigrateOnLastOf(broker, cluster3, first=10)
    consumer = broker.consumer(
        SPLIT_TOPIC, group=GROUP, mode="concurrent", batch_size=1, claim_idle_ms=600_000
    )
    try:
        thread = run_in_thread(consumer, handler, idle_timeout=3.0)
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        handler.finish_migration(cluster3)
    assert handler.values == values


@aio
async def test_async_a_read_whose_settled_bitmap_write_meets_ask_gives_what_it_read(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    """test_a_read_whose_settled_bitmap_write_meets_ask_gives_what_it_read, asyncio consumer."""
    values = split_read_topic(broker)
    handler = MigrateOnLastOf(broker, cluster3, first=10)

    async def handle(message: redisq.Message) -> None:
        await asyncio.to_thread(handler, message)

    url = f"redis://127.0.0.1:{cluster3[0].port}"
    try:
        async with await rq.connect(url, namespace=broker.namespace) as client:
            consumer = client.consumer(
                SPLIT_TOPIC, group=GROUP, mode="concurrent", batch_size=1, claim_idle_ms=600_000
            )
            await asyncio.wait_for(consumer.run(handle, idle_timeout=3.0), 60)
    finally:
        handler.finish_migration(cluster3)
    assert handler.values == values
