"""Transactional produce throughput against plain idempotent produce, side by side in one run.

    python benchmarks/transactions.py [--url URL] [--messages N] [--repeat R] [--markdown]

Every variant writes the same keyed 100-byte messages to a 4-partition topic: plain
`send_async` + `flush` (idempotence="sequence", the baseline), Kafka-style transactions of 1, 10
and 100 messages (`with p.transaction() as tx: tx.send(...)`, each committed before the next
begins), and RocketMQ-style half messages (`send_in_transaction`, local answers COMMIT; one
message per transaction by design). Each variant runs R times, interleaved; medians count; the
ratio is msg/s over the baseline's. The content is checked after each run (every message once).
Without --url or REDIS_URL it uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable

from report import print_table, run_rounds

import redisq

PARTITIONS = 4
PAYLOAD = b"x" * 100


def keys_for(n: int) -> list[bytes]:
    return [b"key-%d" % (i % 1000) for i in range(n)]


def fresh_topic(broker: redisq.Broker) -> str:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=PARTITIONS)
    return topic


def finish(broker: redisq.Broker, topic: str, n: int, elapsed: float, what: str) -> float:
    total = broker.describe_topic(topic).total_messages
    broker.delete_topic(topic, force=True)
    if total != n:
        raise SystemExit(f"{what}: {total} messages stored, expected {n}")
    return n / elapsed


def run_plain(broker: redisq.Broker, n: int) -> float:
    topic = fresh_topic(broker)
    with broker.producer() as producer:
        start = time.perf_counter()
        for key in keys_for(n):
            producer.send_async(topic, PAYLOAD, key=key)
        producer.flush()
        elapsed = time.perf_counter() - start
    return finish(broker, topic, n, elapsed, "plain")


def run_transactions(broker: redisq.Broker, n: int, size: int) -> float:
    topic = fresh_topic(broker)
    keys = keys_for(n)
    with broker.producer(name=f"bench-{uuid.uuid4().hex[:6]}", transactional=True) as producer:
        start = time.perf_counter()
        for first in range(0, n, size):
            with producer.transaction() as tx:
                for key in keys[first : first + size]:
                    tx.send(topic, PAYLOAD, key=key)
        elapsed = time.perf_counter() - start
    return finish(broker, topic, n, elapsed, f"transactions of {size}")


def run_half_messages(broker: redisq.Broker, n: int) -> float:
    topic = fresh_topic(broker)
    group = f"bench-{uuid.uuid4().hex[:6]}"

    def commit(tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        return redisq.TxState.COMMIT

    with broker.producer(transactional_group=group, check=commit) as producer:
        start = time.perf_counter()
        for key in keys_for(n):
            producer.send_in_transaction(topic, PAYLOAD, key=key, local=commit)
        elapsed = time.perf_counter() - start
    return finish(broker, topic, n, elapsed, "half messages")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    n = args.messages

    broker = redisq.connect(args.url, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    variants: dict[str, Callable[[], float]] = {
        "plain send_async + flush (baseline)": lambda: run_plain(broker, n),
        "transaction of 100 messages": lambda: run_transactions(broker, n, 100),
        "transaction of 10 messages": lambda: run_transactions(broker, n, 10),
        "transaction of 1 message": lambda: run_transactions(broker, n // 10, 1),
        "send_in_transaction (1 message, COMMIT)": lambda: run_half_messages(broker, n // 10),
    }
    medians = run_rounds(variants, args.repeat)
    base = medians["plain send_async + flush (baseline)"]
    rows = []
    for name, rate in medians.items():
        size = 100 if "100" in name else 10 if "of 10 " in name else 1
        tx_rate = "" if name.startswith("plain") else f"{rate / size:,.0f}"
        rows.append([name, f"{rate:,.0f}", tx_rate, f"{rate / base:.3f}x"])
    print(
        f"\nserver: {broker.server}; {n:,} messages of 100 B ({n // 10:,} for one-message "
        f"transactions), {PARTITIONS} partitions, median of {args.repeat}"
    )
    print_table(["variant", "msg/s", "transactions/s", "ratio to plain"], rows, args.markdown)
    client = broker.client
    for key in client.scan_iter(match=broker.keys.pattern(), count=1000):
        client.delete(key)
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
