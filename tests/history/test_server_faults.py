"""Server faults, checked through the history checker (tests/history): producer and consumer
processes record what they invoked, what was answered and what they handled; the test kills,
stops, restarts or fails over the server, then reads the topic back and checks every property
(tests/history/checker.py). Each test runs its own server processes on free loopback ports.

Scenarios: SIGKILL + restart with AOF (appendfsync always); a restart that keeps nothing, with
an old producer instance still sending while a new one starts; replica promotion under
acks="replicas" (Sentinel, and Redis Cluster, with plain and with delayed sends); the server
SIGSTOPped past the consumers' lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

import redisq
from redisq.model.keys import KeySpace
from tests.history.checker import Stored
from tests.history.deployments import (
    node_id,
    role,
    start_cluster_with_replicas,
    start_sentinel_deployment,
)
from tests.history.faults import wait_until
from tests.history.harness import (
    DRAIN_S,
    PRODUCER,
    TOPIC,
    Run,
    assert_no_violations,
    read_stored,
)
from tests.servers import ServerProcess, binary_for

pytestmark = pytest.mark.fault

KINDS = ["valkey", "redis"]
LEASE_TTL_MS = 1500


def stored_at(url: str, namespace: str) -> list[Stored]:
    with redisq.connect(url, namespace=namespace) as reader:
        return read_stored(reader)


def hold(seconds: float) -> None:
    """The duration of a fault (a server or process kept stopped): not a wait for a condition."""
    time.sleep(seconds)


# -- SIGKILL and restart with AOF -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_server_sigkill_restart_with_aof(kind: str, tmp_path: Path) -> None:
    """Acknowledged => stored once, in order, with producers and consumers running through a
    SIGKILL of the server and its restart from an AOF written with appendfsync always."""
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    with Run(tmp_path, server.url, servers=[server]) as run:
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
        producers = ["A", "B"]
        run.producer("A", name="svc", options=PRODUCER)
        run.producer("B", options=PRODUCER)
        for proc in ("c1", "c2"):
            run.consumer(proc, options={"lease_ttl_ms": LEASE_TTL_MS})
        for proc in producers:
            run.workers[proc].command("stream", count=1500, rate=600, keys=12)
        run.wait_acked("A", 300)
        run.wait_handled(200)
        run.driver.kill_server(server)
        run.driver.restart_server(server)
        run.wait_streams(producers)
        problems = run.close_producers(producers)
        stored = stored_at(server.url, run.namespace)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)
        assert len(stored) >= 2000, f"only {len(stored)} stored: the scenario barely ran"


# -- restart without persistence: an old instance goes on while a new one starts -----------------


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
@pytest.mark.parametrize("kind", KINDS)
def test_restart_without_persistence_old_and_new_instance(
    kind: str, named: bool, tmp_path: Path
) -> None:
    """The server restarts with nothing (no AOF, no RDB); the test re-creates the topic. Producer
    instance A keeps sending across the restart; then instance B starts (the same name for the
    named variant, another anonymous producer otherwise) and both send.

    Every send invoked after the restart and acknowledged (duplicate or not) must be stored,
    once, where answered: a producer id or epoch handed out again after the restart must not
    make the broker answer "duplicate" for batches it never stored. Named: once B has started,
    nothing of A may land (no_fenced_writes)."""
    server = ServerProcess(binary_for(kind)).start()
    name = "svc" if named else None
    with Run(tmp_path, server.url, servers=[server]) as run:
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
        run.producer("A", name=name, options=PRODUCER)
        run.workers["A"].command("stream", count=None, rate=400, keys=8)
        run.wait_acked("A", 200)
        run.driver.kill_server(server)
        run.driver.restart_server(server)
        back_at = time.time() * 1000  # sends invoked after this reach the new server only
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
        run.driver.record("create_topic", "server", server)
        acked = run.count("send_ok", "A")
        run.wait_acked("A", acked + 200)  # A goes on after the restart
        run.producer("B", name=name, options=PRODUCER)
        run.workers["B"].command("stream", count=600, rate=400, keys=8)
        run.wait_streams(["B"])
        problems = run.close_producers(["B", "A"])
        stored = stored_at(server.url, run.namespace)
        run.finish_workers()
        results = run.check(
            stored,
            ("acknowledged_stored_once", "key_order_in_log", "no_fenced_writes"),
            lost_before=back_at,
        )
        assert_no_violations(results, problems)


# -- replica promotion under acks="replicas" ------------------------------------------------------

ACK_TIMEOUT_MS = 500
DURABLE = {**PRODUCER, "acks": "replicas", "ack_timeout_ms": ACK_TIMEOUT_MS}


@pytest.mark.parametrize("kind", KINDS)
def test_sentinel_promotion_acks_replicas(kind: str, tmp_path: Path) -> None:
    """Primary + two replicas + Sentinel; producers on a redis+sentinel:// url with
    acks="replicas". The primary is SIGKILLed; Sentinel promotes a replica and the other follows
    it. Every acknowledged message is on the new primary, once, in order."""
    deployment = start_sentinel_deployment(binary_for(kind))
    replicas = deployment.replicas
    with Run(
        tmp_path, deployment.url, time_url=replicas[0].url, servers=deployment.processes
    ) as run:
        with redisq.connect(deployment.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
        producers = ["A", "B"]
        run.producer("A", name="svc", options=DURABLE)
        run.producer("B", options=DURABLE)
        for proc in producers:
            run.workers[proc].command("stream", count=1200, rate=400, keys=12)
        run.wait_acked("A", 300)
        run.driver.kill_server(deployment.primary, "primary")
        run.wait(lambda: deployment.master_port() in {r.port for r in replicas}, DRAIN_S,
                 "Sentinel to promote a replica")  # fmt: skip
        run.driver.record("promoted", f"127.0.0.1:{deployment.master_port()}")
        run.wait_streams(producers)
        problems = run.close_producers(producers)
        stored = stored_at(deployment.url, run.namespace)
        run.finish_workers()
        results = run.check(stored, ("acknowledged_stored_once", "key_order_in_log"))
        assert_no_violations(results, problems)
        assert run.count("send_ok") >= 1200, run.summary()


@pytest.mark.cluster
@pytest.mark.parametrize("kind", KINDS)
def test_cluster_promotion_acks_replicas(kind: str, tmp_path: Path) -> None:
    """Redis Cluster, three primaries with a replica each; producers with acks="replicas". The
    primary serving partition 1 (not the seed node) is SIGKILLed; the cluster promotes its
    replica; the old primary is restarted and rejoins as the new one's replica. Every
    acknowledged message is stored once, in order."""
    cluster = start_cluster_with_replicas(binary_for(kind))
    with Run(
        tmp_path, cluster.url, time_url=cluster.primaries[0].url, servers=cluster.processes
    ) as run:
        with redisq.connect(cluster.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=6)
            victim, _ = cluster.primary_off_seed(broker, TOPIC)
        replica = cluster.replica_of[victim.port]
        producers = ["A", "B"]
        run.producer("A", name="svc", options=DURABLE)
        run.producer("B", options=DURABLE)
        for proc in producers:
            run.workers[proc].command("stream", count=1200, rate=400, keys=12)
        run.wait_acked("A", 300)
        victim_id = node_id(victim)
        run.driver.kill_server(victim, f"primary {victim_id[:8]}")
        run.wait(lambda: role(replica) == "master", DRAIN_S, "the replica to be promoted")
        run.driver.record("promoted", f"127.0.0.1:{replica.port}")
        run.driver.restart_server(victim, f"old primary {victim_id[:8]}")
        run.wait(cluster.healthy, DRAIN_S, "the old primary to rejoin as a replica")
        run.wait_streams(producers)
        problems = run.close_producers(producers)
        stored = stored_at(cluster.url, run.namespace)
        run.finish_workers()
        results = run.check(stored, ("acknowledged_stored_once", "key_order_in_log"))
        assert_no_violations(results, problems)
        assert run.count("send_ok") >= 1200, run.summary()


# Delayed sends: a delay short enough that most messages are delivered while the run goes on,
# the same for every send so that key order applies (same key, same delay: send order).
DELAY_MS = 300


def within(condition: Callable[[], object], seconds: float) -> bool:
    """Whether condition() became true within `seconds` (not a failure when it did not)."""
    try:
        wait_until(condition, seconds, "a condition")
    except AssertionError:
        return False
    return True


def schedule_ids(node: ServerProcess, keys: KeySpace, partitions: Iterable[int]) -> set[bytes]:
    """The schedule ids `node` holds for these partitions of TOPIC, read from that node itself:
    waiting (the schedule's hash) or delivered and still refused (its tombstones, kept for the
    senders' delivery timeout + 5 s: longer than the scenario). Read in that order, an id being
    delivered meanwhile is seen in one or the other."""
    ids: set[bytes] = set()
    with node.client(socket_timeout=2) as client:
        for p in partitions:
            ids.update(client.hkeys(keys.scheduled_messages(TOPIC, p)))
            ids.update(client.zrange(keys.scheduled_delivered(TOPIC, p), 0, -1))
    return ids


@pytest.mark.cluster
@pytest.mark.parametrize("kind", KINDS)
def test_cluster_promotion_delayed_acks_replicas(kind: str, tmp_path: Path) -> None:
    """Redis Cluster, three primaries with a replica each; producers send DELAYED messages
    (delay_ms=DELAY_MS) with acks="replicas": a send is acknowledged once its message is in the
    partition's schedule and WAIT answered on the primary holding it. A consumer runs throughout
    (its scheduler delivers due messages, through the failover too; so do the producers').

    The primary serving a partition that is not on the seed node first loses its replica: it
    drops the replication link and refuses the replica's PSYNC (ACL), so what it stores from
    then on never reaches the replica (the replica, alive, still answers the cluster bus). Once
    it holds delayed messages the replica lacks, and for twice ack_timeout_ms more (WAIT has
    answered "0 replicas" for them), it is SIGKILLed; the replica is promoted, the old primary
    restarted to rejoin as a replica. What the primary alone held is lost: it must not have
    been acknowledged (its senders send it again, to the new primary). So are the deliveries it
    made meanwhile: those messages are still scheduled on the new primary and go out again.

    Then, once every schedule is empty: every acknowledged delayed send is stored once, in the
    partition answered, no earlier than its answered due time, and in send order per (producer,
    key)."""
    cluster = start_cluster_with_replicas(binary_for(kind))
    with Run(
        tmp_path, cluster.url, time_url=cluster.primaries[0].url, servers=cluster.processes
    ) as run:
        with redisq.connect(cluster.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=6)
            victim, owner = cluster.primary_off_seed(broker, TOPIC)
            keys = broker.keys
        replica = cluster.replica_of[victim.port]
        on_victim = {p for p, port in owner.items() if port == victim.port}
        run.consumer("c1", options={"lease_ttl_ms": LEASE_TTL_MS})
        producers = ["A", "B"]
        run.producer("A", name="svc", options=DURABLE)
        run.producer("B", options=DURABLE)
        for proc in producers:  # until close_producers() stops them, after the failover
            run.workers[proc].command("stream", count=None, rate=400, keys=12, delay_ms=DELAY_MS)
        run.wait_acked("A", 300)
        victim_id = node_id(victim)
        with victim.client(socket_timeout=5) as client:
            client.execute_command("ACL", "SETUSER", "default", "-psync", "-sync")
            cut = client.execute_command("CLIENT", "KILL", "TYPE", "replica")
        run.driver.record("cut_replication", f"primary {victim_id[:8]}", victim, links=cut)
        assert cut == 1, f"{cut} replication links cut"
        known = schedule_ids(victim, keys, on_victim)

        def alone() -> set[bytes]:  # stored on the primary after the cut: never replicated
            return schedule_ids(victim, keys, on_victim) - known

        if not within(alone, 4 * ACK_TIMEOUT_MS / 1000):
            # A batch stored just before the cut and not yet confirmed by WAIT holds its
            # partition: it is sent again (a duplicate) until the failover, and nothing new is
            # stored there meanwhile. The failover goes on with that.
            run.driver.record("no_writes_after_cut", f"primary {victim_id[:8]}")
        # Past the ack timeout, WAIT has answered "0 replicas" for what only the primary holds:
        # an answer that must not become an acknowledgement.
        hold(2 * ACK_TIMEOUT_MS / 1000)
        run.driver.kill_server(victim, f"primary {victim_id[:8]}")
        killed_at = time.time() * 1000  # sends invoked later can only be stored on the new one
        run.wait(lambda: role(replica) == "master", DRAIN_S, "the replica to be promoted")
        run.driver.record("promoted", f"127.0.0.1:{replica.port}")
        run.driver.restart_server(victim, f"old primary {victim_id[:8]}")
        run.wait(cluster.healthy, DRAIN_S, "the old primary to rejoin as a replica")

        def acked_on_victim() -> tuple[int, int]:  # invoked before / after the kill
            history = run.history()
            acked = [
                history.invokes[value]["wall"]
                for value, oks in history.oks.items()
                if oks[0]["partition"] in on_victim
            ]
            before = sum(1 for at in acked if at < killed_at)
            return before, len(acked) - before

        # The fault is on the path: the victim's partitions acknowledge delayed sends invoked
        # before the kill (on the old primary) and after it (on the promoted replica).
        run.wait(lambda: all(acked_on_victim()), DRAIN_S, "sends on both sides of the kill")
        problems = run.close_producers(producers)
        run.wait_delivered()  # the consumer's scheduler delivers what is left
        stored = stored_at(cluster.url, run.namespace)
        run.finish_workers()
        results = run.check(
            stored, ("acknowledged_stored_once", "key_order_in_log", "delivered_not_early")
        )
        assert_no_violations(results, problems)
        history = run.history()
        assert run.count("send_ok") >= 1200, run.summary()
        assert all(ok[0].get("schedule_id") for ok in history.oks.values()), "a plain send?"


# -- the server SIGSTOPped past the consumers' lease ----------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_server_sigstop_past_lease_ttl(kind: str, tmp_path: Path) -> None:
    """The server is frozen (SIGSTOP) for twice the lease TTL while three members consume and a
    producer sends: every lease runs out meanwhile. After SIGCONT: still one handler per
    partition at a time, nothing lost, order per key."""
    server = ServerProcess(binary_for(kind)).start()
    with Run(tmp_path, server.url, servers=[server]) as run:
        with redisq.connect(server.url, namespace=run.namespace) as broker:
            broker.create_topic(TOPIC, partitions=4)
        run.producer("A", options=PRODUCER)
        for proc in ("c1", "c2", "c3"):
            run.consumer(proc, options={"lease_ttl_ms": LEASE_TTL_MS}, work_ms=3)
        run.workers["A"].command("stream", count=1500, rate=500, keys=16)
        run.wait_handled(200)
        run.driver.stop_server(server)
        hold(2 * LEASE_TTL_MS / 1000)
        run.driver.cont_server(server)
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])
        stored = stored_at(server.url, run.namespace)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)
