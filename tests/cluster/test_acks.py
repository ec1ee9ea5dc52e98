"""acks="fsync" and "replicas" on Redis Cluster, for plain and delayed sends, both APIs.

What is asserted (what a user checks):
- acks="fsync" on a cluster whose primaries run with appendonly yes: every acknowledged message is
  stored; with one primary's AOF switched off afterwards, the sends of that primary's partitions
  fail with DeliveryTimeout (WAITAOF refused there) while the other primaries' partitions are
  acknowledged in the same rounds: WAITAOF goes to each primary after its own writes.
- A cluster with a primary without AOF, or of Redis 7.0 (no WAITAOF), refuses acks="fsync" when the
  producer starts, naming the node, before anything is written.
- Delayed sends with acks="replicas" on a cluster with one replica per primary: once acknowledged,
  each replica holds its primary's scheduled messages; with one replica down, the delayed sends of
  its primary's partitions fail with NotEnoughReplicas and the others are acknowledged.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import redisq
import redisq.asyncio
from tests.cluster.test_three_masters import cluster_with_replicas  # noqa: F401 - a fixture
from tests.replication import wait_for
from tests.servers import ServerProcess, redis_binary, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.fault]

TOPIC = "orders"
PARTITIONS = 12
API = pytest.mark.parametrize("api", ["sync", "asyncio"])


def set_aof(node: ServerProcess, on: bool) -> None:
    with node.client() as client:
        client.config_set("appendonly", "yes" if on else "no")

    def settled() -> bool:
        with node.client() as client:
            info = client.info("persistence")
        return bool(info["aof_enabled"]) == on and not info["aof_rewrite_in_progress"]

    wait_for(settled, what=f"appendonly {on} on {node.port}")


@pytest.fixture
def aof_cluster() -> Iterator[list[ServerProcess]]:
    """Three Valkey primaries with appendonly yes."""
    nodes = start_cluster(None, masters=3)
    try:
        for node in nodes:
            set_aof(node, True)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def partitions_on(broker: redisq.Broker, node: ServerProcess) -> set[int]:
    return {
        p.partition
        for p in broker.describe_topic(TOPIC).partitions
        if p.node == f"127.0.0.1:{node.port}"
    }


def keys_of(broker: redisq.Broker, node: ServerProcess) -> int:
    with node.client() as client:
        return sum(1 for _ in client.scan_iter(match=broker.keys.pattern(), count=1000))


Outcomes = dict[int, BaseException | None]


def two_rounds(
    url: str,
    namespace: str,
    api: str,
    between: Callable[[], None],
    *,
    delay_ms: int | None = None,
    **options: Any,
) -> tuple[Outcomes, Outcomes]:
    """One producer sends one message per partition, all queued before any is acknowledged (so
    rounds hold several nodes' batches); then between() runs and it sends one more per
    partition. Each round's outcome per partition (None: acknowledged)."""

    def queue(producer: Any, n: int) -> dict[int, Any]:
        return {
            p: producer.send_async(TOPIC, b"m%d-%d" % (n, p), partition=p, delay_ms=delay_ms)
            for p in range(PARTITIONS)
        }

    if api == "sync":
        with redisq.connect(url, namespace=namespace) as broker:
            with broker.producer(**options) as producer:
                first = {p: f.exception(timeout=60) for p, f in queue(producer, 0).items()}
                between()
                second = {p: f.exception(timeout=60) for p, f in queue(producer, 1).items()}
                return first, second

    async def outcomes(futures: dict[int, Any]) -> Outcomes:
        await asyncio.wait(futures.values(), timeout=60)
        return {p: f.exception() for p, f in futures.items()}

    async def main() -> tuple[Outcomes, Outcomes]:
        async with await redisq.asyncio.connect(url, namespace=namespace) as broker:
            async with broker.producer(**options) as producer:
                first = await outcomes(queue(producer, 0))
                await asyncio.to_thread(between)
                return first, await outcomes(queue(producer, 1))

    return asyncio.run(main())


def stored(broker: redisq.Broker) -> list[bytes]:
    return [m.value for p in range(PARTITIONS) for m in broker.read(TOPIC, p)]


# -- acks="fsync" -------------------------------------------------------------------------------


@API
def test_acks_fsync_on_cluster_waits_on_each_primary(
    aof_cluster: list[ServerProcess], api: str
) -> None:
    namespace = f"f{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{aof_cluster[0].port}"
    off = aof_cluster[0]
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        down = partitions_on(broker, off)
        assert down and len(down) < PARTITIONS
        first, second = two_rounds(
            url, namespace, api, lambda: set_aof(off, False),  # after the start-up check
            acks="fsync", ack_timeout_ms=500, delivery_timeout_ms=4000, linger_ms=50,
        )  # fmt: skip
        assert first == {p: None for p in range(PARTITIONS)}
        failed = {p for p, exc in second.items() if exc is not None}
        assert failed == down, second
        for p in down:
            assert isinstance(second[p], redisq.DeliveryTimeout)
            assert "appendonly" in str(second[p]), second[p]
        # What failed was written (the outcome unknown to the caller), and only once.
        values = stored(broker)
        assert sorted(values) == sorted(b"m%d-%d" % (n, p) for n in (0, 1) for p in range(12))


@API
def test_acks_fsync_refused_when_a_primary_has_no_aof(
    aof_cluster: list[ServerProcess], api: str
) -> None:
    namespace = f"f{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{aof_cluster[0].port}"
    set_aof(aof_cluster[1], False)
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        before = [keys_of(broker, node) for node in aof_cluster]
        with pytest.raises(redisq.UnsupportedServer, match="appendonly") as info:
            if api == "sync":
                broker.producer(acks="fsync")
            else:

                async def start() -> None:
                    async with await redisq.asyncio.connect(url, namespace=namespace) as abroker:
                        await abroker.producer(acks="fsync").start()

                asyncio.run(start())
        assert f"node 127.0.0.1:{aof_cluster[1].port}" in str(info.value)
        assert f"127.0.0.1:{aof_cluster[0].port}" not in str(info.value)
        assert [keys_of(broker, node) for node in aof_cluster] == before


def test_acks_fsync_on_a_redis_70_cluster_is_refused() -> None:
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH")
    nodes = start_cluster(binary, masters=3)
    try:
        with nodes[0].client() as client:
            if "7.0" not in str(client.info("server")["redis_version"])[:3]:
                pytest.skip("this redis-server has WAITAOF")
        url = f"redis://127.0.0.1:{nodes[0].port}"
        with redisq.connect(url, namespace=f"f{uuid.uuid4().hex[:8]}") as broker:
            with pytest.raises(redisq.UnsupportedServer, match=r"WAITAOF \(Redis >= 7.2"):
                broker.producer(acks="fsync")
    finally:
        for node in nodes:
            node.stop()


# -- delayed sends with acks="replicas" ---------------------------------------------------------


def scheduled_on(node: ServerProcess, key: str, *, replica: bool) -> int:
    with node.client(single_connection_client=True) as client:
        if replica:
            client.execute_command("READONLY")
        return int(client.zcard(key))


@API
def test_delayed_acks_replicas_on_cluster(
    cluster_with_replicas: tuple[list[ServerProcess], list[ServerProcess]],  # noqa: F811
    api: str,
) -> None:
    primaries, replicas = cluster_with_replicas
    namespace = f"r{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{primaries[0].port}"
    by_port = {p.port: r for p, r in zip(primaries, replicas, strict=True)}
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        down = partitions_on(broker, primaries[0])
        assert down and len(down) < PARTITIONS
        held: dict[int, int] = {}

        def replica_down() -> None:
            # WAIT went to each primary after its own writes: every replica holds its share.
            for info in broker.describe_topic(TOPIC).partitions:
                replica = by_port[int(str(info.node).rsplit(":", 1)[1])]
                key = broker.keys.scheduled(TOPIC, info.partition)
                held[info.partition] = scheduled_on(replica, key, replica=True)
            replicas[0].kill()
            wait_for(
                lambda: primaries[0].client().info("replication")["connected_slaves"] == 0,
                what="the primary to notice",
            )

        started = time.monotonic()
        first, second = two_rounds(
            url, namespace, api, replica_down, delay_ms=600_000,
            acks="replicas", ack_timeout_ms=500, delivery_timeout_ms=4000, linger_ms=50,
        )  # fmt: skip
        assert first == {p: None for p in range(PARTITIONS)}
        assert held == {p: 1 for p in range(PARTITIONS)}
        failed = {p for p, exc in second.items() if exc is not None}
        assert failed == down, second
        for p in down:
            assert isinstance(second[p], redisq.DeliveryTimeout)
            assert "NotEnoughReplicas" in str(second[p]), second[p]
        assert time.monotonic() - started < 40
        # Written on the primary, never acknowledged: stored once however often it was re-sent.
        for info in broker.describe_topic(TOPIC).partitions:
            assert info.scheduled == 2, info
