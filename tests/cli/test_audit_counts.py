"""Skew and throughput count what is not there (issue 36.3): an empty partition is 0 in the mean,
a silent bucket is a row of zeros, in the pure computation (spark_connector.counts), in the
verdict lines `redisq audit` prints and in the throughput chart. No Spark, no server."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from spark_connector import counts
from spark_connector.commands import skew_verdict, throughput_verdict
from spark_connector.counts import BucketCount, PartitionCount


def test_an_empty_partition_counts_zero_in_the_mean() -> None:
    rows = counts.partition_skew([PartitionCount("t", 2, 1000, 9000, 7)], partitions=4)
    assert [(r.partition, r.messages, r.bytes, r.keys) for r in rows] == [
        (0, 0, 0, 0),
        (1, 0, 0, 0),
        (2, 1000, 9000, 7),
        (3, 0, 0, 0),
    ]
    assert [r.vs_mean for r in rows] == [0.0, 0.0, 4.0, 0.0]
    assert [r.share for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert skew_verdict(rows) == (
        "1,000 messages in 1 of 4 partitions (3 empty): the largest is 4.00x the mean"
    )


def test_skew_without_the_count_fills_up_to_the_highest_partition_seen() -> None:
    seen = [PartitionCount("t", 0, 30, 0, 1), PartitionCount("t", 2, 10, 0, 1)]
    rows = counts.partition_skew(seen, partitions=None)
    assert [(r.partition, r.messages, r.vs_mean) for r in rows] == [
        (0, 30, 2.25),
        (1, 0, 0.0),
        (2, 10, 0.75),
    ]
    with pytest.raises(ValueError, match="partition 2 seen, but partitions=2"):
        counts.partition_skew(seen, partitions=2)


def test_a_topic_with_no_message_has_no_ratio() -> None:
    rows = counts.partition_skew([], partitions=3)
    assert rows == []  # no row names the topic: nothing to fill
    assert skew_verdict(rows) == "the topic holds no messages"


def test_silent_buckets_are_zero_rows_for_every_partition() -> None:
    seen = [
        BucketCount(1000, 0, 5, 50),
        BucketCount(1000, 1, 3, 30),
        BucketCount(4000, 0, 2, 20),
    ]
    rows = counts.throughput(seen, bucket_ms=1000, partitions=3)
    assert [(r.bucket_ms, r.partition, r.messages, r.messages_per_s) for r in rows] == [
        (1000, 0, 5, 5.0),
        (1000, 1, 3, 3.0),
        (1000, 2, 0, 0.0),
        (2000, 0, 0, 0.0),
        (2000, 1, 0, 0.0),
        (2000, 2, 0, 0.0),
        (3000, 0, 0, 0.0),
        (3000, 1, 0, 0.0),
        (3000, 2, 0, 0.0),
        (4000, 0, 2, 2.0),
        (4000, 1, 0, 0.0),
        (4000, 2, 0, 0.0),
    ]
    assert throughput_verdict(rows, 1000) == (
        "4 buckets of 1000 ms from the first message to the last, 2 of them silent (no message "
        "in any partition, counted as 0)"
    )
    assert counts.throughput([], 1000, 3) == []


def test_throughput_refuses_a_span_too_wide_to_fill() -> None:
    seen = [BucketCount(0, 0, 1, 1), BucketCount(86_400_000, 0, 1, 1)]
    assert len(counts.throughput(seen, 1000, 1)) == 86_401
    with pytest.raises(ValueError, match="use bucket_ms=44 or more"):
        counts.throughput(seen, 1, 1)
    with pytest.raises(ValueError, match="multiples of bucket_ms=1000"):
        counts.throughput([BucketCount(1500, 0, 1, 1)], 1000, 1)


def test_the_throughput_chart_draws_silent_buckets_as_zero() -> None:
    pytest.importorskip("matplotlib")
    from spark_connector import plots

    seen = [BucketCount(1000, 0, 5, 50), BucketCount(4000, 0, 2, 20)]
    rows = [
        _row(r, bucket_start=datetime.fromtimestamp(r.bucket_ms / 1000, UTC))
        for r in counts.throughput(seen, 1000, 2)
    ]
    ax = plots.throughput_figure(rows, "throughput of t").axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines == {"partition 0": [5.0, 0.0, 0.0, 2.0], "partition 1": [0.0] * 4}


class _Row(dict[str, Any]):
    """As a Spark Row: r.messages and r["messages"]."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _row(rate: counts.BucketRate, **more: Any) -> Any:
    return _Row(**rate._asdict(), **more)


def test_the_audit_command_passes_the_partition_count_and_prints_the_first_rows(
    tmp_path: Any,
) -> None:
    """spark_connector.commands._run_job with the jobs stood in for (no Spark): skew and
    throughput get the topic's partition count; a long quiet spell prints 1,000 rows, not all."""
    import argparse
    import io
    from types import SimpleNamespace

    from spark_connector import commands

    calls: list[tuple[str, Any]] = []
    seen = [BucketCount(0, 0, 1, 1), BucketCount(999_000, 0, 1, 1)]
    rates = [
        _row(r, bucket_start=datetime.fromtimestamp(r.bucket_ms / 1000, UTC))
        for r in counts.throughput(seen, 1000, 2)
    ]

    class Rows:
        def __init__(self, rows: list[Any]) -> None:
            self.rows = rows

        def collect(self) -> list[Any]:
            return self.rows

    def throughput(df: Any, bucket_ms: int, partitions: int) -> Rows:
        calls.append(("throughput", partitions))
        return Rows(rates)

    jobs = SimpleNamespace(
        read_topic=lambda *a: None, throughput=throughput, plot_throughput=lambda *a: None
    )
    session = SimpleNamespace(sparkContext=SimpleNamespace(setLogLevel=lambda level: None))
    printed: list[int] = []
    out = io.StringIO()
    args = argparse.Namespace(
        audit_kind="throughput",
        topic="t",
        namespace="n",
        plot=str(tmp_path / "t.png"),
        master=None,
        bucket_ms=1000,
        group=None,
    )
    status = commands._run_job(
        args,
        "redis://x",
        2,
        lambda *a, **k: session,
        jobs,
        lambda rows, columns: printed.append(len(rows)),
        out,
    )
    assert status == 0 and calls == [("throughput", 2)]
    assert len(rates) == 2000 and printed == [1000]
    assert "(the first 1,000 of 2,000 rows: the plot shows them all" in out.getvalue()
    assert "1,000 buckets of 1000 ms from the first message to the last, 998 of them silent" in (
        out.getvalue()
    )
