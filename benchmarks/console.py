"""Console page loads at size: 100 topics, 1,000 partitions, 50 groups (the issue's target:
every page under 300 ms on this machine), and the batched reads side by side with the library's
per-topic / per-group describe calls that the CLI makes.

    python benchmarks/console.py [--url URL] [--topics 100] [--partitions 10] [--groups 50]
                                 [--messages 20] [--delayed 10] [--transactions 50]
                                 [--repeat 20] [--markdown]

--partitions is per topic (100 x 10 = 1,000); --messages per partition; --delayed per topic
(due in an hour); --transactions half messages left open. The groups each read part of their
topic and commit, so lags, positions and fencing counters are real. Pages are
fetched over HTTP from the console served by uvicorn in this process (one keep-alive
connection), after one warm-up load each; the table gives the median, p95 and worst load, and
the round trips to Redis per load (connections taken from redis-py's pool: a pipeline is one).
Without --url or REDIS_URL it uses the embedded valkey-server. Everything is written in a
namespace of its own, deleted at the end.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import threading
import time
import uuid
from typing import Any

from report import print_table

import redisq
from redisq.console import create_app
from redisq.protocol import run_operation
from redisq.protocol.overview import namespace_snapshot

TARGET_MS = 300


def build(
    broker: redisq.Broker,
    topics: int,
    partitions: int,
    groups: int,
    messages: int,
    delayed: int,
    transactions: int,
) -> None:
    names = [f"topic-{t:03d}" for t in range(topics)]
    for name in names:
        broker.create_topic(name, partitions=partitions)
    with broker.producer(name="bench-console") as producer:
        for name in names:
            for i in range(partitions * messages):
                producer.send_async(name, b'{"n": %d}' % i, key=b"k%d" % i)
            for i in range(delayed):  # due in an hour: still scheduled while pages load
                producer.send_async(name, b"later %d" % i, key=b"d%d" % i, delay_ms=3_600_000)
        producer.flush()
    unknown = lambda tx_id, batch: redisq.TxState.UNKNOWN  # noqa: E731
    with broker.producer(
        transactional_group="bench-tx", check=unknown, check_first_ms=3_600_000
    ) as producer:  # half messages left open (check-back in an hour)
        for i in range(transactions):
            producer.send_in_transaction(names[i % topics], b"half", key=b"h%d" % i, local=unknown)
    for g in range(groups):
        topic = names[g % topics]
        with broker.consumer(topic, group=f"group-{g:02d}", name=f"member-{g}") as consumer:
            consumer.poll(timeout=0.5, max_messages=partitions * messages // 2)
            consumer.commit()
    print(
        f"built {topics} topics x {partitions} partitions, {topics * partitions * messages:,} "
        f"messages, {groups} groups, {topics * delayed:,} delayed messages, {transactions} open "
        "transactions",
        file=sys.stderr,
    )


class RoundTrips:
    """Counts connections taken from the client's pool: one per command or pipeline."""

    def __init__(self, client: Any) -> None:
        self.count = 0
        pool = client.connection_pool
        original = pool.get_connection

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        pool.get_connection = counted


def serve(app: Any) -> tuple[Any, threading.Thread, int]:
    import uvicorn

    sys.path.insert(0, ".")
    from tests.servers import free_port

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, port


def load_pages(port: int, pages: list[str], repeat: int, trips: RoundTrips) -> list[list[str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    rows = []
    for path in pages:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise SystemExit(f"{path}: HTTP {response.status}")
        times = []
        before = trips.count
        for _ in range(repeat):
            started = time.perf_counter()
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            times.append((time.perf_counter() - started) * 1000)
        per_load = (trips.count - before) / repeat
        times.sort()
        p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
        verdict = "ok" if max(times) < TARGET_MS else "SLOW"
        rows.append(
            [path, f"{statistics.median(times):.1f}", f"{p95:.1f}", f"{max(times):.1f}",
             f"{per_load:.1f}", verdict]
        )  # fmt: skip
    conn.close()
    return rows


def compare_reads(broker: redisq.Broker, repeat: int) -> list[list[str]]:
    """The overview's data: one snapshot vs describe_topic per topic + describe_group per group."""

    def batched() -> None:
        run_operation(namespace_snapshot(broker.keys), broker.scripts.execute)

    def per_object() -> None:
        for topic in broker.list_topics():
            broker.describe_topic(topic)
        for topic, group in broker.list_groups():
            broker.describe_group(topic, group)

    medians = {}
    for name, run in (
        ("console snapshot (pipelined)", batched),
        ("describe_* per object", per_object),
    ):
        times = []
        for _ in range(max(3, repeat // 4)):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1000)
        medians[name] = statistics.median(times)
    base = medians["console snapshot (pipelined)"]
    return [[name, f"{ms:.1f}", f"{ms / base:.1f}x"] for name, ms in medians.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=10)
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--messages", type=int, default=20)
    parser.add_argument("--delayed", type=int, default=10, help="delayed messages per topic")
    parser.add_argument("--transactions", type=int, default=50, help="open half messages")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    broker = redisq.connect(args.url, namespace=f"bench-console-{uuid.uuid4().hex[:6]}")
    try:
        build(
            broker,
            args.topics,
            args.partitions,
            args.groups,
            args.messages,
            args.delayed,
            args.transactions,
        )
        trips = RoundTrips(broker.client)
        app = create_app(broker, sample_interval_s=5.0)
        server, thread, port = serve(app)
        pages = [
            "/",
            "/groups",
            "/topics/topic-000",
            "/topics/topic-000/messages",
            "/topics/topic-000/messages?key=k7",
            "/topics/topic-000/groups/group-00",
            "/topics/topic-000/groups/group-00/deadletters",
            "/topics/topic-000/producers",
            "/producers",
            "/transactions",
            "/metrics",
        ]
        try:
            rows = load_pages(port, pages, args.repeat, trips)
        finally:
            server.should_exit = True
            thread.join(10)
        print(f"\nPage loads ({args.repeat} each, ms; target < {TARGET_MS} ms):")
        print_table(["page", "median", "p95", "max", "round trips", ""], rows, args.markdown, (5,))
        print("\nThe overview's reads, side by side (ms, median):")
        print_table(["reads", "ms", "ratio"], compare_reads(broker, args.repeat), args.markdown)
        return 0 if all(row[-1] == "ok" for row in rows) else 1
    finally:
        for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
            broker.client.delete(key)
        broker.close()


if __name__ == "__main__":
    sys.exit(main())
