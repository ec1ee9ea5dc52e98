"""`redisq audit skew|throughput` end to end count what is not there (issue 36.3): 1,000 messages
in 1 of 4 partitions is 4.00x the mean, and seconds with no message are zero buckets."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import redisq
from redisq.cli import main as cli_main
from tests.spark.fixtures import broker_url, spark, spark_broker  # noqa: F401

pytestmark = pytest.mark.spark


def test_skew_and_throughput_count_empty_partitions_and_silent_seconds(
    spark: Any, spark_broker: redisq.Broker, tmp_path: Path, capsys: Any
) -> None:
    from spark_connector import jobs

    spark_broker.create_topic("lopsided", partitions=4)
    log = spark_broker.keys.log("lopsided", 2)
    # Stream IDs chosen by hand: 999 messages in second 1000, one in second 1003; 1001 and 1002
    # are silent, partitions 0, 1 and 3 empty.
    for i in range(999):
        spark_broker.client.xadd(log, {"k": f"k{i % 7}", "v": "x"}, id=f"1000000-{i + 1}")
    spark_broker.client.xadd(log, {"k": "k0", "v": "x"}, id="1003500-0")
    common = ["--url", broker_url(spark_broker), "--namespace", spark_broker.namespace]

    assert cli_main(["audit", "skew", "lopsided", *common, "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "1,000 messages in 1 of 4 partitions (3 empty): the largest is 4.00x the mean" in out

    plot = tmp_path / "t.png"
    assert cli_main(["audit", "throughput", "lopsided", *common, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "4 buckets of 1000 ms from the first message to the last, 2 of them silent" in out
    assert plot.stat().st_size > 1000

    df = jobs.read_topic(spark, broker_url(spark_broker), spark_broker.namespace, "lopsided")
    rates = jobs.throughput(df, 1000, partitions=4).collect()
    assert len(rates) == 4 * 4
    assert [r.messages for r in rates if r.partition == 2] == [999, 0, 0, 1]
    assert {r.messages for r in rates if r.partition != 2} == {0}
