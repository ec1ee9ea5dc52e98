"""A SparkSession for the connector's jobs and CLI: local[*] unless told otherwise.

Python workers need pyarrow (the reader hands Spark Arrow batches) and redisq. In local mode the
workers run on this machine, so the session points PYSPARK_PYTHON at this interpreter, which has
both, unless the user chose one. A cluster's workers are other machines, where this interpreter's
path may not exist: the session then leaves the choice to Spark's own settings
(spark.pyspark.python, PYSPARK_PYTHON on the workers), or to `python=`. See
spark_connector.shipping for the ways to get redisq onto the workers.
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
    python: str | None = None,
    ship_code: bool = False,
) -> SparkSession:
    """A SparkSession with the "redisq" data source registered.

    master: a Spark master url (default: local[*]). remote (or SPARK_REMOTE): a Spark Connect
    url instead; the data source is then registered through Connect. An existing active
    session is reused (getOrCreate), with the data source registered on it.
    python: the executors' Python (spark.pyspark.python), for a cluster whose workers have
    redisq at a known path. ship_code: send redisq to the executors as a zip
    (spark_connector.shipping.ship_code), for workers that do not have it installed.
    """
    remote = remote or os.environ.get("SPARK_REMOTE")
    local = not remote and (master or DEFAULT_MASTER).startswith("local")
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        # A local session listens on loopback only (and says nothing about the host name).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    else:
        builder = builder.master(master or DEFAULT_MASTER)
        if local:
            # Small local jobs: few shuffle partitions, no UI port to fight over.
            builder = builder.config("spark.sql.shuffle.partitions", "8").config(
                "spark.ui.enabled", "false"
            )
        if python:
            builder = builder.config("spark.pyspark.python", python)
    for name, value in (config or {}).items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    if ship_code:
        from spark_connector.shipping import ship_code as ship

        ship(spark)
    register(spark)
    return spark


def register(spark: SparkSession) -> None:
    """Register the "redisq" data source on a session (idempotent)."""
    from spark_connector.source import RedisqDataSource

    spark.dataSource.register(RedisqDataSource)
