"""The connector on a real Spark cluster (tests/spark/test_standalone.py has the killed
executor): each write task's first attempt failing after it staged rows, and redisq shipped as a
zip to workers whose Python cannot import it, then read by a job on the cluster. The written
topic is compared with the source row for row (a multiset of key/value), not only counts."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.standalone_fixtures)

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("pyspark")

import redisq  # noqa: E402
from tests.spark.fixtures import transaction_states  # noqa: E402
from tests.spark.standalone import StandaloneCluster, expected_content  # noqa: E402
from tests.spark.standalone_fixtures import ROWS, broker, cluster, content, run_job  # noqa: E402, F401

pytestmark = pytest.mark.spark


def test_write_with_injected_task_failures_on_the_cluster(
    cluster: StandaloneCluster, broker: redisq.Broker
) -> None:
    run_job(cluster, broker, "write-fail")
    assert dict(content(broker)) == expected_content(ROWS)
    assert Counter(transaction_states(broker).values()) == Counter({"committed": 8, "aborted": 8})


def test_read_on_the_cluster_and_redisq_shipped_as_a_zip(
    cluster: StandaloneCluster, broker: redisq.Broker
) -> None:
    # Workers whose Python cannot import the installed redisq get it from a zip (addPyFile).
    rows = 8_000
    result = run_job(cluster, broker, "zip-write", rows=rows)
    assert ".zip" in result["worker_redisq"]
    assert dict(content(broker)) == expected_content(rows)
    counted = run_job(cluster, broker, "read")
    import zlib

    values = [m.value for p in range(4) for m in broker.read("out", p)]
    assert counted["count"] == rows
    assert counted["checksum"] == sum(zlib.crc32(v) for v in values)
