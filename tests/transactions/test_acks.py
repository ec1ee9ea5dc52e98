"""Transactions under acks="replicas" and "fsync": what commit() promises when it returns.

What is asserted (what a user checks), both APIs, Kafka style (transaction()) and RocketMQ style
(send_in_transaction):
- acks="replicas": once commit() returns, the replica already holds every message of the
  transaction (WAIT answered after a barrier write on the primary, on the same connection).
- With the replica stopped (SIGSTOP: connected, silent), commit() fails with NotEnoughReplicas
  at its delivery timeout; the transaction is committed on the primary (state "committed", its
  messages stored once) and the error says so.
- acks="fsync" on a server with AOF: commits return, WAITAOF confirmed.
- On Redis Cluster with a replica per primary: a transaction whose messages sit on a primary
  whose replica is down fails to confirm; one on the other primaries commits and confirms.
- acks="leader" sends no WAIT: a commit with the replica stopped returns at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from typing import Any

import pytest

import redisq
import redisq.asyncio
from redisq.model.records import decode_entries
from tests.cluster.test_three_masters import cluster_with_replicas  # noqa: F401 - a fixture
from tests.history.deployments import partition_away_from_registry
from tests.replication import in_sync, wait_for
from tests.servers import ServerProcess

pytestmark = pytest.mark.fault

TOPIC = "orders"
API = pytest.mark.parametrize("api", ["sync", "asyncio"])
STYLE = pytest.mark.parametrize("style", ["kafka", "rocketmq"])
DELIVERY_TIMEOUT_MS = 1500


def replica_values(replica: ServerProcess, key: str) -> list[bytes]:
    """The values partition 0's stream holds on the replica (message or batch entries)."""
    with replica.client() as client:
        return [m.value for m in decode_entries(TOPIC, 0, client.xrange(key))]


def check(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
    return redisq.TxState.COMMIT


def commit(
    url: str, namespace: str, api: str, style: str, values: list[bytes], **options: Any
) -> Any:
    """Send values in one transaction to partition 0 and commit: the transaction's state and
    records, or the exception commit raised (with the state the transaction was left in)."""
    if style == "kafka":
        options = {"name": f"svc-{uuid.uuid4().hex[:6]}", "transactional": True, **options}
    else:
        options = {"transactional_group": "g", "check": check, **options}

    def local(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        return redisq.TxState.COMMIT

    if api == "sync":
        with redisq.connect(url, namespace=namespace) as broker:
            with broker.producer(**options) as producer:
                if style == "rocketmq":
                    try:
                        return producer.send_in_transaction(
                            TOPIC, values[0], key="k", partition=0, local=local
                        )
                    except redisq.RedisqError as exc:
                        return exc
                transaction = producer.transaction()
                for value in values:
                    transaction.send(TOPIC, value, key="k", partition=0)
                try:
                    transaction.commit()
                except redisq.RedisqError as exc:
                    return exc, transaction.state
                return transaction.state, transaction.records

    async def main() -> Any:
        async with await redisq.asyncio.connect(url, namespace=namespace) as broker:
            async with broker.producer(**options) as producer:
                if style == "rocketmq":
                    try:
                        return await producer.send_in_transaction(
                            TOPIC, values[0], key="k", partition=0, local=local
                        )
                    except redisq.RedisqError as exc:
                        return exc
                transaction = producer.transaction()
                for value in values:
                    await transaction.send(TOPIC, value, key="k", partition=0)
                try:
                    await transaction.commit()
                except redisq.RedisqError as exc:
                    return exc, transaction.state
                return transaction.state, transaction.records

    return asyncio.run(main())


def committed(outcome: Any, style: str) -> bool:
    if style == "rocketmq":
        return (
            isinstance(outcome, redisq.TransactionResult) and outcome.state is redisq.TxState.COMMIT
        )
    return outcome[0] == "committed"


@API
@STYLE
def test_commit_returns_once_the_replica_holds_the_transaction(
    pair: tuple[ServerProcess, ServerProcess], api: str, style: str
) -> None:
    primary, replica = pair
    namespace = f"t{uuid.uuid4().hex[:8]}"
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=2)
        log = broker.keys.log(TOPIC, 0)
    values = [b"a", b"b", b"c"]
    sent = values[:1] if style == "rocketmq" else values
    outcome = commit(primary.url, namespace, api, style, values, acks="replicas")
    assert committed(outcome, style), outcome
    # Read at once, on the replica: WAIT confirmed the barrier written after the messages.
    assert replica_values(replica, log) == sent


@API
@STYLE
def test_commit_with_the_replica_silent_fails_but_stays_committed(
    pair: tuple[ServerProcess, ServerProcess], api: str, style: str
) -> None:
    primary, replica = pair
    namespace = f"t{uuid.uuid4().hex[:8]}"
    with redisq.connect(primary.url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=2)
        log = broker.keys.log(TOPIC, 0)
    replica.kill(signal.SIGSTOP)
    try:
        started = time.monotonic()
        outcome = commit(
            primary.url, namespace, api, style, [b"x"], acks="replicas",
            ack_timeout_ms=200, delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
        )  # fmt: skip
        elapsed = time.monotonic() - started
        if style == "kafka":
            error, state = outcome
            assert state == "committed"
        else:
            error = outcome
        assert isinstance(error, redisq.NotEnoughReplicas), outcome
        assert "is committed on the primary" in str(error) and "0 of 1" in str(error)
        assert elapsed < 15, elapsed
        # Leader acks send no WAIT: the same commit returns with the replica still silent.
        outcome = commit(primary.url, namespace, api, style, [b"y"], acks="leader")
        assert committed(outcome, style), outcome
    finally:
        replica.kill(signal.SIGCONT)
    with redisq.connect(primary.url, namespace=namespace) as broker:
        assert [m.value for m in broker.read(TOPIC, 0)] == [b"x", b"y"]  # once each
    wait_for(lambda: in_sync(primary, replica), what="the replica to catch up")
    assert replica_values(replica, log) == [b"x", b"y"]


@API
def test_commit_with_acks_fsync(api: str) -> None:
    server = ServerProcess(config={"appendonly": "yes", "appendfsync": "everysec"}).start()
    try:
        namespace = f"t{uuid.uuid4().hex[:8]}"
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=2)
        outcome = commit(server.url, namespace, api, "rocketmq", [b"f"], acks="fsync")
        assert committed(outcome, "rocketmq"), outcome
        options: dict[str, Any] = {"name": "svc", "transactional": True, "acks": "fsync"}
        options |= {"ack_timeout_ms": 200, "delivery_timeout_ms": DELIVERY_TIMEOUT_MS}

        def aof_off() -> None:  # after the producer's start-up check: WAITAOF refuses now
            with server.client() as client:
                client.config_set("appendonly", "no")

        errors: list[BaseException | None] = []
        if api == "sync":
            with redisq.connect(server.url, namespace=namespace) as broker:
                with broker.producer(**options) as producer:
                    for value in (b"g", b"h"):
                        transaction = producer.transaction()
                        transaction.send(TOPIC, value, partition=0)
                        try:
                            transaction.commit()
                            errors.append(None)
                        except redisq.NotEnoughReplicas as exc:
                            errors.append(exc)
                        assert transaction.state == "committed"
                        aof_off()
        else:

            async def main() -> None:
                async with await redisq.asyncio.connect(server.url, namespace=namespace) as broker:
                    async with broker.producer(**options) as producer:
                        for value in (b"g", b"h"):
                            transaction = producer.transaction()
                            await transaction.send(TOPIC, value, partition=0)
                            try:
                                await transaction.commit()
                                errors.append(None)
                            except redisq.NotEnoughReplicas as exc:
                                errors.append(exc)
                            assert transaction.state == "committed"
                            aof_off()

            asyncio.run(main())
        assert errors[0] is None and errors[1] is not None, errors
        assert "appendonly" in str(errors[1])
        with redisq.connect(server.url, namespace=namespace) as broker:
            assert [m.value for m in broker.read(TOPIC, 0)] == [b"f", b"g", b"h"]
    finally:
        server.stop()


@pytest.mark.cluster
@API
def test_commit_on_a_cluster_confirms_on_each_node_it_wrote_to(
    cluster_with_replicas: tuple[list[ServerProcess], list[ServerProcess]],  # noqa: F811
    api: str,
) -> None:
    """A transaction writing to a partition of a primary other than the registry's: confirmed
    while that primary's replica is up, not once it is down (the WAIT goes to the partition's own
    node, not only to the registry's). A transaction's record lives in a slot of its own id, on
    any node, so a partition of another primary is no control here."""
    primaries, replicas = cluster_with_replicas
    namespace = f"t{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{primaries[0].port}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=12)
        victim, partition = partition_away_from_registry(broker, TOPIC, primaries)
    options = {
        "acks": "replicas",
        "ack_timeout_ms": 200,
        "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
    }

    def commit_one(value: bytes) -> BaseException | None:
        name = f"svc-{uuid.uuid4().hex[:6]}"
        if api == "sync":
            with redisq.connect(url, namespace=namespace) as broker:
                with broker.producer(name=name, transactional=True, **options) as producer:
                    transaction = producer.transaction()
                    transaction.send(TOPIC, value, partition=partition)
                    try:
                        transaction.commit()
                    except redisq.NotEnoughReplicas as exc:
                        return exc
                    return None

        async def main() -> BaseException | None:
            async with await redisq.asyncio.connect(url, namespace=namespace) as broker:
                async with broker.producer(name=name, transactional=True, **options) as pr:
                    transaction = pr.transaction()
                    await transaction.send(TOPIC, value, partition=partition)
                    try:
                        await transaction.commit()
                    except redisq.NotEnoughReplicas as exc:
                        return exc
                    return None

        return asyncio.run(main())

    assert commit_one(b"before") is None
    replicas[primaries.index(victim)].kill()
    wait_for(
        lambda: victim.client().info("replication")["connected_slaves"] == 0,
        what="the primary to notice",
    )
    error = commit_one(b"after")
    assert isinstance(error, redisq.CommitNotConfirmed), error
    with redisq.connect(url, namespace=namespace) as broker:
        assert [m.value for m in broker.read(TOPIC, partition)] == [b"before", b"after"]
