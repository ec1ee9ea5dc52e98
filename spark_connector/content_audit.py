"""The content audit: duplicated and missing messages, whatever wrote them (a data-quality gate).

Producer sequences only prove what a sequence-numbered producer did; a topic written by a
buggy job, by producers without idempotence, or by the Spark writer (whose transactions carry
no sequences) needs its content checked:

    by="hash"        a message whose key and value repeat an earlier one's (sha-256 of both) is a
                     duplicate: the gate for topics whose messages are unique by content;
    by="message_id"  a message id that appears more than once;
    source=DataFrame rows of the topic against a source table with key and value columns, as
                     multisets: copies beyond the source's are duplicated, copies short of it
                     missing (a missing keyed row is placed in the partition its key routes to).

    from spark_connector import content_audit, jobs
    result = content_audit.run(jobs.read_topic(spark, url, "rq", "orders"), by="hash")
    result.clean, result.duplicated, result.missing, result.partitions, result.samples
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

BY = ("hash", "message_id")
SAMPLES = 20


@dataclass(frozen=True)
class ContentResult:
    by: str  # "hash", "message_id" or "source"
    messages: int  # in the topic
    expected: int | None  # rows of the source, if one was given
    duplicated: int  # extra copies (a row written 3 times where 1 was due: 2)
    missing: int  # copies short of the source
    partitions: list[Any]  # per partition: partition, duplicated, missing
    samples: list[Any]  # up to SAMPLES faulty contents: key, value, copies, due, partitions

    @property
    def clean(self) -> bool:
        return not (self.duplicated or self.missing)

    def verdict(self, topic: str) -> str:
        against = (
            f" against a source of {self.expected:,} rows"
            if self.expected is not None
            else f" by {self.by.replace('_', ' ')}"
        )
        head = f"Spark content audit of {topic!r}{against}: {self.messages:,} messages"
        if self.clean:
            return head + ": CLEAN (no duplicated or missing content)"
        where = ", ".join(
            f"p{r.partition}: {r.duplicated} dup/{r.missing} missing"
            for r in self.partitions
            if r.duplicated or r.missing
        )
        return head + (
            f": NOT CLEAN: {self.duplicated:,} duplicated, {self.missing:,} missing ({where})"
        )


def run(df: DataFrame, by: str = "hash", source: DataFrame | None = None) -> ContentResult:
    """The audit, collected. df: the topic (jobs.read_topic, with metadata for message_id)."""
    from pyspark.sql import functions as F

    if by not in BY:
        raise ValueError(f"by={by!r}: choose one of {BY}")
    topic = df.select(
        "partition",
        "offset",
        "offset_ms",
        "offset_seq",
        F.col("key").cast("binary").alias("key"),
        F.col("value").cast("binary").alias("value"),
        *(["message_id"] if by == "message_id" and source is None else []),
    ).cache()
    try:
        messages = topic.count()
        if source is not None:
            return _against(topic, source, messages)
        return _repeats(topic, by, messages)
    finally:
        topic.unpersist()


def _identity(by: str) -> Any:
    from pyspark.sql import functions as F

    if by == "message_id":
        return F.col("message_id")
    # A hash of each, so ("ab", "c") and ("a", "bc") differ; a null key differs from "".
    key = F.coalesce(F.sha2(F.col("key"), 256), F.lit("-"))
    return F.concat(key, F.lit(":"), F.sha2(F.col("value"), 256))


def _repeats(topic: DataFrame, by: str, messages: int) -> ContentResult:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = topic.where(F.col("message_id").isNotNull()) if by == "message_id" else topic
    rows = rows.withColumn("_id", _identity(by))
    # Every copy after the first (in partition and offset order) is a duplicate, where it is.
    first_copy = Window.partitionBy("_id").orderBy("partition", "offset_ms", "offset_seq")
    extras = rows.withColumn("_copy", F.row_number().over(first_copy)).where(F.col("_copy") > 1)
    per_partition = (
        extras.groupBy("partition")
        .agg(F.count("*").alias("duplicated"))
        .withColumn("missing", F.lit(0))
        .orderBy("partition")
        .collect()
    )
    samples = (
        rows.groupBy("_id")
        .agg(
            F.count("*").alias("copies"),
            F.first("key").alias("key"),
            F.first("value").alias("value"),
            F.sort_array(F.collect_set("partition")).alias("partitions"),
            F.sort_array(F.collect_list("offset")).alias("offsets"),
        )
        .where(F.col("copies") > 1)
        .select("key", "value", "copies", F.lit(1).alias("due"), "partitions", "offsets")
        .orderBy(F.desc("copies"), "key")
        .limit(SAMPLES)
        .collect()
    )
    duplicated = sum(int(r.duplicated) for r in per_partition)
    return ContentResult(by, messages, None, duplicated, 0, per_partition, samples)


def _against(topic: DataFrame, source: DataFrame, messages: int) -> ContentResult:
    from pyspark.sql import functions as F

    columns = {c.lower(): c for c in source.columns}
    if "value" not in columns:
        raise ValueError(f"the source needs a value column (it has {source.columns})")
    source_rows = source.select(
        (
            F.col(columns["key"]).cast("binary") if "key" in columns else F.lit(None).cast("binary")
        ).alias("key"),
        F.col(columns["value"]).cast("binary").alias("value"),
    ).withColumn("_id", _identity("hash"))
    due = source_rows.groupBy("_id").agg(
        F.count("*").alias("due"), F.first("key").alias("key"), F.first("value").alias("value")
    )
    got = (
        topic.withColumn("_id", _identity("hash"))
        .groupBy("_id")
        .agg(
            F.count("*").alias("copies"),
            F.first("key").alias("tkey"),
            F.first("value").alias("tvalue"),
            F.sort_array(F.collect_set("partition")).alias("partitions"),
            F.sort_array(F.collect_list("offset")).alias("offsets"),
        )
    )
    both = (
        due.join(got, "_id", "full_outer")
        .select(
            F.coalesce("key", "tkey").alias("key"),
            F.coalesce("value", "tvalue").alias("value"),
            F.coalesce("copies", F.lit(0)).alias("copies"),
            F.coalesce("due", F.lit(0)).alias("due"),
            "partitions",
            "offsets",
        )
        .where(F.col("copies") != F.col("due"))
        .cache()
    )
    try:
        totals: Any = both.agg(
            F.sum(F.greatest(F.col("copies") - F.col("due"), F.lit(0))).alias("duplicated"),
            F.sum(F.greatest(F.col("due") - F.col("copies"), F.lit(0))).alias("missing"),
        ).first()
        expected = source_rows.count()
        partitions = _placed(both, topic)
        samples = both.orderBy(F.desc(F.abs(F.col("copies") - F.col("due")))).limit(SAMPLES)
        sample_rows = samples.collect()
    finally:
        both.unpersist()
    return ContentResult(
        "source",
        messages,
        expected,
        int(totals.duplicated or 0),
        int(totals.missing or 0),
        partitions,
        sample_rows,
    )


def _placed(both: DataFrame, topic: DataFrame) -> list[Any]:
    """Faults per partition: a duplicate where its copies are, a missing keyed row where its key
    routes (crc32(key) % partitions, the producer's partitioner), a missing keyless one at -1."""
    from pyspark.sql import functions as F

    highest: Any = topic.agg(F.max("partition")).first()
    count = highest[0]
    partitions = (count or 0) + 1
    dup = both.where(F.col("copies") > F.col("due")).select(
        F.col("partitions")[0].alias("partition"),
        (F.col("copies") - F.col("due")).alias("duplicated"),
        F.lit(0).alias("missing"),
    )
    miss = both.where(F.col("copies") < F.col("due")).select(
        F.when(F.col("key").isNull(), F.lit(-1))
        .otherwise(F.crc32("key") % partitions)
        .cast("int")
        .alias("partition"),
        F.lit(0).alias("duplicated"),
        (F.col("due") - F.col("copies")).alias("missing"),
    )
    return (
        dup.unionByName(miss)
        .groupBy("partition")
        .agg(F.sum("duplicated").alias("duplicated"), F.sum("missing").alias("missing"))
        .orderBy("partition")
        .collect()
    )
