"""Consume throughput and latency, side by side in one run, against raw redis-py XREADGROUP.

    python benchmarks/consume.py [--url URL] [--messages N] [--repeat R] [--markdown]

One topic of 8 partitions holds N messages (100-byte payloads, keys "key-<i % 1000>"). Each
variant reads all of it with a fresh group, in one process, with a no-op handler:
  raw          redis-py XREADGROUP COUNT 1000 + XACK per batch, the partitions in turn
  orderly      redisq orderly consumer: leases, fenced ack+read script, a thread per partition
  concurrent   redisq concurrent consumer: XACK + XREADGROUP pipelined, a thread per partition
Each runs R times, interleaved; the median counts; the ratio is to raw of the same run.

Latency: a producer sends at --rate msg/s (default 1,000) for --seconds while a consumer runs;
each handler call records now - send time (the value carries it). p50/p99 in ms.
Without --url or REDIS_URL it uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid

import redis
from report import print_table, ratio_rows, run_rounds

import redisq

PARTITIONS = 8
PAYLOAD = b"x" * 100


def fill(broker: redisq.Broker, topic: str, n: int) -> None:
    broker.create_topic(topic, partitions=PARTITIONS)
    with broker.producer(idempotence=None) as producer:
        for i in range(n):
            producer.send_async(topic, PAYLOAD, key=b"key-%d" % (i % 1000))
    total = broker.describe_topic(topic).total_messages
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


def run_redisq(broker: redisq.Broker, topic: str, n: int, mode: str) -> float:
    group = f"{mode}-{uuid.uuid4().hex[:6]}"
    count = [0]
    done = threading.Event()
    finished_at = [0.0]

    def noop(message: redisq.Message) -> None:
        count[0] += 1  # the GIL makes this safe enough for a benchmark counter
        if count[0] >= n and not done.is_set():
            finished_at[0] = time.perf_counter()
            done.set()

    consumer = broker.consumer(topic, group, mode=mode, batch_size=1000)
    # Let the member take its leases first: the benchmark measures reading, not joining.
    deadline = time.monotonic() + 10
    while len(consumer.assignment) < PARTITIONS and time.monotonic() < deadline:
        time.sleep(0.01)
    runner = threading.Thread(target=consumer.run, args=(noop,), daemon=True)
    start = time.perf_counter()
    runner.start()
    if not done.wait(300):
        raise SystemExit(f"{mode}: handled {count[0]} of {n}")
    consumer.close()
    runner.join(30)
    from redisq.group import delete_group

    delete_group(broker, topic, group)
    return n / (finished_at[0] - start)


def run_latency(broker: redisq.Broker, mode: str, rate: int, seconds: float) -> tuple[float, float]:
    """p50 and p99 in ms of send -> handler at `rate` msg/s."""
    topic = f"lat-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=PARTITIONS)
    latencies: list[float] = []
    lock = threading.Lock()

    def handler(message: redisq.Message) -> None:
        now = time.time()
        with lock:
            latencies.append(now - float(message.value))

    consumer = broker.consumer(topic, "lat", mode=mode, start="latest")
    runner = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    runner.start()
    deadline = time.monotonic() + 10
    while len(consumer.assignment) < PARTITIONS and time.monotonic() < deadline:
        time.sleep(0.01)
    total = int(rate * seconds)
    with broker.producer(idempotence="sequence", linger_ms=0) as producer:
        start = time.perf_counter()
        for i in range(total):
            target = start + i / rate
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            producer.send_async(topic, repr(time.time()), key=b"key-%d" % (i % 1000))
        producer.flush()
    wait_until = time.monotonic() + 30
    while len(latencies) < total and time.monotonic() < wait_until:
        time.sleep(0.05)
    consumer.close()
    runner.join(30)
    broker.delete_topic(topic)
    ordered = sorted(latencies)
    if not ordered:
        raise SystemExit(f"latency {mode}: nothing handled")
    p50 = ordered[len(ordered) // 2] * 1000
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return p50, p99


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000, help="latency test: msg/s")
    parser.add_argument("--seconds", type=float, default=5.0, help="latency test: duration")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)

    broker = redisq.connect(args.url, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    topic = f"bench-{uuid.uuid4().hex[:6]}"
    print(f"filling {args.messages:,} messages into {PARTITIONS} partitions...", file=sys.stderr)
    fill(broker, topic, args.messages)
    raw_name = "raw XREADGROUP COUNT 1000 + XACK per batch"
    variants = {
        raw_name: lambda: run_raw(broker, topic, args.messages),
        "redisq orderly (no-op handler)": lambda: run_redisq(
            broker, topic, args.messages, "orderly"
        ),
        "redisq concurrent (no-op handler)": lambda: run_redisq(
            broker, topic, args.messages, "concurrent"
        ),
    }
    goals = {raw_name: "", "redisq orderly (no-op handler)": ">= 0.6x",
             "redisq concurrent (no-op handler)": ">= 0.8x"}  # fmt: skip
    medians = run_rounds(variants, args.repeat)
    latency = {}
    for mode in ("orderly", "concurrent"):
        latency[mode] = run_latency(broker, mode, args.rate, args.seconds)
        print(f"  latency {mode}: p50 {latency[mode][0]:.2f} ms, p99 {latency[mode][1]:.2f} ms",
              file=sys.stderr)  # fmt: skip
    broker.delete_topic(topic)

    print(
        f"\nserver: {broker.server}; {args.messages:,} messages of 100 B, {PARTITIONS} partitions, "
        f"one process, median of {args.repeat}"
    )
    print_table(
        ["variant", "msg/s", "ratio to raw", "goal"],
        ratio_rows(medians, raw_name, goals),
        args.markdown,
    )
    print_table(
        [f"end-to-end latency at {args.rate:,} msg/s", "p50", "p99"],
        [[mode, f"{p50:.2f} ms", f"{p99:.2f} ms"] for mode, (p50, p99) in latency.items()],
        args.markdown,
    )
    for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
        broker.client.delete(key)  # the benchmark's namespace: counters, group registries
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
