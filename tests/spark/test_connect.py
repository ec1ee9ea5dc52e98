"""The connector through Spark Connect: a Connect server started from the installed pyspark
(bin/spark-submit, loopback, stopped by pid), a client session in a process of its own
registering the data source remotely, then a write through a shuffle, a read and a streaming
copy, compared row for row.

Needs the Connect client (pip install 'redisq-broker[spark-connect]': grpcio, pandas, ...;
CI installs it); skipped without it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
for _module in ("grpc", "pandas", "google.protobuf", "zstandard"):
    pytest.importorskip(
        _module, reason="the Spark Connect client is not installed ([spark-connect] extra)"
    )

import redisq  # noqa: E402
from tests.conftest import drop_namespace  # noqa: E402
from tests.spark.standalone import free_port, spark_env, spark_home  # noqa: E402

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    workdir = tmp_path_factory.mktemp("connect")
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [
            str(spark_home() / "bin" / "spark-submit"),
            "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--master", "local[2]", "--name", "redisq-connect-test",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf", f"spark.connect.grpc.binding.port={port}",
            "--conf", f"spark.pyspark.python={sys.executable}",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.sql.shuffle.partitions=4",
            "spark-internal",
        ],
        env=spark_env(), stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.5)
    else:
        os.killpg(server.pid, signal.SIGKILL)
        log.close()
        pytest.fail("the Connect server did not start: " + (workdir / "server.log").read_text())
    yield f"sc://127.0.0.1:{port}"
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    log.close()


@pytest.fixture
def broker(valkey_server: Any) -> Iterator[redisq.Broker]:
    b = redisq.connect(valkey_server.url, namespace=f"cc{uuid.uuid4().hex[:10]}")
    yield b
    drop_namespace(b)
    b.close()


def content(broker: redisq.Broker, topic: str) -> Counter[tuple[bytes | None, bytes]]:
    n = broker.topic_config(topic).partitions
    return Counter((m.key, m.value) for p in range(n) for m in broker.read(topic, p))


def test_write_read_and_stream_through_spark_connect(
    connect_url: str, broker: redisq.Broker, valkey_server: Any, tmp_path: Path
) -> None:
    """The client runs in a process of its own (pyspark refuses a Connect session in a process
    that already runs a classic one, as the other Spark tests' workers do)."""
    broker.create_topic("out", partitions=3)
    broker.create_topic("copy", partitions=2)
    child = subprocess.run(
        [sys.executable, "-m", "tests.spark.test_connect", connect_url, valkey_server.url,
         broker.namespace, str(tmp_path / "cp")],
        cwd=Path(__file__).resolve().parents[2], env={**spark_env(), "PYTHONPATH": "."},
        capture_output=True, timeout=400,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr.decode()[-4000:]
    read = json.loads(child.stdout.decode().strip().splitlines()[-1])
    expected = Counter((str(i % 37).encode(), b"v%d" % i) for i in range(5000))
    assert content(broker, "out") == expected
    assert Counter((bytes.fromhex(k), bytes.fromhex(v)) for k, v in read) == expected
    assert content(broker, "copy") == expected


def client(remote: str, url: str, namespace: str, checkpoint: str) -> None:
    """Through Connect: a write through a shuffle into "out", a read of it (printed as one JSON
    line of [key hex, value hex] pairs), a streaming copy of it into "copy"."""
    from spark_connector.session import get_session

    session = get_session(remote=remote)
    options = {"url": url, "namespace": namespace}
    source = session.range(0, 5000, numPartitions=3).selectExpr(
        "cast(id % 37 as string) as key", "cast(concat('v', id) as binary) as value"
    )
    source.repartition(4, "key").write.format("redisq").options(topic="out", **options).mode(
        "append"
    ).save()
    read = session.read.format("redisq").options(subscribe="out", **options).load()
    rows = [[bytes(r.key).hex(), bytes(r.value).hex()] for r in read.collect()]
    query = (
        session.readStream.format("redisq")
        .options(subscribe="out", startingOffsets="earliest", maxOffsetsPerTrigger=2000, **options)
        .load()
        .select("key", "value")
        .writeStream.format("redisq")
        .options(topic="copy", **options)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    if query.exception() is not None:
        raise SystemExit(f"streaming copy failed: {query.exception()}")
    session.stop()
    print(json.dumps(rows))


if __name__ == "__main__":
    client(*sys.argv[1:5])
