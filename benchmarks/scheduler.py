"""Delayed messages: the scheduler's delivery lag at a sustained rate, and delayed against plain
send throughput, side by side in one run.

    python benchmarks/scheduler.py [--url URL] [--seconds S] [--rates 1000,10000] [--markdown]

Lag: one producer sends delayed messages (100-byte payloads, 4 partitions, keys "key-<i % 1000>",
delay 1 s) at each rate for S seconds, paced in 10 ms steps; the lag of a message is the time in
its stream entry ID (when it was appended) minus its due time (from its RecordMetadata), both
from the server's clock. Two runners: `redisq scheduler` in a process of its own (started first,
so it holds the leases), and the producer's own scheduler thread (in the sending process).
Throughput: N messages through send_async + flush, plain and with delay_ms=60000 (stored, not
delivered during the run), interleaved rounds, median; the ratio column is to plain send.
Without --url or REDIS_URL it uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

from report import print_table, ratio_rows, run_rounds

import redisq

PARTITIONS = 4
PAYLOAD = b"x" * 100
DELAY_MS = 1000


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def start_scheduler_process(url: str | None, namespace: str, topic: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "redisq.cli", "scheduler", "--topic", topic]
    command += ["--namespace", namespace] + (["--url", url] if url else [])
    child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    child.stderr.readline()  # "delivering delayed messages of ..." once it runs
    return child


def run_lag(broker: redisq.Broker, url: str | None, rate: int, seconds: float, runner: str) -> dict:
    """Send at `rate` for `seconds`, wait for every message, measure the lag of each."""
    topic = f"lag-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=PARTITIONS)
    child = start_scheduler_process(url, broker.namespace, topic) if runner == "process" else None
    if child is not None:  # its leases first: the producer's own scheduler only knocks
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not broker.client.exists(
            broker.keys.scheduler_lease(topic, PARTITIONS - 1)
        ):
            time.sleep(0.01)
    total = int(rate * seconds)
    step = rate // 100  # messages per 10 ms
    futures = []
    try:
        with broker.producer() as producer:
            start = time.perf_counter()
            for i in range(0, total, step):
                for j in range(i, min(total, i + step)):
                    futures.append(
                        producer.send_async(
                            topic, b"%d" % j + PAYLOAD, key=b"key-%d" % (j % 1000),
                            delay_ms=DELAY_MS,
                        )
                    )  # fmt: skip
                pause = start + (i + step) / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            sent_s = time.perf_counter() - start
            due = {}
            for j, future in enumerate(futures):
                due[b"%d" % j] = future.result(timeout=60).deliver_at_ms
            deadline = time.monotonic() + 60
            while broker.describe_topic(topic).total_messages < total:
                if time.monotonic() > deadline:
                    raise SystemExit(f"rate {rate}: not every message was delivered")
                time.sleep(0.05)
    finally:
        if child is not None:
            child.terminate()
            child.wait(10)
    lags = []
    for p in range(PARTITIONS):
        for message in broker.read(topic, p):
            index = message.value[: -len(PAYLOAD)]
            lags.append(message.timestamp_ms - due[index])
    broker.delete_topic(topic)
    if len(lags) != total or len(set(due)) != total:
        raise SystemExit(f"rate {rate}: {len(lags)} delivered of {total}")
    return {
        "rate": total / sent_s,
        "p50": percentile(lags, 0.50),
        "p99": percentile(lags, 0.99),
        "max": float(max(lags)),
        "mean": statistics.mean(lags),
        "early": sum(1 for lag in lags if lag < 0),
    }


def run_send(broker: redisq.Broker, n: int, delay_ms: int | None) -> float:
    topic = f"send-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=PARTITIONS)
    with broker.producer() as producer:
        start = time.perf_counter()
        send = producer.send_async
        for i in range(n):
            send(topic, PAYLOAD, key=b"key-%d" % (i % 1000), delay_ms=delay_ms)
        producer.flush()
        elapsed = time.perf_counter() - start
    described = broker.describe_topic(topic)
    stored = described.total_scheduled if delay_ms else described.total_messages
    broker.delete_topic(topic)
    if stored != n:
        raise SystemExit(f"delay_ms={delay_ms}: {stored} stored, expected {n}")
    return n / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="1000,10000")
    parser.add_argument("--messages", type=int, default=200_000, help="for the send throughput")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    url = args.url or os.environ.get("REDIS_URL")

    broker = redisq.connect(url, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    rows = []
    for rate in (int(r) for r in args.rates.split(",")):
        for runner, label in (("process", "redisq scheduler process"), ("own", "producer's own")):
            print(f"  lag at {rate:,} msg/s, {label} ...", file=sys.stderr)
            r = run_lag(broker, url, rate, args.seconds, runner)
            rows.append(
                [
                    f"{rate:,} msg/s, {label}",
                    f"{r['rate']:,.0f}",
                    f"{r['p50']:.0f}",
                    f"{r['p99']:.0f}",
                    f"{r['max']:.0f}",
                    str(r["early"]),
                ]
            )
    print(
        f"\nserver: {broker.server}; delay {DELAY_MS} ms, {args.seconds:g} s per rate, "
        f"{PARTITIONS} partitions; lag = stream entry ID time - due time (server clock)"
    )
    print_table(
        ["scheduled rate, runner", "sent msg/s", "lag p50 ms", "lag p99 ms", "max ms", "early"],
        rows,
        args.markdown,
    )

    variants = {
        "plain send_async": lambda: run_send(broker, args.messages, None),
        "delayed send_async (delay_ms=60000)": lambda: run_send(broker, args.messages, 60_000),
    }
    medians = run_rounds(variants, args.repeat)
    print(
        f"\n{args.messages:,} messages of 100 B, {PARTITIONS} partitions, median of {args.repeat}"
    )
    print_table(
        ["variant", "msg/s", "ratio to plain"],
        ratio_rows(medians, "plain send_async"),
        args.markdown,
    )
    for key in broker.client.scan_iter(match=broker.keys.pattern(), count=1000):
        broker.client.delete(key)
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
