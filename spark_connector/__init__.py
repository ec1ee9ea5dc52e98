"""PySpark data source "redisq" and analysis jobs (DESIGN §5); needs the [spark] extra.

from spark_connector import get_session
spark = get_session()                      # local[*]; --master / SPARK_REMOTE for a cluster
df = (spark.read.format("redisq").option("url", "redis://localhost:6379")
      .option("subscribe", "orders").load())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_connector.source import DataLossError, RedisqDataSource

__all__ = ["DataLossError", "RedisqDataSource", "demo_audit", "get_session", "register"]


def __getattr__(name: str) -> Any:
    # Lazy: `import spark_connector` must not need pyspark until something Spark is used.
    if name in ("RedisqDataSource", "DataLossError"):
        from spark_connector import source

        return getattr(source, name)
    if name in ("get_session", "register"):
        from spark_connector import session

        return getattr(session, name)
    if name == "demo_audit":
        from spark_connector.jobs import demo_audit

        return demo_audit
    raise AttributeError(f"module 'spark_connector' has no attribute {name!r}")
