"""The skew and throughput figures with what is not there counted: pure Python over the small
aggregates the jobs collect (one row per partition, one per bucket and partition), no Spark.

A DataFrame of a topic has no row for a partition that holds no message, nor for a second in
which nothing was appended, so an aggregate of it leaves both out: 1,000 messages in 1 of 4
partitions came out as "1.00x the mean", and a chart drew a line straight across a silent
minute. Here every partition of the topic counts (0 when empty) in the mean and the shares,
and every bucket from the first message to the last is a row (0 when silent).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

# Filled rows are built in Python: a span this many buckets x partitions wide asks for a wider
# bucket instead of filling memory (a day at 1 s buckets and 8 partitions is 691,200).
MAX_FILLED_ROWS = 2_000_000


class PartitionCount(NamedTuple):
    topic: str
    partition: int
    messages: int
    bytes: int
    keys: int


class PartitionSkew(NamedTuple):
    """share: of the topic's messages; vs_mean: over the mean of every partition, the empty
    ones included (None for both when the topic holds nothing)."""

    topic: str
    partition: int
    messages: int
    bytes: int
    keys: int
    share: float | None
    vs_mean: float | None


class BucketCount(NamedTuple):
    bucket_ms: int  # the bucket's start, epoch ms (the stream IDs' time)
    partition: int
    messages: int
    bytes: int


class BucketRate(NamedTuple):
    bucket_ms: int
    partition: int
    messages: int
    bytes: int
    messages_per_s: float


def _partition_range(seen: Iterable[int], partitions: int | None) -> range:
    """0 .. partitions-1; without the count, up to the highest partition seen (an empty last
    partition cannot be told from a topic that has no such partition)."""
    highest = max(seen, default=-1)
    if partitions is None:
        return range(highest + 1)
    if partitions < 1:
        raise ValueError(f"partitions={partitions} is out of range: 1 or more")
    if highest >= partitions:
        raise ValueError(f"partition {highest} seen, but partitions={partitions}")
    return range(partitions)


def partition_skew(counts: Iterable[PartitionCount], partitions: int | None) -> list[PartitionSkew]:
    """Every partition 0..partitions-1 of each topic, an empty one as 0 messages, with its
    share of the topic and its ratio to the mean partition (the mean over every partition)."""
    by_topic: dict[str, dict[int, PartitionCount]] = {}
    for c in counts:
        by_topic.setdefault(c.topic, {})[c.partition] = c
    rows: list[PartitionSkew] = []
    for topic in sorted(by_topic):
        seen = by_topic[topic]
        every = [
            seen.get(p, PartitionCount(topic, p, 0, 0, 0))
            for p in _partition_range(seen, partitions)
        ]
        total = sum(c.messages for c in every)
        mean = total / len(every)
        for c in every:
            rows.append(
                PartitionSkew(
                    *c,
                    share=round(c.messages / total, 4) if total else None,
                    vs_mean=round(c.messages / mean, 3) if total else None,
                )
            )
    return rows


def throughput(
    counts: Iterable[BucketCount], bucket_ms: int, partitions: int | None
) -> list[BucketRate]:
    """Every bucket from the first message's to the last's, for every partition 0..partitions-1:
    a silent bucket, or a partition silent in it, is a row of 0 messages."""
    if bucket_ms < 1:
        raise ValueError(f"bucket_ms={bucket_ms} is out of range: 1 or more")
    seen = {(c.bucket_ms, c.partition): c for c in counts}
    if not seen:
        return []
    starts = [start for start, _p in seen]
    if any(start % bucket_ms for start in starts):
        raise ValueError(f"bucket starts must be multiples of bucket_ms={bucket_ms}")
    every = _partition_range((p for _s, p in seen), partitions)
    first, last = min(starts), max(starts)
    buckets = (last - first) // bucket_ms + 1
    if buckets * len(every) > MAX_FILLED_ROWS:
        span_s = (last - first + bucket_ms) / 1000
        wider = -(-(last - first + bucket_ms) * len(every) // MAX_FILLED_ROWS)
        raise ValueError(
            f"{buckets:,} buckets of {bucket_ms} ms over {span_s:,.0f} s x {len(every)} "
            f"partitions is more than {MAX_FILLED_ROWS:,} rows: use bucket_ms={wider} or more"
        )
    rows = []
    for start in range(first, last + 1, bucket_ms):
        for p in every:
            c = seen.get((start, p), BucketCount(start, p, 0, 0))
            rows.append(BucketRate(*c, messages_per_s=round(c.messages * 1000.0 / bucket_ms, 1)))
    return rows
