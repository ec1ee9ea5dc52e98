"""Spark read and write throughput per core, and Python worker memory, side by side in one run
with a single Python process (XRANGE scan; the redisq producer).

    python benchmarks/spark_scale.py [--url URL] [--messages N] [--no-standalone]
                                     [--fetch-count 10000] [--markdown]

One topic of N messages (default 1,000,000; 100-byte values, keys "key-<i % 1000>") over 16
partitions, on --url or REDIS_URL, else on a throwaway valkey-server of its own. Variants:

  python xrange      one process scans every partition with XRANGE COUNT 10000 (the baseline)
  python produce     one process writes the N rows with the redisq producer (write baseline)
  local[2] read      spark.read.format("redisq")...count(), 2 cores in one JVM
  local[2] write     the topic read and written to a second topic (transactions, the default)
  standalone read    the same on a standalone cluster: master + 2 workers of 1 core
  standalone write   (tests/spark/standalone.py starts it on loopback and stops it)

Peak RSS is the largest Python worker (pyspark.daemon and its forks) seen during the job,
sampled every 100 ms; the "(10 rows)" line is a worker that read almost nothing (the
interpreter, pyspark and pyarrow). Per core: rows/s divided by the cores the job ran on.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redisq  # noqa: E402

PARTITIONS = 16
PAYLOAD = b"x" * 100


class WorkerMemory:
    """Peak RSS of Python worker processes (pyspark.daemon / worker), sampled in a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                    if b"pyspark.daemon" not in cmdline and b"pyspark/daemon" not in cmdline:
                        continue
                    for line in (entry / "status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
                except OSError:
                    continue
            self._stop.wait(0.1)


def load(broker: redisq.Broker, topic: str, n: int) -> float:
    broker.create_topic(topic, partitions=PARTITIONS)
    started = time.perf_counter()
    with broker.producer(max_batch_messages=1000) as producer:
        send = producer.send_async
        for i in range(n):
            send(topic, PAYLOAD, key=b"key-%d" % (i % 1000))
        producer.flush()
    return time.perf_counter() - started


def scan_xrange(broker: redisq.Broker, topic: str) -> int:
    rows = 0
    for p in range(PARTITIONS):
        key = broker.keys.log(topic, p)
        cursor = "-"
        while True:
            entries = broker.client.xrange(key, min=cursor, max="+", count=10_000)
            rows += len(entries)
            if len(entries) < 10_000:
                break
            cursor = "(" + entries[-1][0].decode()
    return rows


def spark_jobs(
    spark: Any, url: str, namespace: str, n: int, fetch: int, label: str, cores: int
) -> list[tuple[str, float, int, int]]:
    options = {"url": url, "namespace": namespace}
    reader = spark.read.format("redisq").options(subscribe="src", fetchCount=str(fetch), **options)
    with WorkerMemory() as idle:
        reader.load().limit(10).count()  # Python workers started: their size with nothing read
    results = [(f"{label} (10 rows)", 0.0, cores, idle.peak)]
    with WorkerMemory() as memory:
        started = time.perf_counter()
        count = reader.load().count()
        seconds = time.perf_counter() - started
    assert count == n, (count, n)
    results.append((f"{label} read", seconds, cores, memory.peak))
    topic = f"dst-{uuid.uuid4().hex[:6]}"
    with redisq.connect(url, namespace=namespace) as broker:
        broker.create_topic(topic, partitions=PARTITIONS)
    with WorkerMemory() as memory:
        started = time.perf_counter()
        reader.load().select("key", "value").write.format("redisq").options(
            topic=topic, **options
        ).mode("append").save()
        seconds = time.perf_counter() - started
    with redisq.connect(url, namespace=namespace) as broker:
        written = broker.describe_topic(topic).total_messages
    assert written == n, (written, n)
    results.append((f"{label} write", seconds, cores, memory.peak))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--fetch-count", type=int, default=10_000)
    parser.add_argument("--no-standalone", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    namespace = f"bench{uuid.uuid4().hex[:6]}"
    server = None
    if args.url is None:  # a throwaway server of its own: millions of messages, then gone
        from tests.servers import ServerProcess

        server = ServerProcess().start()
    url = args.url or server.url  # type: ignore[union-attr]
    broker = redisq.connect(url, namespace=namespace)
    n = args.messages
    rows: list[tuple[str, float, int, int]] = []
    try:
        produce_s = load(broker, "src", n)
        rows.append(("python produce", produce_s, 1, 0))
        started = time.perf_counter()
        assert scan_xrange(broker, "src") == n
        rows.append(("python xrange", time.perf_counter() - started, 1, 0))

        from spark_connector.session import get_session

        config = {
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.driver.memory": "2g",
        }
        spark = get_session("local[2]", app_name="bench-local", config=config)
        spark.sparkContext.setLogLevel("ERROR")
        rows += spark_jobs(spark, url, namespace, n, args.fetch_count, "local[2]", 2)
        spark.stop()
        if not args.no_standalone:
            from tests.spark.standalone import StandaloneCluster

            cluster = StandaloneCluster(Path(tempfile.mkdtemp()), memory="2g").start()
            try:
                remote = {
                    **config,
                    "spark.executor.memory": "1g",
                    "spark.cores.max": "2",
                    "spark.driver.host": "127.0.0.1",
                    "spark.driver.bindAddress": "127.0.0.1",
                    "spark.ui.enabled": "false",
                }
                spark = get_session(
                    cluster.url, app_name="bench-standalone", config=remote, python=sys.executable
                )
                spark.sparkContext.setLogLevel("ERROR")
                rows += spark_jobs(spark, url, namespace, n, args.fetch_count, "standalone", 2)
                spark.stop()
            finally:
                cluster.stop()
    finally:
        if server is not None:
            broker.close()
            server.stop()
        else:
            for key in broker.client.scan_iter(match=f"{namespace}:*", count=1000):
                broker.client.delete(key)
            broker.close()
    report(rows, n, args.markdown)


def report(rows: list[tuple[str, float, int, int]], n: int, markdown: bool) -> None:
    base = {"read": None, "write": None}
    for name, seconds, _, _ in rows:
        if name == "python xrange":
            base["read"] = n / seconds
        if name == "python produce":
            base["write"] = n / seconds
    header = ["variant", "seconds", "rows/s", "rows/s per core", "vs 1 process", "peak worker RSS"]
    lines = []
    for name, seconds, cores, peak in rows:
        if not seconds:
            lines.append([name, "-", "-", "-", "-", f"{peak / 2**20:,.0f} MB"])
            continue
        rate = n / seconds
        kind = "write" if ("write" in name or "produce" in name) else "read"
        ratio = rate / base[kind] if base[kind] else float("nan")
        lines.append(
            [
                name,
                f"{seconds:.1f}",
                f"{rate:,.0f}",
                f"{rate / cores:,.0f}",
                f"{ratio:.2f}x",
                f"{peak / 2**20:,.0f} MB" if peak else "-",
            ]
        )
    print(f"{n:,} messages of {len(PAYLOAD)} B over {PARTITIONS} partitions")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + " --- |" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    main()
