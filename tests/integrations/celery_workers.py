"""Celery workers in processes of their own, for the worker tests and benchmarks/celery_tasks.py:
started on a transport and namespace, stopped by process group (a worker and its pool)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The worker and its pool children (its process group)."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class CeleryWorkers:
    """Workers of the app in tests/integrations/celery_app.py on one transport and namespace."""

    url: str
    transport: str
    namespace: str
    logs: Path
    lease_ms: int = 30_000
    workers: list[Worker] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            REDISQ_IT_BROKER_URL=self.url,
            REDISQ_IT_TRANSPORT=self.transport,
            REDISQ_IT_NAMESPACE=self.namespace,
            REDISQ_IT_LEASE_MS=str(self.lease_ms),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        return env

    def start(self, name: str, concurrency: int = 2) -> Worker:
        log = self.logs / f"{name}.log"
        command = [
            sys.executable, "-m", "celery", "-A", "tests.integrations.celery_app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-n", f"{name}@%h", "-l", "info",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        worker = Worker(name, process, log)
        self.workers.append(worker)
        return worker

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while " ready." not in worker.log_text():
                if worker.process.poll() is not None:
                    raise AssertionError(f"{worker.name} exited:\n{worker.log_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{worker.name} not ready:\n{worker.log_text()[-3000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.kill(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for worker in self.workers:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            worker.kill(signal.SIGKILL)  # what is left of the group (pool children)
            try:
                worker.process.wait(5)
            except subprocess.TimeoutExpired:
                pass


class Journal:
    """What the tasks recorded (celery_app.record), read from Redis."""

    def __init__(self, url: str, namespace: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.namespace = namespace

    def _key(self, name: str) -> str:
        return f"{self.namespace}:journal:{name}"

    def entries(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(self._key(name), 0, -1)]

    def count(self, name: str) -> int:
        return int(self.client.llen(self._key(name)))

    def wait_count(self, name: str, at_least: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            count = self.count(name)
            if count >= at_least:
                return count
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} of {at_least} {name!r} entries after {timeout} s")
            time.sleep(0.05)

    def wait_seqs(self, name: str, expected: set[int], timeout: float) -> set[int]:
        """Until every seq in `expected` has an entry (repeats do not count twice)."""
        deadline = time.monotonic() + timeout
        while True:
            seqs = {entry["seq"] for entry in self.entries(name)}
            if expected <= seqs:
                return seqs
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {sorted(expected - seqs)} missing after {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.client.close()


def order_report(started: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(order violations, overlaps, duplicate executions) in the journal's start entries: a
    violation is a task of a key that started before one of the same key sent earlier."""
    last: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    violations = overlaps = duplicates = 0
    for entry in started:
        key, seq = entry["key"], entry["seq"]
        if (key, seq) in seen:
            duplicates += 1
            continue
        seen.add((key, seq))
        if seq < last.get(key, -1):
            violations += 1
        last[key] = max(seq, last.get(key, -1))
        if entry["running"] > 1:
            overlaps += 1
    return violations, overlaps, duplicates


__all__ = ["CeleryWorkers", "Journal", "Worker", "order_report"]
