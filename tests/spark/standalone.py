"""A Spark standalone cluster on loopback for the tests: a master and workers started from the
installed pyspark (bin/spark-class), each worker 1 core; and a driver run in its own process
(one SparkContext per process: the tests' local session lives in the pytest process).

    python -m tests.spark.standalone JOB MASTER URL NAMESPACE [ROWS]

JOB: write-shuffle (rows through repartition(8, "key") into topic "out"), write-fail (the same,
each write task's first attempt failing after it staged rows), write-held (the same, task 0's
first attempt holding still after it staged rows, for the test to kill its executor), read
(count and checksum of topic "out", by a job on the cluster), zip-write (write-shuffle with
redisq shipped as a zip to workers whose Python cannot import the installed redisq).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spark_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        SPARK_NO_DAEMONIZE="1",
    )
    return env


@dataclass
class StandaloneCluster:
    """A master and `workers` workers (1 core, `memory` each), stopped by pid."""

    workdir: Path
    workers: int = 2
    memory: str = "1g"
    master_port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=spark_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def start(self) -> StandaloneCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.master_port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        for i in range(self.workers):
            self._spawn(
                f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.url,
                "--host", "127.0.0.1", "--cores", "1", "--memory", self.memory,
                "--webui-port", str(free_port()), "--work-dir", str(self.workdir / f"w{i}"),
            )  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if len(self.alive_workers()) == self.workers:
                    return self
            except (OSError, ValueError):  # the master's UI not up yet (an empty reply)
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the standalone cluster did not start: see {self.workdir}/*.log")

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def alive_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.state().get("workers", []) if w.get("state") == "ALIVE"]

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes[1:]]

    def executor_of(self, pid: int) -> int:
        """The executor JVM that pid (a Python worker) descends from."""
        executors = set(self.executor_pids())
        while pid > 1:
            if pid in executors:
                return pid
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        raise LookupError("not under one of this cluster's executors")

    def executor_pids(self) -> list[int]:
        """The executor JVMs our workers launched (children of the worker processes)."""
        workers = set(self.worker_pids())
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid in workers and b"CoarseGrainedExecutorBackend" in cmdline:
                found.append(int(entry.name))
        return sorted(found)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # its own session: the worker's executors
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def driver(
    job: str, master: str, url: str, namespace: str, rows: int, workdir: Path
) -> subprocess.Popen[bytes]:
    """The driver of one job, in its own process; it prints one JSON line at the end."""
    log = open(workdir / f"driver-{job}.log", "wb")  # noqa: SIM115 - closed with the process
    env = spark_env()
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.spark.standalone", job, master, url, namespace, str(rows)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=str(workdir),
        start_new_session=True,
    )


def source_rows(spark: Any, rows: int) -> Any:
    """The source: deterministic content, spread over 4 input partitions."""
    return spark.range(0, rows, numPartitions=4).selectExpr(
        "cast(id % 997 as string) as key",
        "cast(concat('v', id, ':', repeat('x', 1000)) as binary) as value",
    )


def expected_content(rows: int) -> dict[tuple[bytes, bytes], int]:
    pad = b"x" * 1000
    return {(b"%d" % (i % 997), b"v%d:%b" % (i, pad)): 1 for i in range(rows)}


def _run_job(job: str, master: str, url: str, namespace: str, rows: int) -> dict[str, Any]:
    from spark_connector.session import get_session

    config = {
        "spark.executor.memory": "768m",
        "spark.executor.cores": "1",
        "spark.cores.max": "2",
        "spark.task.maxFailures": "8",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "200",
    }
    python = sys.executable
    if job == "zip-write":
        python = str(_hiding_python(Path.cwd()))
    spark = get_session(
        master, app_name=f"redisq-{job}", config=config, python=python,
        ship_code=job == "zip-write",
    )  # fmt: skip
    spark.sparkContext.setLogLevel("WARN")
    started = time.monotonic()
    options = {"url": url, "namespace": namespace}
    if job == "read":
        df = spark.read.format("redisq").options(subscribe="out", **options).load()
        row = df.selectExpr("count(*) as n", "sum(crc32(value)) as checksum").first()
        result = {"count": row.n, "checksum": row.checksum}
    else:
        df = source_rows(spark, rows).repartition(8, "key")
        if job in ("write-fail", "write-held"):
            import redisq
            from tests.spark.fixtures import fail_first_attempts

            hold = 0 if job == "write-held" else None
            with redisq.connect(url, namespace=namespace) as broker:
                df = fail_first_attempts(df, 1000, broker, hold_partition=hold)
        df.write.format("redisq").options(topic="out", batchSize=50, maxInFlight=2, **options).mode(
            "append"
        ).save()
        result = {}
        if job == "zip-write":
            result["worker_redisq"] = spark.range(1).rdd.map(lambda _: _where_redisq()).first()
    result["seconds"] = round(time.monotonic() - started, 2)
    spark.stop()
    return result


def _where_redisq() -> str:
    import redisq

    return str(redisq.__file__)


def _hiding_python(directory: Path) -> Path:
    """An executable that runs this interpreter with the installed redisq hidden: a
    sitecustomize drops the source checkout from sys.path, so only a shipped zip can provide
    redisq and spark_connector."""
    hide = directory / "hide-redisq"
    hide.mkdir(exist_ok=True)
    checkout = str(ROOT)
    (hide / "sitecustomize.py").write_text(
        f"import sys\nsys.path[:] = [p for p in sys.path if p.rstrip('/') != {checkout!r}]\n"
    )
    wrapper = directory / "python-without-redisq"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{hide}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


if __name__ == "__main__":
    job, master, url, namespace = sys.argv[1:5]
    count = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    print(json.dumps(_run_job(job, master, url, namespace, count)), flush=True)
