"""The taskiq broker (redisq.integrations.taskiq) with taskiq worker processes: per-key order
across two worker processes, one run per task id, and nothing lost when a worker is SIGKILLed
mid-task (the ack comes after execution)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.celery_workers import ROOT, Journal, order_report
from tests.integrations.conftest import drop_keys, wait_for_owners

pytestmark = pytest.mark.consumer_processes


class TaskiqWorkers:
    def __init__(self, url: str, namespace: str, logs: Path, lease_ms: int) -> None:
        self.url, self.namespace, self.logs, self.lease_ms = url, namespace, logs, lease_ms
        self.started: list[subprocess.Popen[bytes]] = []

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            REDISQ_IT_BROKER_URL=self.url,
            REDISQ_IT_NAMESPACE=self.namespace,
            REDISQ_IT_LEASE_MS=str(self.lease_ms),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        return env

    def start(self, name: str, processes: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "taskiq", "worker", "tests.integrations.taskiq_app:broker",
                   "--workers", str(processes), "--no-configure-logging"]  # fmt: skip
        with open(self.logs / f"{name}.log", "ab") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.started.append(process)
        return process

    @staticmethod
    def kill(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for process in self.started:
            self.kill(process, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in self.started:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill(process)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def taskiq_env(redis_url: str, tmp_path: Path) -> Iterator[tuple[TaskiqWorkers, Journal]]:
    namespace = f"tq{uuid.uuid4().hex[:10]}"
    workers = TaskiqWorkers(redis_url, namespace, tmp_path, lease_ms=2_000)
    journal = Journal(redis_url, namespace)
    try:
        yield workers, journal
    finally:
        workers.stop()
        journal.close()
        drop_keys(redis_url, f"{namespace}:*")


async def kick_all(
    workers: TaskiqWorkers,
    calls: list[tuple[str, int, float, str | None]],
    labels: dict[str, object] | None = None,
) -> None:
    """Kick record(key, seq, work_s) with the key as ordering label (and a task id when given),
    from a broker of the test's own (a client: startup, kick, shutdown)."""
    from redisq.integrations.taskiq import RedisqBroker

    client = RedisqBroker(workers.url, namespace=workers.namespace, topic="tasks", partitions=4)
    task = client.register_task(lambda *a: None, task_name="it.record")
    await client.startup()
    try:
        for key, seq, work_s, task_id in calls:
            kicker = task.kicker().with_labels(ordering_key=key, **(labels or {}))
            if task_id is not None:
                kicker = kicker.with_task_id(task_id)
            await kicker.kiq(key, seq, work_s)
    finally:
        await client.shutdown()


def test_taskiq_worker_keeps_key_order_and_runs_a_task_id_once(
    taskiq_env: tuple[TaskiqWorkers, Journal],
) -> None:
    workers, journal = taskiq_env
    workers.start("w", processes=2)
    wait_for_owners(workers.url, workers.namespace, "tasks", "taskiq", owners=2)
    calls: list[tuple[str, int, float, str | None]] = [
        (f"k{k}", seq, 0.0, None) for seq in range(30) for k in range(10)
    ]
    task_id = str(uuid.uuid4())
    calls += [("dedup", 0, 0.0, task_id), ("dedup", 0, 0.0, task_id), ("dedup", 1, 0.0, None)]
    asyncio.run(kick_all(workers, calls))
    journal.wait_count("done", 302, timeout=90)
    started = journal.entries("started")
    assert order_report(started) == (0, 0, 0)
    assert [e["seq"] for e in started if e["key"] == "dedup"] == [0, 1]
    assert len({e["pid"] for e in started}) == 2  # both worker processes took part


def test_taskiq_worker_killed_mid_task_loses_nothing(
    taskiq_env: tuple[TaskiqWorkers, Journal],
) -> None:
    workers, journal = taskiq_env
    victim = workers.start("victim", processes=1)
    calls: list[tuple[str, int, float, str | None]] = [
        (f"kill-{seq % 4}", seq, 0.5, None) for seq in range(8)
    ]
    asyncio.run(kick_all(workers, calls))
    journal.wait_count("done", 2, timeout=60)  # committed up to there; the next ones run
    workers.kill(victim)
    victim.wait(10)
    assert journal.count("done") < len(calls)
    workers.start("survivor", processes=1)
    expected = set(range(len(calls)))
    assert journal.wait_seqs("done", expected, timeout=60) == expected


def test_taskiq_delay_label_is_a_delayed_message(
    taskiq_env: tuple[TaskiqWorkers, Journal],
) -> None:
    workers, journal = taskiq_env
    workers.start("w", processes=1)
    sent = time.time()
    asyncio.run(kick_all(workers, [("later", 0, 0.0, None)], labels={"delay": 1}))
    journal.wait_count("done", 1, timeout=60)
    (entry,) = journal.entries("started")
    assert entry["t"] - sent >= 1.0
