"""Spark read throughput, side by side in one run, against a single-process XRANGE scan.

    python benchmarks/spark_read.py [--url URL] [--messages N] [--master local[2]] [--repeat R]
                                    [--formats message,batch] [--markdown]

One topic of N messages per entry format (default 1,000,000; 100-byte payloads, keys
"key-<i % 1000>") over 8 partitions, written by the producer in batches of up to 1,000: a
"message" topic holds one entry per message, a "batch" topic one entry per producer batch
(DESIGN §14). Variants, each run R times, interleaved; the median counts:

  xrange     one Python process scans every partition with redis-py XRANGE COUNT 10000 into
             Python lists (entry id, field dict): the baseline
  broker     the same through broker.read(), which builds redisq Message objects
  spark      spark.read.format("redisq")...load().count() on --master (default local[2]);
             the first Spark read (Python worker start-up) is reported apart, as "spark cold"
broker and spark run on each format's topic; xrange on the message topic (on a batch topic it
would count entries, not messages).

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


def load(broker: redisq.Broker, topic: str, n: int, entry_format: str = "message") -> None:
    broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
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
    parser.add_argument("--formats", default="message,batch")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    formats = args.formats.split(",")

    from spark_connector.session import get_session

    broker = redisq.connect(args.url or os.environ.get("REDIS_URL"), namespace="bench-spark")
    url = args.url or os.environ.get("REDIS_URL") or broker._url  # the embedded server's url
    topics = {f: f"read-{f}-{uuid.uuid4().hex[:8]}" for f in formats}
    for entry_format, topic in topics.items():
        print(
            f"loading {args.messages:,} messages into {PARTITIONS} partitions "
            f"({entry_format} entries) ...",
            file=sys.stderr,
        )
        start = time.perf_counter()
        load(broker, topic, args.messages, entry_format)
        print(f"loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    spark = get_session(args.master, config={"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    first = next(iter(topics.values()))
    cold_s, rows = timed(spark_count, spark, url, broker.namespace, first)
    assert rows == args.messages, (rows, args.messages)

    runs: list[tuple[str, object]] = []
    if "message" in topics:
        runs.append(("xrange", lambda t=topics["message"]: scan_xrange(broker, t)))
    for entry_format, topic in topics.items():
        runs.append((f"broker {entry_format}", lambda t=topic: scan_broker(broker, t)))
        runs.append(
            (f"spark {entry_format}", lambda t=topic: spark_count(spark, url, broker.namespace, t))
        )
    results: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(args.repeat):
        for name, run in runs:
            seconds, rows = timed(run)
            assert rows == args.messages, (name, rows)
            results[name].append(args.messages / seconds)

    base = statistics.median(results["xrange"]) if "xrange" in results else float("nan")
    table = [("xrange (1 Python process, redis-py), message topic", base)]
    for entry_format in topics:
        table += [
            (
                f"broker.read() (1 process, Message objects), {entry_format} topic",
                statistics.median(results[f"broker {entry_format}"]),
            ),
            (
                f"spark {args.master} count(), {entry_format} topic",
                statistics.median(results[f"spark {entry_format}"]),
            ),
        ]
    table.append(
        (f"spark {args.master} count(), first read (cold), {formats[0]}", args.messages / cold_s)
    )
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
            print(f"{name:<64} {rate:>12,.0f} rows/s  {rate / base:5.2f}x")
    for topic in topics.values():
        broker.delete_topic(topic)
    broker.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
