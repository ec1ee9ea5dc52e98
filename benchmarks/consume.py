"""Consume throughput and latency, side by side in one run, against raw redis-py XREADGROUP.

    python benchmarks/consume.py [--url URL] [--messages N] [--repeat R] [--rates 1000,50000]
                                 [--markdown]

One topic of 8 partitions holds N messages (100-byte payloads, keys "key-<i % 1000>"). Each
variant reads all of it with a fresh group, in one process, with a no-op handler:
  raw             redis-py XREADGROUP COUNT 1000 + XACK per batch, the partitions in turn
  orderly         redisq orderly consumer, run(handler): leases, fenced range reads, the
                  position committed every ack_interval_ms, a thread per partition
  concurrent      redisq concurrent consumer, run(handler): XACK + XREADGROUP pipelined, a
                  thread per partition
  poll + ack      orderly, poll(max_messages=1000) in the caller's thread, then ack(batch), or
                  ack(message) for each message (each ack moves the position; the commit is
                  coalesced, within ack_interval_ms)
  asyncio         the same run() rows on redisq.asyncio with an async no-op handler (a plain
                  function handler runs in a worker thread per call: use a coroutine function)
Each runs R times, interleaved; the median counts; the ratio is to raw of the same run, and
ack(message) is also shown against ack(batch).

Latency: for each rate in --rates, a producer (idempotence="sequence", linger_ms=0) sends
rate msg/s for --seconds while a consumer runs; each handler call records now - send time (the
value carries it), after one untimed warm-up message has gone through (the producer's scripts
loaded and its epoch taken, the consumer reading). p50/p99 in ms. The producer sends what is
due every millisecond (a sleep per message cannot pace 50,000 msg/s).
Without --url or REDIS_URL it uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import threading
import time
import uuid
from typing import Any

import redis
from report import print_table, ratio_rows, run_rounds

import redisq
import redisq.asyncio as redisq_asyncio

PARTITIONS = 8
PAYLOAD = b"x" * 100
WARM_UP = b"warm-up"  # the latency tests' first message, not timed
RAW = "raw XREADGROUP COUNT 1000 + XACK per batch"
ORDERLY = "redisq orderly, run(handler)"
CONCURRENT = "redisq concurrent, run(handler)"
POLL_BATCH = "redisq orderly, poll(1000) + ack(batch)"
POLL_EACH = "redisq orderly, poll(1000) + ack(message) each"
ASYNC_ORDERLY = "redisq.asyncio orderly, run(async handler)"
ASYNC_CONCURRENT = "redisq.asyncio concurrent, run(async handler)"
GOALS = {ORDERLY: ">= 1.5x", CONCURRENT: ">= 0.8x", ASYNC_ORDERLY: ">= 1.5x"}


def fill(broker: redisq.Broker, topic: str, n: int, entry_format: str = "message") -> None:
    broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
    with broker.producer(idempotence=None) as producer:
        for i in range(n):
            producer.send_async(topic, PAYLOAD, key=b"key-%d" % (i % 1000))
    total = sum(1 for p in range(PARTITIONS) for _ in broker.read(topic, p))
    if total != n:
        raise SystemExit(f"filled {total} messages, expected {n}")


def run_raw(broker: redisq.Broker, topic: str, n: int) -> float:
    """The baseline: XREADGROUP COUNT 1000 then XACK of the batch, partition after partition."""
    client: redis.Redis = broker.client
    group = f"raw-{uuid.uuid4().hex[:6]}"
    streams = [broker.keys.log(topic, p) for p in range(PARTITIONS)]
    for stream in streams:
        client.xgroup_create(stream, group, id="0")
    read = 0
    start = time.perf_counter()
    while read < n:
        for stream in streams:
            reply = client.xreadgroup(group, "raw", {stream: ">"}, count=1000)
            if reply:
                entries = reply[0][1]
                for _entry_id, _fields in entries:
                    pass
                client.xack(stream, group, *[entry_id for entry_id, _ in entries])
                read += len(entries)
    elapsed = time.perf_counter() - start
    for stream in streams:
        client.xgroup_destroy(stream, group)
    return n / elapsed


def wait_for_assignment(consumer: Any) -> None:
    """Let the member take its leases first: the benchmark measures reading, not joining."""
    deadline = time.monotonic() + 10
    while len(consumer.assignment) < PARTITIONS and time.monotonic() < deadline:
        time.sleep(0.01)


def run_redisq(broker: redisq.Broker, topic: str, n: int, mode: str) -> float:
    group = f"{mode}-{uuid.uuid4().hex[:6]}"
    counter = itertools.count(1)  # next() is atomic under the GIL: handlers run in threads
    done = threading.Event()
    finished_at = [0.0]

    def noop(message: redisq.Message) -> None:
        if next(counter) == n:
            finished_at[0] = time.perf_counter()
            done.set()

    consumer = broker.consumer(topic, group, mode=mode, batch_size=1000)
    wait_for_assignment(consumer)
    runner = threading.Thread(target=consumer.run, args=(noop,), daemon=True)
    start = time.perf_counter()
    runner.start()
    if not done.wait(300):
        raise SystemExit(f"{mode}: not every message was handled")
    consumer.close()
    runner.join(30)
    broker.delete_group(topic, group)
    return n / (finished_at[0] - start)


def run_poll(broker: redisq.Broker, topic: str, n: int, each: bool) -> float:
    group = f"poll-{uuid.uuid4().hex[:6]}"
    got = 0
    with broker.consumer(topic, group, mode="orderly", batch_size=1000) as consumer:
        wait_for_assignment(consumer)
        start = time.perf_counter()
        deadline = time.monotonic() + 300
        while got < n and time.monotonic() < deadline:
            messages = consumer.poll(timeout=1.0, max_messages=1000)
            if each:
                for message in messages:
                    consumer.ack(message)
            elif messages:
                consumer.ack(messages)
            got += len(messages)
        elapsed = time.perf_counter() - start
    broker.delete_group(topic, group)
    if got != n:
        raise SystemExit(f"poll: read {got} of {n}")
    return n / elapsed


def run_asyncio(url: str | None, namespace: str, topic: str, n: int, mode: str) -> float:
    async def main() -> float:
        broker = await redisq_asyncio.connect(url, namespace=namespace)
        counter = itertools.count(1)
        finished_at = [0.0]

        async def noop(message: redisq.Message) -> None:
            if next(counter) == n:
                finished_at[0] = time.perf_counter()

        try:
            group = f"aio-{mode}-{uuid.uuid4().hex[:6]}"
            consumer = broker.consumer(topic, group, mode=mode, batch_size=1000)
            start = time.perf_counter()
            await consumer.run(noop, idle_timeout=2.0)
            if not finished_at[0]:
                raise SystemExit(f"asyncio {mode}: not every message was handled")
            return n / (finished_at[0] - start)
        finally:
            await broker.close()

    return asyncio.run(main())


def run_latency(
    broker: redisq.Broker, mode: str, rate: int, seconds: float, entry_format: str = "message"
) -> tuple[float, float]:
    """p50 and p99 in ms of send -> handler at `rate` msg/s, on a topic of this entry format."""
    topic = f"lat-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
    latencies: list[float] = []
    lock = threading.Lock()

    warmed = threading.Event()

    def handler(message: redisq.Message) -> None:
        now = time.time()
        if message.value == WARM_UP:
            warmed.set()
            return
        with lock:
            latencies.append(now - float(message.value))

    consumer = broker.consumer(topic, "lat", mode=mode, start="latest")
    runner = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    runner.start()
    wait_for_assignment(consumer)
    total = int(rate * seconds)
    with broker.producer(idempotence="sequence", linger_ms=0) as producer:
        # Untimed: the producer's first send loads its scripts and takes its epoch (on a fresh
        # server); the figures are of the steady state.
        producer.send(topic, WARM_UP, key=b"key-0")
        if not warmed.wait(30):
            raise SystemExit(f"latency {mode}: the warm-up message was not handled")
        start = time.perf_counter()
        sent = 0
        while sent < total:
            due = min(total, int((time.perf_counter() - start) * rate) + 1)
            while sent < due:
                producer.send_async(topic, repr(time.time()), key=b"key-%d" % (sent % 1000))
                sent += 1
            time.sleep(0.001)
        producer.flush()
    wait_until = time.monotonic() + 30
    while len(latencies) < total and time.monotonic() < wait_until:
        time.sleep(0.05)
    consumer.close()
    runner.join(30)
    broker.delete_topic(topic)
    ordered = sorted(latencies)
    if len(ordered) != total:
        raise SystemExit(f"latency {mode}: handled {len(ordered)} of {total}")
    p50 = ordered[len(ordered) // 2] * 1000
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return p50, p99


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rates", default="1000,50000", help="latency tests: msg/s, comma list")
    parser.add_argument("--seconds", type=float, default=5.0, help="latency test: duration")
    parser.add_argument("--no-asyncio", action="store_true", help="leave out the asyncio rows")
    parser.add_argument("--entry-format", default="message", choices=["message", "batch"])
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)

    broker = redisq.connect(args.url, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    url = args.url  # None: the asyncio rows find the same embedded server
    topic = f"bench-{uuid.uuid4().hex[:6]}"
    print(f"filling {args.messages:,} messages into {PARTITIONS} partitions...", file=sys.stderr)
    fill(broker, topic, args.messages, args.entry_format)
    raw_topic = topic  # raw XREADGROUP reads one entry per message: a message-format copy
    if args.entry_format != "message":
        raw_topic = f"{topic}-raw"
        fill(broker, raw_topic, args.messages)
    n = args.messages
    variants = {
        RAW: lambda: run_raw(broker, raw_topic, n),
        ORDERLY: lambda: run_redisq(broker, topic, n, "orderly"),
        CONCURRENT: lambda: run_redisq(broker, topic, n, "concurrent"),
        POLL_BATCH: lambda: run_poll(broker, topic, n, each=False),
        POLL_EACH: lambda: run_poll(broker, topic, n, each=True),
    }
    if not args.no_asyncio:
        variants[ASYNC_ORDERLY] = lambda: run_asyncio(url, broker.namespace, topic, n, "orderly")
        variants[ASYNC_CONCURRENT] = lambda: run_asyncio(
            url, broker.namespace, topic, n, "concurrent"
        )
    medians = run_rounds(variants, args.repeat)
    rates = [int(r) for r in args.rates.split(",") if r]
    latency = {}
    for rate in rates:
        for mode in ("orderly", "concurrent"):
            latency[rate, mode] = run_latency(broker, mode, rate, args.seconds, args.entry_format)
            p50, p99 = latency[rate, mode]
            print(f"  latency {mode} at {rate:,} msg/s: p50 {p50:.2f} ms, p99 {p99:.2f} ms",
                  file=sys.stderr)  # fmt: skip
    broker.delete_topic(topic)
    if raw_topic != topic:
        broker.delete_topic(raw_topic)

    print(
        f"\nserver: {broker.server}; {args.messages:,} messages of 100 B, {PARTITIONS} partitions, "
        f"one process, median of {args.repeat}"
    )
    print_table(["variant", "msg/s", "ratio to raw", "goal"], ratio_rows(medians, RAW, GOALS),
                args.markdown)  # fmt: skip
    each, batch = medians[POLL_EACH], medians[POLL_BATCH]
    print_table(
        ["ack one at a time", "msg/s", "ratio to ack(batch)", "goal"],
        [[POLL_EACH, f"{each:,.0f}", f"{each / batch:.2f}x", ">= 0.5x"]],
        args.markdown,
    )
    goals = {1000: 5.0, 50_000: 20.0}
    print_table(
        ["end-to-end latency (send -> handler)", "p50", "p99", "goal p99"],
        [
            [
                f"{mode} at {rate:,} msg/s",
                f"{p50:.2f} ms",
                f"{p99:.2f} ms",
                f"<= {goals[rate]:g} ms" if rate in goals else "",
            ]
            for (rate, mode), (p50, p99) in latency.items()
        ],  # fmt: skip
        args.markdown,
    )
    for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
        broker.client.delete(key)  # the benchmark's namespace: counters, group registries
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
