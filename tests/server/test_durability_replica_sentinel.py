"""Durability levels with a real replica (REPLICAOF) and a Sentinel.

What is asserted:
- acks="replicas": once send()/flush() return, the replica already holds every message (WAIT
  min_replicas answered). With the replica down, WAIT answers 0 after ack_timeout_ms: the batch
  is written on the primary but never acknowledged; the producer keeps re-sending it (answered as
  a duplicate, so it is stored once) until delivery_timeout_ms, then fails it with
  DeliveryTimeout naming NotEnoughReplicas. Once the replica is back, sends succeed again.
- acks="fsync": WAITAOF on Valkey with appendonly yes; UnsupportedServer on Redis 7.0 (no
  WAITAOF) and on a server without AOF.
- Failover (SENTINEL FAILOVER while producing through a redis+sentinel:// url): the number of
  ACKNOWLEDGED messages missing on the new primary, under acks="leader" and acks="replicas".
  Printed (pytest -s) for the README; asserted: zero under "replicas".
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter

import pytest

import redisq
import redisq.asyncio
from redisq.produce.futures import SendFuture
from tests.replication import SERVICE, SentinelProcess, in_sync, start_replica, wait_for
from tests.servers import ServerProcess, binary_for, valkey_binary

TOPIC = "orders"
PARTITIONS = 4


def server_version(server: ServerProcess) -> tuple[int, ...]:
    with server.client() as client:
        info = client.info("server")
    version = str(info.get("valkey_version") or info["redis_version"])
    return tuple(int(x) for x in version.split("."))


@pytest.fixture
def namespace() -> str:
    return f"d{uuid.uuid4().hex[:10]}"


def stored_values(url: str, namespace: str) -> list[bytes]:
    with redisq.connect(url, namespace=namespace) as reader:
        return [m.value for p in range(PARTITIONS) for m in reader.read(TOPIC, p)]


def test_acks_replicas_waits_for_the_replica(
    pair: tuple[ServerProcess, ServerProcess], namespace: str
) -> None:
    primary, replica = pair
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        with broker.producer(acks="replicas", max_batch_messages=100) as producer:
            futures = [
                producer.send_async(TOPIC, b"m%d" % i, key=b"k%d" % (i % 50)) for i in range(5000)
            ]
            producer.flush(timeout=60)
            assert all(f.exception(timeout=0) is None for f in futures)
            # WAIT answered for every round: the replica holds them all, right now.
            assert sorted(stored_values(replica.url, namespace)) == sorted(
                b"m%d" % i for i in range(5000)
            )
            single = producer.send(TOPIC, b"one more", key=b"k1")
        with replica.client() as client:
            assert client.xrange(broker.keys.log(TOPIC, single.partition), min=single.offset)


def test_acks_replicas_with_the_replica_down(
    pair: tuple[ServerProcess, ServerProcess], namespace: str
) -> None:
    primary, replica = pair
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        replica.kill()
        wait_for(
            lambda: primary.client().info("replication")["connected_slaves"] == 0,
            what="the primary to notice",
        )
        with broker.producer(
            acks="replicas", ack_timeout_ms=200, delivery_timeout_ms=2000
        ) as producer:
            with pytest.raises(redisq.DeliveryTimeout) as caught:
                producer.send(TOPIC, b"not durable", key=b"k")
            assert "NotEnoughReplicas" in str(caught.value)
            assert "0 of 1" in str(caught.value)
        # Written on the primary (the outcome was "unknown", not "not written") and, although
        # re-sent for two seconds, stored once.
        assert stored_values(primary.url, namespace).count(b"not durable") == 1

        # min_replicas above the number of replicas fails the same way, not silently.
        with broker.producer(
            acks="replicas", min_replicas=2, ack_timeout_ms=100, delivery_timeout_ms=1000
        ) as producer:
            with pytest.raises(redisq.DeliveryTimeout):
                producer.send(TOPIC, b"two replicas", key=b"k")

        replica.start()  # same port and directory: it resyncs
        wait_for(lambda: in_sync(primary, replica), what="the replica to resync")
        with broker.producer(acks="replicas", ack_timeout_ms=2000) as producer:
            meta = producer.send(TOPIC, b"durable again", key=b"k")
        assert not meta.duplicate
        assert b"durable again" in stored_values(replica.url, namespace)


def test_acks_fsync_on_valkey_with_aof(namespace: str) -> None:
    server = ServerProcess(config={"appendonly": "yes", "appendfsync": "everysec"}).start()
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=PARTITIONS)
            with broker.producer(acks="fsync", max_batch_messages=100) as producer:
                futures = [
                    producer.send_async(TOPIC, b"m%d" % i, key=b"k%d" % (i % 10))
                    for i in range(3000)
                ]
                producer.flush(timeout=60)
            assert all(f.exception(timeout=0) is None for f in futures)
            assert len(stored_values(server.url, namespace)) == 3000
            with server.client() as client:
                # WAITAOF answered: the local AOF is fsynced up to the last write.
                assert client.execute_command("WAITAOF", 1, 0, 100)[0] == 1
    finally:
        server.stop()


def test_acks_fsync_without_aof_is_refused(namespace: str) -> None:
    server = ServerProcess(config={"appendonly": "no"}).start()
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            with pytest.raises(redisq.UnsupportedServer, match="appendonly"):
                broker.producer(acks="fsync")
    finally:
        server.stop()


def test_acks_fsync_on_redis_70_is_refused(namespace: str) -> None:
    server = ServerProcess(binary_for("redis"), config={"appendonly": "yes"}).start()
    try:
        if server_version(server) >= (7, 2):
            pytest.skip("this redis-server has WAITAOF")
        with redisq.connect(server.url, namespace=namespace) as broker:
            with pytest.raises(redisq.UnsupportedServer, match="WAITAOF") as caught:
                broker.producer(acks="fsync")
            assert "Redis >= 7.2" in str(caught.value)
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_acks_replicas_without_wait_is_refused_before_anything_is_written(
    kind: str, namespace: str
) -> None:
    """A server whose WAIT is renamed (or denied by an ACL) cannot confirm acks="replicas": the
    producer is refused when it starts, sync and asyncio, and nothing is written (before, the
    first batch was appended and only its WAIT failed)."""
    server = ServerProcess(binary_for(kind), config={"rename-command": "WAIT wait-hidden"}).start()
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=1)
            with server.client() as client:
                keys_before = sorted(client.scan_iter(f"{namespace}:*"))
            with pytest.raises(redisq.UnsupportedServer, match='acks="replicas" needs WAIT'):
                broker.producer(acks="replicas")

            async def start_asyncio() -> None:
                async with await redisq.asyncio.connect(server.url, namespace=namespace) as abroker:
                    producer = abroker.producer(acks="replicas")
                    with pytest.raises(redisq.UnsupportedServer, match="needs WAIT"):
                        await producer.send(TOPIC, b"never written", key=b"k")
                    await producer.close()

            asyncio.run(start_asyncio())
            with server.client() as client:
                assert client.xlen(broker.keys.log(TOPIC, 0)) == 0
                assert sorted(client.scan_iter(f"{namespace}:*")) == keys_before
            # The same server takes the default acks.
            with broker.producer() as producer:
                assert producer.send(TOPIC, b"leader", key=b"k").offset
    finally:
        server.stop()


# -- failover: what an acknowledged message can lose ------------------------------------------


def run_failover(acks: str, namespace: str) -> dict[str, int]:
    """Produce through Sentinel while SENTINEL FAILOVER promotes the replica; the old primary is
    demoted as soon as the sentinel names the new one (what Sentinel itself does within its
    10 s INFO period). Returns the counts for the README."""
    binary = valkey_binary()
    primary = ServerProcess(binary).start()
    replica = start_replica(primary)
    sentinel = SentinelProcess(binary, primary).start()
    sent: list[tuple[bytes, SendFuture]] = []
    try:
        wait_for(sentinel.knows_replica, what="the sentinel to see the replica")
        url = f"redis+sentinel://{sentinel.address}/{SERVICE}"
        with redisq.connect(url, namespace=namespace, socket_timeout=5) as broker:
            broker.create_topic(TOPIC, partitions=PARTITIONS)
            wait_for(lambda: in_sync(primary, replica), what="the topic to replicate")
            producer = broker.producer(
                acks=acks,
                ack_timeout_ms=500,
                delivery_timeout_ms=8000,
                max_batch_messages=50,
                linger_ms=2,
            )
            stop = threading.Event()

            def produce() -> None:
                rng = random.Random(3)
                i = 0
                while not stop.is_set():
                    value = b"v%d" % i
                    key = b"k%d" % rng.randrange(100)
                    try:
                        sent.append((value, producer.send_async(TOPIC, value, key=key)))
                    except redisq.RedisqError:
                        pass
                    i += 1
                    if i % 100 == 0:
                        time.sleep(0.02)  # ~5,000 messages/s

            thread = threading.Thread(target=produce, daemon=True)
            thread.start()
            time.sleep(1.5)
            failover_at = time.monotonic()
            with sentinel.client() as client:
                client.execute_command("SENTINEL", "FAILOVER", SERVICE)
            wait_for(lambda: sentinel.master_port() == replica.port, what="the failover")
            with primary.client() as client:  # the old primary stops taking writes
                client.execute_command("REPLICAOF", "127.0.0.1", replica.port)
            split_ms = int((time.monotonic() - failover_at) * 1000)
            time.sleep(1.5)
            stop.set()
            thread.join(timeout=30)
            try:
                producer.flush(timeout=60)
            finally:
                producer.close(timeout=30)
            acked = [v for v, f in sent if f.exception(timeout=60) is None]
            failed = [f.exception() for _, f in sent if f.exception() is not None]
            # Read from the new primary, through the same Sentinel url.
            stored = Counter(m.value for p in range(PARTITIONS) for m in broker.read(TOPIC, p))
        lost = [v for v in acked if v not in stored]
        return {
            "sent": len(sent),
            "acknowledged": len(acked),
            "acknowledged_lost": len(lost),
            "failed_unacknowledged": len(failed),
            "stored_twice": sum(1 for n in stored.values() if n > 1),
            "split_ms": split_ms,  # from SENTINEL FAILOVER until the old primary was demoted
        }
    finally:
        sentinel.stop()
        replica.stop()
        primary.stop()


@pytest.mark.fault
@pytest.mark.parametrize("acks", ["leader", "replicas"])
def test_failover_loss_by_ack_level(acks: str, namespace: str) -> None:
    figures = run_failover(acks, namespace)
    print(f"\nfailover with acks={acks!r}: {figures}")
    assert figures["acknowledged"] > 1000
    assert figures["stored_twice"] == 0
    if acks == "replicas":
        # WAIT on the old primary answers 0 once its replica is promoted: nothing it took after
        # that is acknowledged; the producer re-sends it to the new primary.
        assert figures["acknowledged_lost"] == 0
