# ruff: noqa: F811  (the broker and cluster3 fixtures come from tests.cluster.test_three_masters)
"""The asyncio API (redisq.asyncio) under a live slot migration on a three-master cluster.

tests/cluster/test_three_masters.py proves the thread API while the slot of one partition moves
between masters (SETSLOT IMPORTING/MIGRATING, MIGRATE ... KEYS in two halves, SETSLOT NODE);
these run the same migration under the asyncio producer and the asyncio consumer groups, on
Valkey and on Redis (the `cluster3` fixture), and check what a user would: every acknowledged
send stored once at the offset its future answered, per-key order, no future left pending and no
error for a migration; every message handled, one handler per partition at a time, the group's
position at the end. The migration runs in a thread (asyncio.to_thread) while the event loop works.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
import redisq.server.transport_async as async_transport
from tests.aio import aio
from tests.cluster.test_three_masters import (  # noqa: F401
    PARTITIONS,
    TOPIC,
    KeyOrder,
    Sent,
    broker,
    check_exactly_once,
    cluster3,
    migrate_slot,
    node_id,
    owner_of,
    produce_keyed,
)
from tests.servers import ServerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

MIGRATED = 5  # the partition whose slot moves


def url_of(nodes: list[ServerProcess]) -> str:
    return f"redis://127.0.0.1:{nodes[0].port}"


def count_replies(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Error replies the asyncio producer's wire met (ASK, MOVED, TRYAGAIN, ...), by code."""
    seen: Counter[str] = Counter()
    original = async_transport.restore_error_code

    def counting(exc: redis.ResponseError) -> None:
        original(exc)
        seen[str(exc).split(" ", 1)[0]] += 1

    monkeypatch.setattr(async_transport, "restore_error_code", counting)
    return seen


def wait_in_thread(predicate: Callable[[], bool], timeout: float) -> bool:
    """From the migration's thread: poll until predicate holds; False at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# -- producing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
@aio
async def test_async_producer_during_slot_migration(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    idempotence: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many send_async futures in flight while the slot of one partition migrates: each
    acknowledged message is stored once at the offset its future answered, per-key send order
    holds, every future ends with a result (no error for a migration). With sequences, messages
    of the migrating partition are acknowledged while only ASK reaches its keys (before the
    handover); message_id's script names dedup buckets that may not exist yet, which an
    importing node refuses (TRYAGAIN) until the handover: that partition waits, nothing fails."""
    seen = count_replies(monkeypatch)
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, MIGRATED))
    keys = [b"key-%d" % k for k in range(600)]
    hot = [k for k in keys if redisq.partition_for_key(k, PARTITIONS) == MIGRATED]
    sent: Sent = []
    acked_at: dict[bytes, float] = {}  # hot values -> when their future was answered
    stop = asyncio.Event()
    started = asyncio.Event()
    in_ask_window: dict[str, bool] = {}

    def note(value: bytes, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            acked_at[value] = time.monotonic()

    async def produce(producer: rq.Producer) -> None:
        rng = random.Random(11)
        i = 0
        while not stop.is_set() or i < 4000:
            key = rng.choice(hot) if i % 2 else rng.choice(keys)
            value = b"%s:%d" % (key, i)
            future = producer.send_async(TOPIC, value, key=key)
            if key in hot:
                future.add_done_callback(lambda f, v=value: note(v, f))
            sent.append((key, value, future))
            i += 1
            if i == 2000:
                started.set()
            if i % 100 == 0:
                await asyncio.sleep(0.01)  # keep the run spread over the migration
            while sum(not f.done() for _, _, f in sent[-3000:]) > 2000:
                await asyncio.sleep(0.01)  # bounded in flight while the partition waits

    def hook(stage: str) -> None:
        if idempotence == "message_id":  # its script names dedup buckets that may not exist
            return  # yet: the importing node answers TRYAGAIN until the handover
        since = time.monotonic()  # an acknowledgement after this came through the new state
        in_ask_window[stage] = wait_in_thread(
            lambda: any(t > since for t in list(acked_at.values())), timeout=10
        )

    async with await rq.connect(url_of(cluster3), namespace=broker.namespace) as client:
        async with client.producer(
            idempotence=idempotence, max_batch_messages=50, delivery_timeout_ms=90_000
        ) as producer:
            task = asyncio.ensure_future(produce(producer))
            await asyncio.wait_for(started.wait(), 60)
            source, target, moved = await asyncio.to_thread(migrate_slot, cluster3, slot, 0.3, hook)
            await asyncio.sleep(0.5)  # more traffic after the handover (MOVED)
            stop.set()
            await asyncio.wait_for(task, 60)
            await producer.flush(timeout=120)
    pending = [value for _, value, future in sent if not future.done()]
    assert not pending, f"{len(pending)} futures left pending, e.g. {pending[:3]}"
    failed = [(v, f.exception()) for _, v, f in sent if f.exception() is not None]
    assert not failed, f"{len(failed)} sends failed, e.g. {failed[:3]}"
    assert moved >= 2
    broker.client.nodes_manager.initialize()  # the checking client's slot map is from before
    assert broker.describe_topic(TOPIC).partitions[MIGRATED].node == f"127.0.0.1:{target.port}"
    assert check_exactly_once(broker, sent) == len(sent) >= 4000
    print(f"asyncio producer, replies met during the migration: {dict(seen)}, {in_ask_window}")
    if idempotence == "sequence":
        assert seen["ASK"] > 0, f"the producer never met ASK: {dict(seen)}"
        assert in_ask_window.get("moved"), "nothing of the partition acknowledged through ASK"
    else:  # ASK only while none of the script's keys is left on the source: a matter of timing
        met = seen["ASK"] + seen["TRYAGAIN"]
        assert met > 0, f"the producer never met the migration: {dict(seen)}"
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


# -- consuming -----------------------------------------------------------------------------------


class Timed:
    """An async handler: KeyOrder's record, and each call's (start, end) per partition, with a
    suspension point inside so that two handlers of one partition would overlap."""

    def __init__(self, order: KeyOrder, sleep_s: float) -> None:
        self.order = order
        self.sleep_s = sleep_s
        self.spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self.by_partition: Counter[int] = Counter()

    async def __call__(self, message: redisq.Message) -> None:
        start = time.monotonic()
        await asyncio.sleep(self.sleep_s)
        self.order(message)
        self.by_partition[message.partition] += 1
        self.spans[message.partition].append((start, time.monotonic()))

    def overlaps(self) -> list[tuple[int, tuple[float, float], tuple[float, float]]]:
        found = []
        for p, spans in self.spans.items():
            ordered = sorted(spans)
            for before, after in zip(ordered, ordered[1:], strict=False):
                if after[0] < before[1]:
                    found.append((p, before, after))
        return found


def group_position_at_end(sync: redisq.Broker, group: str) -> list[int]:
    """The partitions the group has not read to the end (describe_group's lag, in messages on
    either format: a concurrent group's last-delivered-id on a batch topic is the last entry's
    ID, not the stream's last-generated-id, which is the entry's last message)."""
    return [p.partition for p in sync.describe_group(TOPIC, group).partitions if p.lag != 0]


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
@aio
async def test_async_group_during_slot_migration(
    broker: redisq.Broker, cluster3: list[ServerProcess], mode: str
) -> None:
    """Two asyncio members consume while the slot of a partition (its stream, lease, fencing
    counter, group state: one hash tag) migrates: every message is handled at least once,
    nothing is left pending and the group's position ends at the end of every partition;
    orderly: first deliveries in per-key send order and never two handlers of one partition at
    once."""
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    sent = produce_keyed(broker, 6000, keys=300)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, MIGRATED))
    assert broker.client.keyslot(broker.keys.lease(TOPIC, MIGRATED, "billing")) == slot
    total = broker.describe_topic(TOPIC).partitions[MIGRATED].messages
    handler = Timed(KeyOrder(), sleep_s=0.004)  # slow enough that the migration lands mid-stream
    async with await rq.connect(url_of(cluster3), namespace=broker.namespace) as client:
        consumers = [
            client.consumer(
                TOPIC, group="billing", name=f"m{i}", mode=mode, lease_ttl_ms=3000, batch_size=50
            )
            for i in range(2)
        ]
        tasks = [asyncio.ensure_future(c.run(handler, idle_timeout=4.0)) for c in consumers]
        deadline = time.monotonic() + 60
        while handler.by_partition[MIGRATED] < 100 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert 100 <= handler.by_partition[MIGRATED] < total, "migration not mid-stream"
        source, target, moved = await asyncio.to_thread(migrate_slot, cluster3, slot)
        done, _ = await asyncio.wait(tasks, timeout=90)
        assert len(done) == len(tasks), "run() did not end"
        for task in tasks:
            task.result()  # run() raised nothing
        for consumer in consumers:
            await consumer.close()
    assert moved >= 3  # stream, lease, fencing counter, ...
    if mode == "orderly":
        redelivered = handler.order.check(sent)  # every message, first deliveries in key order
        assert not handler.overlaps(), handler.overlaps()[:3]
    else:
        handled = {i for indexes in handler.order.handled.values() for i in indexes}
        assert handled == set(range(len(sent)))
        redelivered = handler.order.count - len(sent)
        assert sum(int(g["pending"]) for p in range(PARTITIONS) for g in broker.client.xinfo_groups(
            broker.keys.log(TOPIC, p))) == 0  # fmt: skip
    assert not group_position_at_end(broker, "billing")
    print(f"asyncio {mode} group, slot migration: {redelivered} redeliveries")
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


# -- a named producer restarting while its partition's slot migrates -----------------------------


@aio
async def test_named_producer_starts_while_slot_migrates(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    """A new instance of a named producer fences its older one on every partition at start; one
    partition's slot is MIGRATING (its keys still on the source): the fence there succeeds and
    the new instance sends, instead of failing on a key the script deleted and could not write
    again ("non local key" mid-script, with the old state already gone)."""
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, MIGRATED))
    source = owner_of(cluster3, slot)
    target = next(n for n in cluster3 if n is not source)
    async with await rq.connect(url_of(cluster3), namespace=broker.namespace) as client:
        async with client.producer(name="svc") as old:
            await old.send(TOPIC, b"before", partition=MIGRATED, timeout=30)
        with source.client() as src, target.client() as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))
        try:
            async with client.producer(name="svc") as new:
                meta = await new.send(TOPIC, b"during", partition=MIGRATED, timeout=30)
        finally:
            await asyncio.to_thread(migrate_slot, cluster3, slot)
    assert meta.partition == MIGRATED
    assert [m.value for m in broker.read(TOPIC, MIGRATED)] == [b"before", b"during"]
