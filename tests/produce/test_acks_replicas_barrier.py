"""acks="replicas" never confirms what the replica did not get: the barrier write before WAIT.

WAIT (and WAITAOF) confirm the connection's own last write. A retried batch that was already
stored is answered as a duplicate and writes nothing; after a reconnect its connection has written
nothing at all, and a bare WAIT would answer at once, counting a replica that is connected but
silent. What is asserted, with the replica SIGSTOPped the whole time (connected, silent):
- a plain or delayed send whose connection is killed while it waits for WAIT is never
  acknowledged (both APIs); the control without the kill fails the same way;
- a transaction's commit whose slot starts migrating while commit() confirms it is not confirmed
  on the importing node (Redis 7.0 cluster: its SETSLOT does not wait for the replica);
- commit() after CommitNotConfirmed tries the confirmation again and returns once the replica is
  back, the transaction stored once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

import redisq
import redisq.asyncio
from tests.history.deployments import (
    node_id,
    partition_away_from_registry,
    running_cluster_with_replicas,
)
from tests.replication import in_sync, wait_for
from tests.servers import (
    ServerProcess,
    redis_binary,
)

pytestmark = pytest.mark.fault

TOPIC = "orders"


def kill_clients(primary: ServerProcess) -> None:
    with primary.client() as admin:
        admin.client_kill_filter(_type="normal", skipme=True)


OPTIONS = {"acks": "replicas", "ack_timeout_ms": 300, "delivery_timeout_ms": 6000}


@pytest.mark.parametrize("api", ["sync", "asyncio"])
@pytest.mark.parametrize("kill", [True, False], ids=["reconnect", "control"])
@pytest.mark.parametrize("delay_ms", [60_000, None], ids=["delayed", "plain"])
def test_a_silent_replica_never_acknowledges(
    pair: tuple[ServerProcess, ServerProcess], delay_ms: int | None, kill: bool, api: str
) -> None:
    primary, replica = pair
    namespace = f"t{uuid.uuid4().hex[:6]}"
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=1)
    if api == "sync":
        with redisq.connect(primary.url, namespace=namespace) as broker:
            with broker.producer(**OPTIONS) as producer:
                producer.send(TOPIC, b"warm-up", partition=0, delay_ms=delay_ms)
                replica.kill(signal.SIGSTOP)
                future = producer.send_async(TOPIC, b"m", partition=0, delay_ms=delay_ms)
                time.sleep(1.0)  # written, WAIT answered 0 at least once
                if kill:
                    kill_clients(primary)
                error = future.exception(timeout=30)
    else:

        async def main() -> BaseException | None:
            async with await redisq.asyncio.connect(primary.url, namespace=namespace) as broker:
                async with broker.producer(**OPTIONS) as producer:
                    await producer.send(TOPIC, b"warm-up", partition=0, delay_ms=delay_ms)
                    replica.kill(signal.SIGSTOP)
                    future = producer.send_async(TOPIC, b"m", partition=0, delay_ms=delay_ms)
                    await asyncio.sleep(1.0)
                    if kill:
                        await asyncio.to_thread(kill_clients, primary)
                    await asyncio.wait({future}, timeout=30)
                    return future.exception()

        error = asyncio.run(main())
    assert isinstance(error, redisq.DeliveryTimeout), f"acknowledged with a silent replica: {error}"
    assert "NotEnoughReplicas" in str(error)


def test_commit_again_after_commit_not_confirmed(pair: tuple[ServerProcess, ServerProcess]) -> None:
    primary, replica = pair
    namespace = f"t{uuid.uuid4().hex[:6]}"
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=1)
        options = {**OPTIONS, "delivery_timeout_ms": 1500}
        with broker.producer(name="svc", transactional=True, **options) as producer:
            replica.kill(signal.SIGSTOP)
            transaction = producer.transaction()
            transaction.send(TOPIC, b"x", partition=0)
            with pytest.raises(redisq.CommitNotConfirmed) as caught:
                transaction.commit()
            assert caught.value.transaction_id == transaction.transaction_id
            assert not caught.value.retriable and "is committed on the primary" in str(caught.value)
            assert transaction.state == "committed"
            with pytest.raises(redisq.CommitNotConfirmed):
                transaction.commit()  # still silent
            replica.kill(signal.SIGCONT)
            records = transaction.commit()  # confirmed now
            assert [r.partition for r in records] == [0]
        assert [m.value for m in broker.read(TOPIC, 0)] == [b"x"]
    wait_for(lambda: in_sync(primary, replica), what="the replica to catch up")


# -- a barrier asked away to an importing node ----------------------------------------------------


@pytest.fixture
def redis_cluster_with_replicas() -> Iterator[tuple[list[ServerProcess], list[ServerProcess]]]:
    """Three Redis 7.0 primaries with a replica each (Redis 7.0's SETSLOT waits for no replica;
    Valkey's does, which closes this window while a replica is stopped)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH")
    with running_cluster_with_replicas(binary) as nodes:
        yield nodes


@pytest.mark.cluster
def test_a_commit_is_not_confirmed_on_the_node_its_slot_is_moving_to(
    redis_cluster_with_replicas: tuple[list[ServerProcess], list[ServerProcess]],
) -> None:
    primaries, replicas = redis_cluster_with_replicas
    namespace = f"t{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{primaries[0].port}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=12)
        source, partition = partition_away_from_registry(broker, TOPIC, primaries)
        target = next(p for p in primaries if p is not source)
        slot = broker.client.keyslot(broker.keys.log(TOPIC, partition))
        replica = replicas[primaries.index(source)]

        def reshard() -> None:  # an operator starts moving the slot while commit() confirms
            time.sleep(1.0)
            with target.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
            with source.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))

        replica.kill(signal.SIGSTOP)  # still "online" on the source: acknowledges nothing
        try:
            options = {**OPTIONS, "ack_timeout_ms": 200}
            with broker.producer(name="svc", transactional=True, **options) as producer:
                transaction = producer.transaction()
                transaction.send(TOPIC, b"x", partition=partition)
                threading.Thread(target=reshard, daemon=True).start()
                with pytest.raises(redisq.CommitNotConfirmed):
                    transaction.commit()
        finally:
            replica.kill(signal.SIGCONT)
        with source.client() as client:
            assert client.exists(broker.keys.log(TOPIC, partition))  # the data stayed there
