"""A SparkSession for the connector's jobs and CLI: local[*] unless told otherwise.

Python workers need pyarrow (the reader hands Spark Arrow batches), so the session points
PYSPARK_PYTHON at this interpreter, which has it, unless the user already chose one.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("redisq.spark.session")

DEFAULT_MASTER = "local[*]"


def get_session(
    master: str | None = None,
    *,
    app_name: str = "redisq",
    remote: str | None = None,
    config: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the "redisq" data source registered.

    master: a Spark master url (default: local[*]). remote (or SPARK_REMOTE): a Spark Connect
    url instead, for a cluster; the data source is then registered through Connect. An existing
    active session is reused (getOrCreate), with the data source registered on it.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    remote = remote or os.environ.get("SPARK_REMOTE")
    if not remote and (master or "local").startswith("local"):
        # A local session listens on loopback only (and says nothing about the host name).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    else:
        builder = builder.master(master or DEFAULT_MASTER)
        # Small local jobs: few shuffle partitions, no UI port to fight over.
        builder = builder.config("spark.sql.shuffle.partitions", "8").config(
            "spark.ui.enabled", "false"
        )
    for name, value in (config or {}).items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    register(spark)
    return spark


def register(spark: SparkSession) -> None:
    """Register the "redisq" data source on a session (idempotent)."""
    from spark_connector.source import RedisqDataSource

    spark.dataSource.register(RedisqDataSource)
