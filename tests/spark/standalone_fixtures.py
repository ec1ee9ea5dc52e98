"""Fixtures of the standalone-cluster tests (tests/spark/test_standalone*.py): one cluster per
test module, so xdist (--dist loadfile) can run the modules on different workers; a broker on
the embedded Valkey with a topic "out" of 4 partitions; a job run by a driver of its own."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from tests.conftest import drop_namespace
from tests.spark.standalone import StandaloneCluster, driver

ROWS = 16_000  # 8 write tasks of ~2,000 rows, each well past the 1,000 the faults wait for


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
