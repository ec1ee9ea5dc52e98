"""Spark read throughput, side by side in one run, against a single-process XRANGE scan.

    python benchmarks/spark_read.py [--url URL] [--messages N] [--master local[2]] [--repeat R]
                                    [--markdown]

One topic of N messages (default 1,000,000; 100-byte payloads, keys "key-<i % 1000>") over 8
partitions. Variants, each run R times, interleaved; the median counts:

  xrange     one Python process scans every partition with redis-py XRANGE COUNT 10000 into
             Python lists (entry id, field dict): the baseline
  broker     the same through broker.read(), which builds redisq Message objects
  spark      spark.read.format("redisq")...load().count() on --master (default local[2]);
             the first Spark read (Python worker start-up) is reported apart, as "spark cold"

The ratio column is rows/s divided by the xrange baseline of the same run. Without --url or
REDIS_URL it uses the embedded valkey-server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import redisq

PARTITIONS = 8
PAYLOAD = b"x" * 100


def load(broker: redisq.Broker, topic: str, n: int) -> None:
    broker.create_topic(topic, partitions=PARTITIONS)
    with broker.producer(max_batch_messages=1000) as producer:
        send = producer.send_async
        for i in range(n):
            send(topic, PAYLOAD, key=b"key-%d" % (i % 1000))
        producer.flush()


def scan_xrange(broker: redisq.Broker, topic: str) -> int:
    """The baseline: what a Python program reading the streams itself would do."""
    rows = 0
    client = broker.client
    for p in range(PARTITIONS):
        key = broker.keys.log(topic, p)
        cursor = "-"
        while True:
            entries = client.xrange(key, min=cursor, max="+", count=10_000)
            if not entries:
                break
            rows += len(entries)
            cursor = "(" + entries[-1][0].decode()
            if len(entries) < 10_000:
                break
    return rows


def scan_broker(broker: redisq.Broker, topic: str) -> int:
    return sum(sum(1 for _ in broker.read(topic, p, batch=10_000)) for p in range(PARTITIONS))


def spark_count(spark: object, url: str, namespace: str, topic: str) -> int:
    df = (
        spark.read.format("redisq")  # type: ignore[attr-defined]
        .option("url", url)
        .option("namespace", namespace)
        .option("subscribe", topic)
        .load()
    )
    return int(df.count())


def timed(func: object, *args: object) -> tuple[float, int]:
    start = time.perf_counter()
    rows = func(*args)  # type: ignore[operator]
    return time.perf_counter() - start, int(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    from spark_connector.session import get_session

    broker = redisq.connect(args.url or os.environ.get("REDIS_URL"), namespace="bench-spark")
    url = args.url or os.environ.get("REDIS_URL") or broker._url  # the embedded server's url
    topic = f"read-{uuid.uuid4().hex[:8]}"
    print(f"loading {args.messages:,} messages into {PARTITIONS} partitions ...", file=sys.stderr)
    start = time.perf_counter()
    load(broker, topic, args.messages)
    print(f"loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    spark = get_session(args.master, config={"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    cold_s, rows = timed(spark_count, spark, url, broker.namespace, topic)
    assert rows == args.messages, (rows, args.messages)

    results: dict[str, list[float]] = {"xrange": [], "broker": [], "spark": []}
    for _ in range(args.repeat):
        for name, run in (
            ("xrange", lambda: scan_xrange(broker, topic)),
            ("broker", lambda: scan_broker(broker, topic)),
            ("spark", lambda: spark_count(spark, url, broker.namespace, topic)),
        ):
            seconds, rows = timed(run)
            assert rows == args.messages, (name, rows)
            results[name].append(args.messages / seconds)

    base = statistics.median(results["xrange"])
    table = [
        ("xrange (1 Python process, redis-py)", base),
        ("broker.read() (1 Python process, Message objects)", statistics.median(results["broker"])),
        (f"spark {args.master} count()", statistics.median(results["spark"])),
        (f"spark {args.master} count(), first read (cold)", args.messages / cold_s),
    ]
    print(
        f"\n{args.messages:,} messages, {PARTITIONS} partitions, {len(PAYLOAD)}-byte values, "
        f"{broker.server}, median of {args.repeat}, {os.cpu_count()} cores"
    )
    if args.markdown:
        print("\n| reader | rows/s | ratio |\n| --- | ---: | ---: |")
        for name, rate in table:
            print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")
    else:
        for name, rate in table:
            print(f"{name:<52} {rate:>12,.0f} rows/s  {rate / base:5.2f}x")
    broker.delete_topic(topic)
    broker.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
