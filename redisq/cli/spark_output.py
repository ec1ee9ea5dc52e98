"""Spark's own output kept out of the command's: the JVM's banner and log lines, pyspark's
warnings."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SparkLog:
    """Where Spark's output went (None: nowhere else, stderr had no descriptor); removed after
    the block unless keep is set."""

    path: Path | None = None
    keep: bool = False

    def kept_when_written(self) -> Path | None:
        """Keep the log if Spark wrote to it (the caller names it after a failure)."""
        if self.path is not None and self.path.exists() and self.path.stat().st_size:
            self.keep = True
            return self.path
        return None


@contextmanager
def spark_log() -> Iterator[SparkLog]:
    """The JVM that pyspark starts writes straight to file descriptor 2: log4j's profile and
    default level, "Using incubator modules", NativeCodeLoader, every WARN of a job, and the
    Python workers it starts write there too. None of that is the command's output: while this
    runs, descriptor 2 (which the JVM inherits, and keeps) is a log file, and Python's stderr
    (sys.stderr, the root logger's handlers) writes to the terminal as before through a copy
    of the old descriptor. pyspark's FutureWarning about the pandas version is ignored.

    The log is removed afterwards unless the caller keeps it (Spark failed: it names it)."""
    try:
        sys.stderr.flush()
        descriptor = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        descriptor = -1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\.|$)")
        if descriptor != 2:
            yield SparkLog()
            return
        with tempfile.NamedTemporaryFile(
            "wb", prefix="redisq-spark-", suffix=".log", delete=False
        ) as log:
            path = Path(log.name)
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
        previous = sys.stderr
        terminal = os.fdopen(saved, "w", buffering=1, errors="backslashreplace")
        handlers = [
            h
            for h in logging.root.handlers
            if isinstance(h, logging.StreamHandler) and h.stream is previous
        ]
        sys.stderr = terminal
        for handler in handlers:
            handler.setStream(terminal)
        record = SparkLog(path)
        try:
            yield record
        finally:
            terminal.flush()
            os.dup2(saved, 2)
            sys.stderr = previous
            for handler in handlers:
                handler.setStream(previous)
            terminal.close()
            if not record.keep:
                path.unlink(missing_ok=True)
