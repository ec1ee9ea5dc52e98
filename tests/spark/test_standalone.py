"""The connector on a real Spark cluster: a standalone master and two 1-core workers on loopback
(tests/spark/standalone.py), drivers in their own processes; an executor killed mid-write here,
injected task failures and redisq shipped as a zip in tests/spark/test_standalone_retries.py (a
module each, so xdist runs them side by side, each with its own cluster).

The writes go through a shuffle (repartition(8, "key")), where a retried task receives its rows
in another order; the checker compares the topic with the source row for row (a multiset of
key/value), not only counts."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.standalone_fixtures)

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

import redisq  # noqa: E402
from tests.spark.fixtures import HELD_PID_KEY, transaction_states  # noqa: E402
from tests.spark.standalone import StandaloneCluster, expected_content  # noqa: E402
from tests.spark.standalone_fixtures import ROWS, broker, cluster, content, run_job  # noqa: E402, F401

pytestmark = pytest.mark.spark


def test_write_after_a_shuffle_with_an_executor_killed_holds_each_row_once(
    cluster: StandaloneCluster, broker: redisq.Broker
) -> None:
    """Task 0's first attempt holds still once it has staged rows (a UDF in the test's job);
    the executor running it is SIGKILLed then: Spark runs the task again elsewhere, the dead
    attempt's staged rows are aborted, and the topic holds every row once."""
    killed: list[int] = []
    held_key = f"{broker.namespace}:{HELD_PID_KEY}"

    def kill_the_held_executor(process: Any) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            held = broker.client.get(held_key)
            if held is not None:
                executor = cluster.executor_of(int(held))
                os.kill(executor, signal.SIGKILL)
                killed.append(executor)
                return
            time.sleep(0.1)

    result = run_job(cluster, broker, "write-held", during=kill_the_held_executor)
    assert killed, "no attempt was held for the kill"
    assert dict(content(broker)) == expected_content(ROWS)
    states = Counter(transaction_states(broker).values())
    assert "open" not in states and states["aborted"] >= 1  # the killed attempt's staged rows
    assert states["committed"] == 8
    print(f"write with a killed executor: {result}, transactions {dict(states)}")


def test_the_cluster_fixture_stops_what_it_started(tmp_path: Path) -> None:
    small = StandaloneCluster(tmp_path, workers=1).start()
    pids = [p.pid for p in small.processes]
    small.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
