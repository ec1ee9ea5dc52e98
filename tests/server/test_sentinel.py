"""redis+sentinel:// urls: the broker asks the sentinels for the master and follows it after a
failover (SENTINEL FAILOVER, or the primary killed and voted down by a quorum of sentinels)."""

from __future__ import annotations

import uuid

import pytest

import redisq
from redisq.server.connection import redact_url
from tests.replication import SERVICE, SentinelProcess, in_sync, start_replica, wait_for
from tests.servers import ServerProcess, binary_for, valkey_binary

TOPIC = "orders"


class Deployment:
    def __init__(self, binary: str, sentinels: int, quorum: int) -> None:
        self.primary = ServerProcess(binary).start()
        self.replica = start_replica(self.primary)
        self.sentinels = [
            SentinelProcess(binary, self.primary, quorum=quorum).start() for _ in range(sentinels)
        ]
        for sentinel in self.sentinels:
            wait_for(sentinel.knows_replica, what="the sentinels to see the replica")
        if sentinels > 1:  # sentinels find each other through the master's hello channel
            wait_for(
                lambda: all(
                    len(s.client().execute_command("SENTINEL", "SENTINELS", SERVICE))
                    >= sentinels - 1
                    for s in self.sentinels
                ),
                what="the sentinels to find each other",
            )

    @property
    def url(self) -> str:
        hosts = ",".join(s.address for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def stop(self) -> None:
        for process in [*self.sentinels, self.replica, self.primary]:
            process.stop()


@pytest.fixture
def namespace() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


def test_sentinel_url_errors_name_the_shape() -> None:
    with pytest.raises(ValueError, match="mymaster"):
        redisq.connect("redis+sentinel://127.0.0.1:26379")
    assert (
        redact_url("redis+sentinel://app:s3cret@h1:26379,h2:26379/mymaster/0")
        == "redis+sentinel://app:***@h1:26379,h2:26379/mymaster/0"
    )


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_follows_the_master_after_sentinel_failover(kind: str, namespace: str) -> None:
    deployment = Deployment(binary_for(kind), sentinels=1, quorum=1)
    try:
        with redisq.connect(deployment.url, namespace=namespace) as broker:
            assert "Sentinel" in type(broker.client.connection_pool).__name__
            broker.create_topic(TOPIC, partitions=2)
            with broker.producer(name="svc", acks="replicas", ack_timeout_ms=500) as producer:
                before = [producer.send(TOPIC, b"before-%d" % i, key=b"k") for i in range(10)]
                sentinel = deployment.sentinels[0]
                with sentinel.client() as client:
                    client.execute_command("SENTINEL", "FAILOVER", SERVICE)
                wait_for(
                    lambda: sentinel.master_port() == deployment.replica.port,
                    what="the failover",
                )
                # The same producer and broker go on: WAIT fails on the old primary (its replica
                # left), which turns READONLY when Sentinel demotes it (within its 10 s INFO
                # period); the client then asks the sentinel again. A batch re-sent to the new
                # primary may be answered as a duplicate (it was replicated): stored once.
                for i in range(10):
                    producer.send(TOPIC, b"after-%d" % i, key=b"k")
            partition = before[0].partition
            values = [m.value for m in broker.read(TOPIC, partition)]
            with deployment.replica.client() as client:
                assert client.info("replication")["role"] == "master"
        assert values == [b"before-%d" % i for i in range(10)] + [
            b"after-%d" % i for i in range(10)
        ]
    finally:
        deployment.stop()


@pytest.mark.fault
def test_follows_the_master_after_the_primary_is_killed(namespace: str) -> None:
    deployment = Deployment(valkey_binary(), sentinels=3, quorum=2)
    try:
        with redisq.connect(deployment.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=2)
            # acks="leader": once the replica is promoted, no replica is left to WAIT for.
            producer = broker.producer()
            first = producer.send(TOPIC, b"first", key=b"k")
            wait_for(lambda: in_sync(deployment.primary, deployment.replica), what="sync")
            deployment.primary.kill()  # SIGKILL: the sentinels vote it down, promote the replica
            futures = [producer.send_async(TOPIC, b"m%d" % i, key=b"k") for i in range(200)]
            producer.flush(timeout=90)
            producer.close()
            assert all(f.exception(timeout=0) is None for f in futures)
            values = [m.value for m in broker.read(TOPIC, first.partition)]
        assert values == [b"first"] + [b"m%d" % i for i in range(200)]
        assert all(s.master_port() == deployment.replica.port for s in deployment.sentinels)
    finally:
        deployment.stop()
