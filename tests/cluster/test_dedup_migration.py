# ruff: noqa: F811  (the broker and cluster3 fixtures come from tests.cluster.test_three_masters)
"""Message-id dedup when the dedup ring turns to a new time slice while the partition's slot is
MIGRATING, on a three-master cluster of Valkey and of Redis 7.0 (`cluster3`), through the thread
API and the asyncio API.

The ring (lua/includes/dedup.lua) empties the bucket of slice s - 2 when slice s begins. While
the slot migrates, a key a script deleted is no longer local to it, and writing it again fails
mid-script. The send here is the first of slice s + 2, its bucket still holds slice s, and the
slot is MIGRATING with every key still on the old owner: so the script runs there and has to
empty that bucket. What a user checks: the send is acknowledged (no error for a migration), its
message is stored once, and a resend with the same message id after the move is answered as a
duplicate at the original offset and stores nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from tests.cluster.test_three_masters import broker, cluster3, migrate_slot, owner_of  # noqa: F401
from tests.servers import ServerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

TOPIC = "dedupmig"
WINDOW_MS = 1000  # the smallest window: slices of one second


def server_ms(node: ServerProcess) -> int:
    with node.client() as client:
        seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_for_next_slice(node: ServerProcess) -> int:
    """Sleep until 30 ms into the next dedup slice by the server's clock; that slice's number."""
    now = server_ms(node)
    slice_no = now // WINDOW_MS + 1
    time.sleep((slice_no * WINDOW_MS + 30 - now) / 1000)
    assert server_ms(node) // WINDOW_MS == slice_no
    return slice_no


def error_count(node: ServerProcess) -> int:
    """Error replies the node has sent so far (INFO errorstats: TRYAGAIN, ERR, ...)."""
    with node.client() as client:
        stats = client.info("errorstats")
    return sum(int(v["count"]) for v in stats.values())


class Send:
    """One API's message-id send, as blocking calls: send(value, message_id) -> metadata, and
    start(value, message_id) -> a wait(timeout) for the result (or its exception)."""

    send: Callable[[bytes, str], redisq.RecordMetadata]
    start: Callable[[bytes, str], Callable[[float], redisq.RecordMetadata]]


def run_scenario(
    broker: redisq.Broker, cluster3: list[ServerProcess], send: Send, done: Callable[[], bool]
) -> None:
    slot = broker.client.keyslot(broker.keys.log(TOPIC, 0))
    source = owner_of(cluster3, slot)
    first = send.send(b"v0", "id-0")  # slice s, bucket s % 2
    slice_no = wait_for_next_slice(source)
    second = send.send(b"v1", "id-1")  # slice s + 1, the other bucket
    assert wait_for_next_slice(source) == slice_no + 1  # slice s + 2: the first bucket is stale
    buckets = [broker.keys.dedup_bucket(TOPIC, 0, n) for n in (0, 1)]
    with source.client() as client:
        assert client.exists(*buckets) == 2  # both still there: the script will empty one

    errors_before = error_count(source)
    refused = threading.Event()
    waiting: list[Callable[[float], redisq.RecordMetadata]] = []

    def on_migrating() -> None:
        # Every key is still on the old owner: the send runs its script there. The keys move
        # only once it has been answered with an error (or, wrongly, acknowledged).
        waiting.append(send.start(b"v2", "id-2"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and error_count(source) == errors_before and not done():
            time.sleep(0.005)
        refused.set()

    migration_done: list[Any] = []
    thread = threading.Thread(
        target=lambda: migration_done.append(
            migrate_slot(cluster3, slot, pause_s=0.3, on_migrating=on_migrating)
        ),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and migration_done, "the migration did not finish"
    assert refused.is_set()
    third = waiting[0](60)
    assert not third.duplicate
    broker.client.nodes_manager.initialize()
    target = migration_done[0][1]
    assert broker.describe_topic(TOPIC).partitions[0].node == f"127.0.0.1:{target.port}"

    again = send.send(b"v2", "id-2")
    assert again.duplicate and again.offset == third.offset
    stored = list(broker.read(TOPIC, 0))
    assert [m.value for m in stored] == [b"v0", b"v1", b"v2"]
    assert [m.offset for m in stored] == [first.offset, second.offset, third.offset]


def test_dedup_slice_turns_while_slot_migrates(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    broker.create_topic(TOPIC, partitions=1, dedup_window_ms=WINDOW_MS)
    futures: list[redisq.SendFuture] = []
    with broker.producer(idempotence="message_id", delivery_timeout_ms=60_000) as producer:
        send = Send()
        send.send = lambda v, m: producer.send(TOPIC, v, message_id=m, partition=0, timeout=30)

        def start(value: bytes, message_id: str) -> Callable[[float], redisq.RecordMetadata]:
            future = producer.send_async(TOPIC, value, message_id=message_id, partition=0)
            futures.append(future)
            return lambda timeout: future.result(timeout=timeout)

        send.start = start
        run_scenario(broker, cluster3, send, done=lambda: bool(futures) and futures[0].done())


def test_async_dedup_slice_turns_while_slot_migrates(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    """The same through redisq.asyncio: its producer runs on an event loop in a thread; the
    scenario's blocking calls submit to that loop."""
    broker.create_topic(TOPIC, partitions=1, dedup_window_ms=WINDOW_MS)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = f"redis://127.0.0.1:{cluster3[0].port}"

    async def open_producer() -> tuple[Any, Any]:
        client = await rq.connect(url, namespace=broker.namespace)
        producer = client.producer(idempotence="message_id", delivery_timeout_ms=60_000)
        await producer.__aenter__()
        return client, producer

    client, producer = asyncio.run_coroutine_threadsafe(open_producer(), loop).result(30)
    started: list[Any] = []

    def send_now(value: bytes, message_id: str) -> redisq.RecordMetadata:
        coroutine = producer.send(TOPIC, value, message_id=message_id, partition=0, timeout=30)
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(40)

    def start(value: bytes, message_id: str) -> Callable[[float], redisq.RecordMetadata]:
        coroutine = producer.send(TOPIC, value, message_id=message_id, partition=0, timeout=60)
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        started.append(future)
        return lambda timeout: future.result(timeout)

    send = Send()
    send.send = send_now
    send.start = start
    try:
        run_scenario(broker, cluster3, send, done=lambda: bool(started) and started[0].done())
    finally:

        async def close() -> None:
            await producer.__aexit__(None, None, None)
            await client.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
