"""Replicated deployments for the promotion scenarios, started as processes on loopback ports
(stopped by pid through ServerProcess.stop):

- Sentinel: a primary, two replicas and one sentinel (quorum 1). Two replicas, so that once one
  is promoted the other follows it and acks="replicas" (WAIT 1) can be answered again.
- Cluster: three primaries (a majority is left to vote when one dies) with one replica each.
  The killed primary is restarted and rejoins as a replica of the one that replaced it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.replication import SERVICE, SentinelProcess, in_sync, start_replica, wait_for
from tests.servers import (
    CLUSTER_NODE_CONFIG,
    ServerProcess,
    cluster_free_port,
    start_cluster,
)


@dataclass
class SentinelDeployment:
    primary: ServerProcess
    replicas: list[ServerProcess]
    sentinel: SentinelProcess

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.sentinel.address}/{SERVICE}"

    @property
    def processes(self) -> list[ServerProcess]:
        return [self.sentinel, *self.replicas, self.primary]

    def master_port(self) -> int:
        return self.sentinel.master_port()


def start_sentinel_deployment(binary: str) -> SentinelDeployment:
    started: list[ServerProcess] = []
    try:
        primary = ServerProcess(binary).start()
        started.append(primary)
        for _ in range(2):
            started.append(start_replica(primary))
        sentinel = SentinelProcess(binary, primary, quorum=1, down_after_ms=1000).start()
        started.append(sentinel)
        wait_for(sentinel.knows_replica, what="the sentinel to see the replicas")
        return SentinelDeployment(primary, started[1:3], sentinel)
    except BaseException:
        for process in reversed(started):
            process.stop()
        raise


def node_id(node: ServerProcess) -> str:
    with node.client(socket_timeout=5) as client:
        return str(client.execute_command("CLUSTER", "MYID").decode())


def cluster_info(node: ServerProcess) -> str:
    with node.client(socket_timeout=2) as client:
        return str(client.execute_command("CLUSTER", "INFO").decode())


def role(node: ServerProcess) -> str:
    with node.client(socket_timeout=2) as client:
        return str(client.info("replication")["role"])


@dataclass
class ClusterDeployment:
    primaries: list[ServerProcess]
    replicas: list[ServerProcess]
    replica_of: dict[int, ServerProcess] = field(default_factory=dict)  # primary port -> replica

    @property
    def processes(self) -> list[ServerProcess]:
        return [*self.replicas, *self.primaries]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries[0].port}"

    def primary_off_seed(self, broker: Any, topic: str) -> tuple[ServerProcess, dict[int, int]]:
        """A primary other than the seed node (primaries[0]) that holds partitions of topic, and
        each partition's primary port."""
        owners = partition_ports(broker, topic)
        victims = [p for p in self.primaries[1:] if p.port in owners.values()]
        assert victims, f"every partition sits on the seed node: {owners}"
        return victims[0], owners

    def owner_port(self, key: str) -> int:
        """The port of the primary that serves key now."""
        with self.primaries[0].client(socket_timeout=5) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        raise AssertionError(f"no node serves {key}")

    def healthy(self) -> bool:
        """Every live node sees cluster_state:ok and every primary has a replica in sync."""
        for node in self.processes:
            if node.process is None or node.process.poll() is not None:
                continue
            if "cluster_state:ok" not in cluster_info(node):
                return False
        for node in self.processes:
            if node.process is not None and node.process.poll() is None and role(node) == "slave":
                with node.client(socket_timeout=2) as client:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
        return True


def start_cluster_with_replicas(binary: str, masters: int = 3) -> ClusterDeployment:
    primaries = start_cluster(binary, masters=masters)
    replicas: list[ServerProcess] = []
    try:
        for primary in primaries:
            replica = ServerProcess(binary, port=cluster_free_port(), config=CLUSTER_NODE_CONFIG)
            replicas.append(replica.start())
            with primary.client() as client:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", replica.port)
        wait_for(
            lambda: all(f"cluster_known_nodes:{2 * masters}" in cluster_info(r) for r in replicas),
            what="the replicas to join",
        )
        for primary, replica in zip(primaries, replicas, strict=True):
            with replica.client() as client:
                client.execute_command("CLUSTER", "REPLICATE", node_id(primary))
        wait_for(
            lambda: all(in_sync(p, r) for p, r in zip(primaries, replicas, strict=True)),
            what="every primary to have its replica in sync",
        )
        return ClusterDeployment(
            primaries,
            replicas,
            {p.port: r for p, r in zip(primaries, replicas, strict=True)},
        )
    except BaseException:
        for node in replicas + primaries:
            node.stop()
        raise


@contextlib.contextmanager
def running_cluster_with_replicas(
    binary: str,
) -> Iterator[tuple[list[ServerProcess], list[ServerProcess]]]:
    """start_cluster_with_replicas for the block: (primaries, replicas); afterwards every node is
    resumed (a test may have SIGSTOPped it) and stopped."""
    deployment = start_cluster_with_replicas(binary)
    try:
        yield deployment.primaries, deployment.replicas
    finally:
        for node in deployment.processes:
            node.kill(signal.SIGCONT)
            node.stop()


def partition_ports(broker: Any, topic: str) -> dict[int, int]:
    """Each partition of topic: the port of the primary that holds it."""
    partitions = broker.describe_topic(topic).partitions
    return {p.partition: int(str(p.node).rsplit(":", 1)[1]) for p in partitions}


def partition_away_from_registry(
    broker: Any, topic: str, primaries: list[ServerProcess]
) -> tuple[ServerProcess, int]:
    """A primary that holds partitions of topic but not the namespace's transactions registry,
    and its first partition."""
    owners = partition_ports(broker, topic)
    registry = broker.client.get_node_from_key(broker.keys.transactions()).port
    node = next(p for p in primaries if p.port != registry and p.port in owners.values())
    return node, min(p for p, port in owners.items() if port == node.port)
