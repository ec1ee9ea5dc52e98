"""Analysis jobs on topics (DESIGN §5): each a function that returns a DataFrame, and a plot.

    from spark_connector import get_session, jobs
    spark = get_session()
    df = jobs.read_topic(spark, "redis://localhost:6379", "rq", "orders")
    jobs.ordering_audit(df).show()        # per producer and partition: gaps, duplicates, order
    jobs.key_order_audit(df).show()       # per key: out-of-order, keys split over partitions
    jobs.partition_skew(df, partitions=4).show(); jobs.hot_keys(df).show()
    jobs.throughput(df, bucket_ms=1000, partitions=4).show()  # silent buckets as zeros
    jobs.consumer_lag(spark, url, "rq", "orders").show()

The ordering audit reads the producer id (field p) and sequence (field s) that idempotent
producers store with every message (the Spark writer's transactions carry none: check their
topics with spark_connector.content_audit). Sequences count per (producer, partition) from 0;
a new epoch of a named producer starts again at 0, so a
0 after higher numbers opens a new run and is not counted as a fault (the one blind spot: a
duplicate of sequence 0 looks the same). Within a run:
  gaps          sequence numbers missing between the run's lowest and highest
  duplicates    messages whose sequence number already appeared in the run
  out_of_order  messages whose sequence is below one appended before them (and not a duplicate)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spark_connector import counts
from spark_connector.offsets import count_end, next_id

# The charts of these jobs (spark_connector.plots), re-exported.
from spark_connector.plots import plot_audit, plot_lag, plot_skew, plot_throughput  # noqa: F401

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("redisq.spark.jobs")

AUDIT_COLUMNS = [
    "topic",
    "partition",
    "producer_id",
    "messages",
    "runs",
    "first_sequence",
    "last_sequence",
    "gaps",
    "duplicates",
    "out_of_order",
]


def read_topic(
    spark: SparkSession,
    url: str,
    namespace: str,
    topic: str,
    *,
    include_metadata: bool = True,
    **options: str,
) -> DataFrame:
    """A batch DataFrame of the whole topic (earliest to latest), with producer metadata."""
    reader = (
        spark.read.format("redisq")
        .option("url", url)
        .option("namespace", namespace)
        .option("subscribe", topic)
        .option("includeMetadata", str(include_metadata).lower())
    )
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load()


def _with_runs(df: DataFrame) -> DataFrame:
    """Rows with a sequence, numbered into runs per (producer, partition) in offset order."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = df.where(F.col("producer_id").isNotNull() & F.col("sequence").isNotNull())
    order = Window.partitionBy("topic", "partition", "producer_id").orderBy(
        "offset_ms", "offset_seq"
    )
    prev = F.lag("sequence").over(order)
    restart = (F.col("sequence") == 0) & prev.isNotNull() & (prev > 0)
    rows = rows.withColumn("_restart", restart.cast("int"))
    rows = rows.withColumn("run", F.sum("_restart").over(order))
    in_run = Window.partitionBy("topic", "partition", "producer_id", "run").orderBy(
        "offset_ms", "offset_seq"
    )
    before = in_run.rowsBetween(Window.unboundedPreceding, -1)
    same_seq = Window.partitionBy("topic", "partition", "producer_id", "run", "sequence").orderBy(
        "offset_ms", "offset_seq"
    )
    rows = rows.withColumn("_seen", F.row_number().over(same_seq) > 1)
    rows = rows.withColumn("_max_before", F.max("sequence").over(before))
    return rows.withColumn(
        "_late", (~F.col("_seen")) & (F.col("sequence") < F.col("_max_before"))
    ).drop("_restart")


def ordering_audit(df: DataFrame) -> DataFrame:
    """Per (topic, partition, producer): messages, runs, gaps, duplicates, out_of_order."""
    from pyspark.sql import functions as F

    rows = _with_runs(df)
    per_run = rows.groupBy("topic", "partition", "producer_id", "run").agg(
        F.count("*").alias("messages"),
        F.countDistinct("sequence").alias("distinct"),
        F.min("sequence").alias("low"),
        F.max("sequence").alias("high"),
        F.sum(F.col("_late").cast("int")).alias("late"),
    )
    return (
        per_run.groupBy("topic", "partition", "producer_id")
        .agg(
            F.sum("messages").alias("messages"),
            F.count("*").alias("runs"),
            F.min_by("low", "run").alias("first_sequence"),
            F.max_by("high", "run").alias("last_sequence"),
            F.sum(F.col("high") - F.col("low") + 1 - F.col("distinct")).alias("gaps"),
            F.sum(F.col("messages") - F.col("distinct")).alias("duplicates"),
            F.sum("late").alias("out_of_order"),
        )
        .select(*AUDIT_COLUMNS)
        .orderBy("topic", "partition", "producer_id")
    )


def key_order_audit(df: DataFrame) -> DataFrame:
    """Per key: messages, partitions it was written to (more than one breaks per-key order
    across them), and messages that came after a later one of the same producer run."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    keyed = df.where(F.col("key").isNotNull())
    spread = keyed.groupBy("key").agg(
        F.count("*").alias("messages"), F.countDistinct("partition").alias("partitions")
    )
    rows = _with_runs(keyed)
    key_order = Window.partitionBy("key", "partition", "producer_id", "run").orderBy(
        "offset_ms", "offset_seq"
    )
    before = key_order.rowsBetween(Window.unboundedPreceding, -1)
    late = (
        rows.withColumn(
            "_key_late", (~F.col("_seen")) & (F.col("sequence") < F.max("sequence").over(before))
        )
        .groupBy("key")
        .agg(F.sum(F.col("_key_late").cast("int")).alias("out_of_order"))
    )
    return (
        spread.join(late, "key", "left")
        .select(
            "key",
            "messages",
            "partitions",
            F.coalesce("out_of_order", F.lit(0)).alias("out_of_order"),
        )
        .orderBy(F.desc("out_of_order"), F.desc("partitions"), "key")
    )


def message_id_duplicates(df: DataFrame) -> DataFrame:
    """Per partition: messages carrying a message id, and ids that appear more than once."""
    from pyspark.sql import functions as F

    rows = df.where(F.col("message_id").isNotNull())
    return (
        rows.groupBy("topic", "partition")
        .agg(
            F.count("*").alias("messages"),
            (F.count("*") - F.countDistinct("message_id")).alias("duplicate_ids"),
        )
        .orderBy("topic", "partition")
    )


def partition_skew(df: DataFrame, partitions: int | None = None) -> DataFrame:
    """Per partition: messages, bytes, keys, share of the topic and ratio to the mean partition.

    partitions: the topic's partition count. An empty partition has no row in df, so only
    this count puts it in (0 messages, in the mean: 1,000 messages in 1 of 4 partitions is
    4.00x the mean). Without it, partitions up to the highest one seen are counted."""
    from pyspark.sql import functions as F

    size = F.coalesce(F.length("value"), F.lit(0)) + F.coalesce(F.length("key"), F.lit(0))
    per = df.groupBy("topic", "partition").agg(
        F.count("*").alias("messages"),
        F.sum(size).alias("bytes"),
        F.countDistinct("key").alias("keys"),
    )
    tallied = [
        counts.PartitionCount(r.topic, int(r.partition), int(r.messages), int(r.bytes), int(r.keys))
        for r in per.collect()
    ]
    rows = counts.partition_skew(tallied, partitions)
    return df.sparkSession.createDataFrame(rows, SKEW_SCHEMA).orderBy("topic", "partition")


SKEW_SCHEMA = (
    "topic string, partition int, messages long, bytes long, keys long, share double, "
    "vs_mean double"
)


def hot_keys(df: DataFrame, top: int = 10) -> DataFrame:
    """The keys with the most messages, with their partition and share of the topic."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    per = df.where(F.col("key").isNotNull()).groupBy("topic", "key", "partition").count()
    total = df.count()
    ranked = per.withColumn(
        "rank", F.row_number().over(Window.orderBy(F.desc("count"), "key"))
    ).where(F.col("rank") <= top)
    return ranked.select(
        "rank",
        "topic",
        F.col("key").cast("string").alias("key"),
        "partition",
        F.col("count").alias("messages"),
        F.round(F.col("count") / F.lit(max(total, 1)), 4).alias("share"),
    ).orderBy("rank")


def throughput(df: DataFrame, bucket_ms: int = 1000, partitions: int | None = None) -> DataFrame:
    """Messages and bytes appended per time bucket and partition (by the stream IDs' time).

    Every bucket from the first message's to the last's is a row for every partition, 0 when
    nothing was appended in it: a silent second is a zero, not a line drawn across it.
    partitions: the topic's partition count (without it, up to the highest one seen)."""
    from pyspark.sql import functions as F

    if bucket_ms < 1:
        raise ValueError(f"bucket_ms={bucket_ms} is out of range: 1 or more")
    bucket = (F.floor(F.col("offset_ms") / bucket_ms) * bucket_ms).cast("long")
    size = F.coalesce(F.length("value"), F.lit(0)) + F.coalesce(F.length("key"), F.lit(0))
    per = (
        df.withColumn("bucket_ms", bucket)
        .groupBy("bucket_ms", "partition")
        .agg(F.count("*").alias("messages"), F.sum(size).alias("bytes"))
    )
    tallied = [
        counts.BucketCount(int(r.bucket_ms), int(r.partition), int(r.messages), int(r.bytes))
        for r in per.collect()
    ]
    rows = counts.throughput(tallied, bucket_ms, partitions)
    return (
        df.sparkSession.createDataFrame(rows, THROUGHPUT_SCHEMA)
        .withColumn("bucket_start", F.timestamp_millis("bucket_ms"))
        .select("bucket_start", "bucket_ms", "partition", "messages", "bytes", "messages_per_s")
        .orderBy("bucket_ms", "partition")
    )


THROUGHPUT_SCHEMA = (
    "bucket_ms long, partition int, messages long, bytes long, messages_per_s double"
)


LAG_SCHEMA = (
    "topic string, partition int, group string, consumers int, pending long, "
    "last_delivered string, entries_read long, lag long, partition_end string, length long"
)


def consumer_lag(
    spark: SparkSession, url: str, namespace: str, topic: str, group: str | None = None
) -> DataFrame:
    """Per consumer group and partition: pending (delivered, not acked), lag (not delivered
    yet) and positions, from XINFO GROUPS on each partition stream (what ordinary Redis tools
    show). When Redis cannot tell the lag (after XDEL), it is counted with count_range.lua.
    On a topic of batch entries, pending, entries_read and length count stream entries (one
    per producer batch) and lag counts messages, as describe_group tells it (DESIGN §14.6)."""
    import redisq

    rows: list[tuple[Any, ...]] = []
    with redisq.connect(url, namespace=namespace) as broker:
        config = broker.topic_config(topic, refresh=True)
        lags = _message_lags(broker, topic) if config.entry_format == "batch" else {}
        for p in range(config.partitions):
            key = broker.keys.log(topic, p)
            info = broker.client.xinfo_stream(key)
            last = _text(info.get("last-generated-id", b"0-0"))
            for g in broker.client.xinfo_groups(key):
                name = _text(g.get("name"))
                if group is not None and name != group:
                    continue
                delivered = _text(g.get("last-delivered-id", b"0-0"))
                lag = lags.get((name, p), g.get("lag"))
                if lag is None:
                    count, _ = broker.scripts.call(
                        "count_range",
                        [key],
                        ["(" + delivered, count_end(next_id(last)), 1 << 62],
                        topic=topic,
                    )
                    lag = int(count)
                rows.append(
                    (
                        topic,
                        p,
                        name,
                        int(g.get("consumers", 0)),
                        int(g.get("pending", 0)),
                        delivered,
                        None if g.get("entries-read") is None else int(g["entries-read"]),
                        int(lag),
                        last,
                        int(info.get("length", 0)),
                    )
                )
    return spark.createDataFrame(rows, LAG_SCHEMA).orderBy("group", "partition")


def _message_lags(broker: Any, topic: str) -> dict[tuple[str, int], int]:
    """(group, partition) -> the messages a group of a batch topic has still to read (groups
    redisq knows; a Redis consumer group made by another tool keeps XINFO's entry count)."""
    lags: dict[tuple[str, int], int] = {}
    for _, group in broker.list_groups(topic):
        for p in broker.describe_group(topic, group).partitions:
            if p.lag is not None:
                lags[(group, p.partition)] = p.lag
    return lags


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- verdicts and plots ------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditResult:
    rows: list[Any]
    key_rows: list[Any]
    id_rows: list[Any]
    messages: int

    @property
    def gaps(self) -> int:
        return sum(int(r.gaps or 0) for r in self.rows)

    @property
    def duplicates(self) -> int:
        return sum(int(r.duplicates or 0) for r in self.rows) + sum(
            int(r.duplicate_ids or 0) for r in self.id_rows
        )

    @property
    def out_of_order(self) -> int:
        return sum(int(r.out_of_order or 0) for r in self.rows)

    @property
    def key_out_of_order(self) -> int:
        return sum(int(r.out_of_order or 0) for r in self.key_rows)

    @property
    def split_keys(self) -> int:
        return sum(1 for r in self.key_rows if r.partitions > 1)

    @property
    def clean(self) -> bool:
        return not (
            self.gaps
            or self.duplicates
            or self.out_of_order
            or self.key_out_of_order
            or self.split_keys
        )

    def verdict(self, topic: str) -> str:
        audited = sum(int(r.messages) for r in self.rows)
        producers = len({r.producer_id for r in self.rows})
        head = (
            f"Spark ordering audit of {topic!r}: {self.messages:,} messages, {audited:,} with "
            f"producer sequences from {producers} producer(s)"
        )
        if self.clean:
            return head + ": CLEAN (no sequence gaps, duplicates or out-of-order messages)"
        return head + (
            f": NOT CLEAN: {self.gaps} missing sequence numbers, {self.duplicates} duplicates, "
            f"{self.out_of_order} out of order, {self.key_out_of_order} out of order within a "
            f"key, {self.split_keys} keys split over partitions"
        )


def run_ordering_audit(df: DataFrame) -> AuditResult:
    """The ordering audit collected: per-producer rows, keys with faults, message-id dups."""
    from pyspark.sql import functions as F

    df = df.cache()
    try:
        return AuditResult(
            rows=ordering_audit(df).collect(),
            key_rows=key_order_audit(df)
            .where((F.col("out_of_order") > 0) | (F.col("partitions") > 1))
            .collect(),
            id_rows=message_id_duplicates(df).collect(),
            messages=df.count(),
        )
    finally:
        df.unpersist()


def demo_audit(url: str, namespace: str, topic: str) -> tuple[bool, str]:
    """Run the ordering audit on a topic with a local Spark; (clean?, a printable verdict).

    Called at the end of `redisq demo`. Needs the [spark] extra and Java."""
    from spark_connector.session import get_session

    spark = get_session(config={"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    result = run_ordering_audit(read_topic(spark, url, namespace, topic))
    return result.clean, result.verdict(topic)
