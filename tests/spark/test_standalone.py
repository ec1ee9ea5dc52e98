"""The connector on a real Spark cluster: a standalone master and two 1-core workers on loopback
(tests/spark/standalone.py), drivers in their own processes.

The writes go through a shuffle (repartition(8, "key")), where a retried task receives its rows
in another order; the checker compares the topic with the source row for row (a multiset of
key/value), not only counts."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

import redisq  # noqa: E402
from tests.conftest import drop_namespace  # noqa: E402
from tests.spark.fixtures import HELD_PID_KEY, transaction_states  # noqa: E402
from tests.spark.standalone import StandaloneCluster, driver, expected_content  # noqa: E402

pytestmark = pytest.mark.spark

ROWS = 40_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    started = StandaloneCluster(tmp_path_factory.mktemp("standalone")).start()
    yield started
    started.stop()


@pytest.fixture
def broker(valkey_server: Any) -> Iterator[redisq.Broker]:
    b = redisq.connect(valkey_server.url, namespace=f"sa{uuid.uuid4().hex[:10]}")
    b.create_topic("out", partitions=4)
    yield b
    drop_namespace(b)
    b.close()


def run_job(
    cluster: StandaloneCluster,
    broker: redisq.Broker,
    job: str,
    rows: int = ROWS,
    during: Any = None,
) -> dict[str, Any]:
    url = broker_url(broker)
    process = driver(job, cluster.url, url, broker.namespace, rows, cluster.workdir)
    if during is not None:
        during(process)
    out, _ = process.communicate(timeout=420)
    log = cluster.workdir / f"driver-{job}.log"
    assert process.returncode == 0, log.read_text()[-4000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def broker_url(broker: redisq.Broker) -> str:
    kwargs = broker.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"


def content(broker: redisq.Broker) -> Counter[tuple[bytes | None, bytes]]:
    return Counter((m.key, m.value) for p in range(4) for m in broker.read("out", p))


def registered_attempts(broker: redisq.Broker) -> int:
    pattern = f"{broker.namespace}:{{~tx:spark~*}}:record"
    return sum(
        sum(1 for f in broker.client.hkeys(k) if f.startswith(b"attempt:"))
        for k in broker.client.scan_iter(match=pattern)
    )


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


def test_write_with_injected_task_failures_on_the_cluster(
    cluster: StandaloneCluster, broker: redisq.Broker
) -> None:
    rows = 16_000
    run_job(cluster, broker, "write-fail", rows=rows)
    assert dict(content(broker)) == expected_content(rows)
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


def test_the_cluster_fixture_stops_what_it_started(tmp_path: Path) -> None:
    small = StandaloneCluster(tmp_path, workers=1).start()
    pids = [p.pid for p in small.processes]
    small.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
