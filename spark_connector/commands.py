"""`redisq audit order|skew|throughput|lag|content TOPIC`: run a job, print its table, write a
PNG. Exit codes: 0 clean (or done), 1 faults found (order, content), 2 could not run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

AUDIT_KINDS = {
    "order": "ordering audit: sequence gaps, duplicates, out-of-order per producer and key",
    "skew": "partition skew and hot keys",
    "throughput": "messages per second over time, per partition",
    "lag": "consumer-group lag per partition",
    "content": "duplicated and missing content: by a hash of key and value, by message id, "
    "or against a source table (--against)",
}

# Silent buckets are rows too (zeros), so a long quiet spell makes many: the terminal gets
# the first ones, the chart every one.
MAX_PRINTED_ROWS = 1000

PrintTable = Callable[[Sequence[Sequence[Any]], Sequence[str]], None]


def run_audit(args: argparse.Namespace, print_table: PrintTable, out: IO[str] | None = None) -> int:
    """0: done (order: clean), 1: the ordering audit found faults, 2: could not run (no Spark,
    Spark failed). The server, the topic and the group are checked before Spark starts: an
    unreachable server, TopicNotFound and GroupNotFound are raised (the command line turns
    them into exit 2, 3 and 3)."""
    out = out or sys.stdout
    from redisq.server.connection import resolve_url

    url, _embedded = resolve_url(args.url)  # the embedded server logs its own notice
    partitions = _check_before_spark(url, args.namespace, args.topic, args.group)
    try:
        import pyspark  # noqa: F401

        from spark_connector import jobs
        from spark_connector.session import get_session
    except ImportError as exc:
        print(
            f"redisq audit needs the [spark] extra (pip install 'redisq-broker[spark]'): {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        return _run_job(args, url, partitions, get_session, jobs, print_table, out)
    except Exception as exc:  # no JVM, a failed job: one line, not a Java stack trace
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        print(f"redisq audit: Spark failed: {type(exc).__name__}: {detail}", file=sys.stderr)
        return 2


def _check_before_spark(url: str, namespace: str, topic: str, group: str | None) -> int:
    """Seconds instead of the 20 s a Spark start takes: the server answers, the topic (and the
    group) exist. Returns the topic's partition count (skew and throughput count the empty
    ones)."""
    import redisq
    from redisq.errors import GroupNotFound
    from redisq.protocol.groups import group_exists

    with redisq.connect(url, namespace=namespace) as broker:
        config = broker.topic_config(topic, refresh=True)
        if group is not None and not broker.run(group_exists(broker.keys, topic, group)):
            raise GroupNotFound(topic, group)
        return config.partitions


def _run_job(
    args: argparse.Namespace,
    url: str,
    partitions: int,
    get_session: Any,
    jobs: Any,
    print_table: PrintTable,
    out: IO[str],
) -> int:
    spark = get_session(args.master, config={"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    kind, topic = args.audit_kind, args.topic
    plot = Path(args.plot or f"redisq-{kind}-{topic}.png")
    status = 0
    if kind == "content":
        return _content(args, spark, url, plot, print_table, out)
    if kind == "lag":
        rows = jobs.consumer_lag(spark, url, args.namespace, topic, args.group).collect()
        columns = ["partition", "group", "consumers", "pending", "lag", "last_delivered"]
        print_table([[r[c] for c in columns] for r in rows], columns)
        if not rows:
            print(
                f"no consumer groups on {topic!r}"
                + (f" named {args.group!r}" if args.group else "")
            )
        jobs.plot_lag(rows, plot, f"consumer lag of {topic}")
    else:
        df = jobs.read_topic(spark, url, args.namespace, topic)
        if kind == "order":
            result = jobs.run_ordering_audit(df)
            print_table(
                [[r[c] for c in jobs.AUDIT_COLUMNS[1:]] for r in result.rows],
                jobs.AUDIT_COLUMNS[1:],
            )
            if result.key_rows:
                print("\nkeys out of order or split over partitions:", file=out)
                print_table(
                    [
                        [_show(r.key), r.messages, r.partitions, r.out_of_order]
                        for r in result.key_rows[:20]
                    ],
                    ["key", "messages", "partitions", "out_of_order"],
                )
            print("\n" + result.verdict(topic), file=out)
            if not result.rows:
                print(
                    "no message carries a producer sequence, so this audit proves nothing about "
                    f"duplicates or losses: run `redisq audit content {topic}`",
                    file=out,
                )
            status = 0 if result.clean else 1
            jobs.plot_audit(
                result.rows, plot, f"ordering audit of {topic}", result.key_rows, result.id_rows
            )
        elif kind == "skew":
            df = df.cache()
            rows = jobs.partition_skew(df, partitions).collect()
            columns = ["partition", "messages", "bytes", "keys", "share", "vs_mean"]
            print_table([[r[c] for c in columns] for r in rows], columns)
            print("\n" + skew_verdict(rows), file=out)
            hot = jobs.hot_keys(df, args.top).collect()
            print("\nhot keys:", file=out)
            columns = ["rank", "key", "partition", "messages", "share"]
            print_table([[r[c] for c in columns] for r in hot], columns)
            jobs.plot_skew(rows, plot, f"messages per partition of {topic}")
        else:
            rows = jobs.throughput(df, args.bucket_ms, partitions).collect()
            columns = ["bucket_start", "partition", "messages", "bytes", "messages_per_s"]
            print_table([[r[c] for c in columns] for r in rows[:MAX_PRINTED_ROWS]], columns)
            if len(rows) > MAX_PRINTED_ROWS:
                print(
                    f"(the first {MAX_PRINTED_ROWS:,} of {len(rows):,} rows: the plot shows them "
                    "all; --bucket-ms makes fewer)",
                    file=out,
                )
            print("\n" + throughput_verdict(rows, args.bucket_ms), file=out)
            jobs.plot_throughput(rows, plot, f"throughput of {topic}")
    print(f"plot: {plot}", file=out)
    return status


def skew_verdict(rows: Sequence[Any]) -> str:
    """ "1,000 messages in 1 of 4 partitions (3 empty): the largest is 4.00x the mean"."""
    total = sum(int(r.messages) for r in rows)
    if not total:
        return "the topic holds no messages"
    busy = sum(1 for r in rows if r.messages)
    empty = f" ({len(rows) - busy} empty)" if busy < len(rows) else ""
    return (
        f"{total:,} messages in {busy} of {len(rows)} partitions{empty}: the largest is "
        f"{max(float(r.vs_mean) for r in rows):.2f}x the mean"
    )


def throughput_verdict(rows: Sequence[Any], bucket_ms: int) -> str:
    """ "4 buckets of 1000 ms, 2 of them silent (no message in any partition)"."""
    per_bucket: dict[int, int] = {}
    for r in rows:
        per_bucket[int(r.bucket_ms)] = per_bucket.get(int(r.bucket_ms), 0) + int(r.messages)
    if not per_bucket:
        return "no messages"
    silent = sum(1 for n in per_bucket.values() if not n)
    return (
        f"{len(per_bucket):,} buckets of {bucket_ms} ms from the first message to the last, "
        f"{silent:,} of them silent (no message in any partition, counted as 0)"
    )


def _content(
    args: argparse.Namespace,
    spark: Any,
    url: str,
    plot: Path,
    print_table: PrintTable,
    out: IO[str],
) -> int:
    from spark_connector import content_audit, jobs, plots

    topic = args.topic
    df = jobs.read_topic(spark, url, args.namespace, topic)
    against = getattr(args, "against", None)
    source = _source_table(spark, against) if against else None
    result = content_audit.run(df, by=getattr(args, "by", None) or "hash", source=source)
    print_table(
        [[r.partition, r.duplicated, r.missing] for r in result.partitions],
        ["partition", "duplicated", "missing"],
    )
    if result.samples:
        print(f"\nfaulty contents (first {len(result.samples)}):", file=out)
        print_table(
            [
                [_show(r.key), _show(r.value)[:40], r.copies, r.due, _offsets(r.offsets)]
                for r in result.samples
            ],
            ["key", "value", "copies", "due", "offsets"],
        )
    print("\n" + result.verdict(topic), file=out)
    plots.plot_content(result, plot, f"content audit of {topic}")
    print(f"plot: {plot}", file=out)
    return 0 if result.clean else 1


def _source_table(spark: Any, against: str) -> Any:
    """--against: a table name, or a file or directory (parquet, or csv/json by extension)."""
    path = Path(against)
    if not path.exists():
        return spark.table(against)
    fmt = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower(), "parquet")
    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", "true")
    return reader.load(str(path))


def _offsets(offsets: Any) -> str:
    shown = ", ".join(offsets[:3]) if offsets else "-"
    return shown + (", ..." if offsets and len(offsets) > 3 else "")


def _show(value: Any) -> str:
    if value is None:
        return "-"
    raw = bytes(value)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.hex()
