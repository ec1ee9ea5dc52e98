"""A consumer process for the multi-process tests: `python -m tests.consumer_worker ...`.

Every handler call pushes a start event and an end event onto one Redis list, so the list's order
is the true order of events across processes (Redis serialises the pushes):
    S <member> <partition> <key> <n> <offset> <unix time>
    E <member> <partition> <key> <n> <offset> <unix time>
On SIGTERM it closes the consumer and pushes "X <member> <fenced acks> <leases lost>".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

import redisq


def events_key(namespace: str) -> str:
    """The test's event list (test bookkeeping, inside the test's namespace)."""
    return f"{namespace}:test-events"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--lease-ttl-ms", type=int, default=1500)
    parser.add_argument("--sleep", type=float, default=0.005, help="handler time per message")
    parser.add_argument("--key-concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    level = logging.INFO if os.environ.get("REDISQ_TEST_VERBOSE") else logging.WARNING
    logging.basicConfig(level=level, format=f"{args.name} %(asctime)s %(name)s: %(message)s")

    broker = redisq.connect(args.url, namespace=args.namespace)
    events = events_key(args.namespace)
    client = broker.client

    def handle(message: redisq.Message) -> None:
        record = json.loads(message.value)
        where = f"{args.name} {message.partition} {record['k']} {record['n']} {message.offset}"
        client.rpush(events, f"S {where} {time.time():.6f}")
        time.sleep(args.sleep)
        client.rpush(events, f"E {where} {time.time():.6f}")

    consumer = broker.consumer(
        args.topic,
        args.group,
        args.name,
        lease_ttl_ms=args.lease_ttl_ms,
        key_concurrency=args.key_concurrency,
        batch_size=20,
        ack_interval_ms=20,
    )
    stop = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    runner = threading.Thread(target=consumer.run, args=(handle,), daemon=True)
    runner.start()
    client.rpush(events, f"R {args.name} {time.time():.6f}")
    while not stop.is_set() and runner.is_alive():
        stop.wait(0.1)
    consumer.close()
    runner.join(10)
    stats = consumer.stats
    client.rpush(events, f"X {args.name} {stats.fenced_acks} {stats.leases_lost}")
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
