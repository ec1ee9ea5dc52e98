"""Fixtures of the Spark tests: one SparkSession for all of them, a broker on one backend.

Imported by the tests/spark/test_*.py modules (tests/conftest.py belongs to the core tests).
get_session() is getOrCreate(), so every module shares the one session even though each
imports the fixture.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import redisq  # noqa: E402
from tests.conftest import drop_namespace  # noqa: E402

# local[2,2]: two cores, and a failed task is tried twice (spark.task.maxFailures is ignored
# in local mode unless the master names it), which the exactly-once writer test needs.
MASTER = "local[2,2]"


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from spark_connector.session import get_session

    session = get_session(
        MASTER,
        app_name="redisq-tests",
        config={
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "2",
            "spark.sql.session.timeZone": "UTC",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session


@pytest.fixture
def spark_broker(valkey_server: Any) -> Iterator[redisq.Broker]:
    """A broker on the embedded Valkey, in a namespace of its own."""
    broker = redisq.connect(valkey_server.url, namespace=f"s{uuid.uuid4().hex[:12]}")
    yield broker
    drop_namespace(broker)
    broker.close()


def reader(spark: Any, broker: redisq.Broker, **options: Any) -> Any:
    """A batch DataFrame of the broker's server and namespace."""
    builder = spark.read.format("redisq")
    for name, value in _options(broker, options).items():
        builder = builder.option(name, value)
    return builder.load()


def stream_reader(spark: Any, broker: redisq.Broker, **options: Any) -> Any:
    builder = spark.readStream.format("redisq")
    for name, value in _options(broker, options).items():
        builder = builder.option(name, value)
    return builder.load()


def _options(broker: redisq.Broker, options: dict[str, Any]) -> dict[str, str]:
    merged = {"url": broker_url(broker), "namespace": broker.namespace}
    for name, value in options.items():
        merged[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return merged


def broker_url(broker: redisq.Broker) -> str:
    if not hasattr(broker.client, "connection_pool"):  # a cluster: any node will do
        node = broker.client.get_default_node()
        return f"redis://{node.host}:{node.port}"
    kwargs = broker.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"


def write(df: Any, broker: redisq.Broker, **options: Any) -> None:
    """df written to the broker's namespace through the data source (options as strings)."""
    builder = df.write.format("redisq").mode("append")
    builder = builder.option("url", broker_url(broker)).option("namespace", broker.namespace)
    for name, value in options.items():
        builder = builder.option(name, str(value))
    builder.save()


def produce(
    broker: redisq.Broker, topic: str, count: int, *, keys: int = 7, start: int = 0, **extra: Any
) -> None:
    """count messages value b"v<i>", key b"k<i % keys>", through the Python producer."""
    with broker.producer(linger_ms=1) as producer:
        for i in range(start, start + count):
            producer.send_async(topic, b"v%d" % i, key=b"k%d" % (i % keys), **extra)
        producer.flush()


def transaction_states(broker: redisq.Broker) -> dict[str, str]:
    """tx id -> state of every transaction record in the broker's namespace (the Spark
    writer's task attempts; its write records are left out)."""
    states = {}
    pattern = f"{broker.namespace}:{{~tx:*}}:record"
    for key in broker.client.scan_iter(match=pattern, count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        tx_id = name.split("{~tx:", 1)[1].split("}", 1)[0]
        if tx_id.startswith("spark~"):
            continue
        state = broker.client.hget(key, "state")
        states[tx_id] = state.decode() if state else "?"
    return states


HELD_PID_KEY = "test:held-pid"  # (in the namespace) the pid of the held attempt's Python worker


def fail_first_attempts(
    df: Any, after_rows: int, broker: redisq.Broker | None = None, hold_partition: int | None = None
) -> Any:
    """df whose tasks fail on their first attempt once `after_rows` rows went through them: a
    task-side failure injected from outside the connector (a UDF in the test's DataFrame).

    With broker: the failure waits (60 s at most) until the writer's attempt has registered its
    transaction in Redis, i.e. has staged rows, so the failed attempt leaves staged rows behind
    whatever the timing. Rows reach the writer while the UDF waits only past the buffers between
    the Python workers (64 KB each): the rows before the failure should make some hundreds of
    KB, in small Arrow batches (spark.sql.execution.arrow.maxRecordsPerBatch).

    hold_partition (with broker): instead, only that partition's first attempt stops there,
    once registered, and waits (120 s at most) after writing its Python worker's pid to
    HELD_PID_KEY in the namespace: the test kills the executor running it mid-write."""
    from pyspark.sql import functions as F

    url = broker_url(broker) if broker is not None else None
    pattern = f"{broker.namespace}:{{~tx:spark~*}}:record" if broker is not None else ""
    held_key = f"{broker.namespace}:{HELD_PID_KEY}" if broker is not None else ""

    def passthrough(value: Any) -> Any:
        # Nested, so cloudpickle ships it by value (workers need not import the tests).
        import time

        from pyspark import TaskContext

        from redisq.server.connection import open_client

        context = TaskContext.get()
        seen = passthrough.__dict__.setdefault("seen", {})
        slot = (context.stageId(), context.partitionId(), context.attemptNumber())
        seen[slot] = seen.get(slot, 0) + 1
        held = hold_partition is not None and context.partitionId() == hold_partition
        if hold_partition is not None and not held:
            return value
        if context.attemptNumber() == 0 and seen[slot] > after_rows:
            if url is not None:
                me = f"{context.partitionId()}:0".encode()
                client = open_client(url)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    keys = list(client.scan_iter(match=pattern, count=1000))
                    if any(me in client.hvals(k) for k in keys):
                        break
                    time.sleep(0.05)
                if held:
                    import os

                    client.set(held_key, os.getpid())
                    time.sleep(120)  # until the executor is killed
            raise RuntimeError(f"injected failure of task {context.partitionId()}")
        return value

    udf = F.udf(passthrough, df.schema["value"].dataType)
    return df.withColumn("value", udf("value"))
