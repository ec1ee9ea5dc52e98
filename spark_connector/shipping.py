"""Getting redisq onto Spark's executors when it is not installed there.

Executors run the reader's and writer's code in their own Python: redisq and spark_connector
must be importable there, with redis-py and pyarrow (PySpark needs pyarrow for Arrow anyway).
Three ways, from the simplest:

1. install it on every worker (pip install 'redisq-broker[spark]'), and point Spark at that
   Python (spark.pyspark.python, or PYSPARK_PYTHON in the workers' environment);
2. ship a packed virtualenv: venv-pack -o env.tar.gz, then
   --archives env.tar.gz#env --conf spark.pyspark.python=./env/bin/python;
3. ship just the code as a zip (this module): ship_code(spark) builds it and adds it with
   addPyFile (Spark Connect: addArtifacts(pyfile=True)); the workers' Python then needs only
   redis-py and pyarrow. The Lua scripts travel inside the zip (redisq/lua) and load through
   importlib.resources.
"""

from __future__ import annotations

import logging
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import redisq
import spark_connector
from redisq.server.lua import lua_dir

log = logging.getLogger("redisq.spark.shipping")

_SKIP_DIRS = {"__pycache__"}


def package_zip(path: str | Path | None = None) -> Path:
    """A zip of the redisq and spark_connector packages with the Lua scripts at redisq/lua,
    from wherever they are imported from (an installed wheel or a source checkout)."""
    target = Path(path) if path is not None else Path(tempfile.mkdtemp()) / "redisq-code.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in (redisq, spark_connector):
            root = Path(str(package.__file__)).resolve().parent
            for file in sorted(root.rglob("*")):
                relative = file.relative_to(root.parent)
                if file.is_file() and not _SKIP_DIRS & set(relative.parts):
                    if relative.parts[:2] != ("redisq", "lua"):
                        archive.write(file, relative.as_posix())
        _add_lua(archive, lua_dir(), "redisq/lua")
    return target


def _add_lua(archive: zipfile.ZipFile, node: Any, prefix: str) -> None:
    for entry in node.iterdir():
        name = f"{prefix}/{entry.name}"
        if entry.is_dir():
            _add_lua(archive, entry, name)
        elif entry.name.endswith(".lua"):
            archive.writestr(name, entry.read_bytes())


def ship_code(spark: Any, path: str | Path | None = None) -> Path:
    """Build the zip and add it to the session's Python path on every executor (a classic
    session: addPyFile; Spark Connect: addArtifacts). Returns the zip's path."""
    archive = package_zip(path)
    if not _is_connect(spark):
        spark.sparkContext.addPyFile(str(archive))
    else:
        spark.addArtifacts(str(archive), pyfile=True)
    log.info("redisq shipped to the executors as %s", archive)
    return archive


def _is_connect(spark: Any) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")
