"""Celery end to end: tasks/s on redisq's Kombu transport against Kombu's stock Redis transport,
on the same Redis, side by side in one run, with the per-key order and duplicates each gives.

    python benchmarks/celery_tasks.py [--url URL] [--tasks N] [--keys K] [--burst B]
                                      [--repeat R] [--markdown]

Each round starts one Celery worker (prefork, 2 pool processes, acks_late, prefetch multiplier 4)
on a fresh namespace and sends N tasks from this process (``it.record`` of
tests/integrations/celery_app.py: a few Redis writes each) over K ordering keys (the header
``ordering_key``), B consecutive tasks of a key at a time (an order's events come together).
tasks/s counts from the first send to the last task's end, so sending is included. The rounds
alternate the transports; the median counts. Order violations: a task that started before a task
of its key sent earlier; overlaps: a task that started while another of its key ran; duplicates:
executions past the first of a task. Without --url it uses REDIS_URL, else the local Redis.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from report import print_table, run_rounds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integrations.celery_app import make_app  # noqa: E402
from tests.integrations.celery_workers import CeleryWorkers, Journal, order_report  # noqa: E402

TRANSPORTS = {"redisq (redisq.integrations.kombu)": "redisq", "Kombu's Redis transport": "redis"}


def drop(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{namespace}:*", count=1000):
        client.delete(key)
    client.close()


def one_round(
    url: str,
    transport: str,
    tasks: int,
    keys: int,
    burst: int,
    logs: Path,
    counts: dict[str, list[int]],
) -> float:
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    workers = CeleryWorkers(url, transport, namespace, logs)
    app = make_app(url, transport, namespace)
    journal = Journal(url, namespace)
    try:
        workers.start(f"{transport}-{namespace}", concurrency=2)
        workers.wait_ready()
        started = time.monotonic()
        for first in range(0, tasks // keys, burst):
            for k in range(keys):
                for seq in range(first, min(first + burst, tasks // keys)):
                    app.send_task("it.record", args=(f"key-{k}", seq),
                                  headers={"ordering_key": f"key-{k}"})  # fmt: skip
        deadline = time.monotonic() + 600
        while (
            journal.count("done") < tasks
            or len({(e["key"], e["seq"]) for e in journal.entries("done")}) < tasks
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"{transport}: not all {tasks} tasks ran in 600 s")
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        found = order_report(journal.entries("started"))
        total = counts.setdefault(transport, [0, 0, 0])
        for i, value in enumerate(found):
            total[i] += value
        return tasks / elapsed
    finally:
        workers.stop()
        app.close()
        journal.close()
        drop(url, namespace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--burst", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    counts: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as logs:

        def variant(transport: str) -> float:
            return one_round(
                args.url, transport, args.tasks, args.keys, args.burst, Path(logs), counts
            )

        variants = {
            name: functools.partial(variant, transport) for name, transport in TRANSPORTS.items()
        }
        medians = run_rounds(variants, args.repeat, unit="tasks/s")
    base = medians["Kombu's Redis transport"]
    rows = []
    for name, transport in TRANSPORTS.items():
        found = counts[transport]
        ratio = medians[name] / base
        rows.append([name, f"{medians[name]:,.0f}", f"{ratio:.2f}x", *map(str, found)])
    print(
        f"\n{args.tasks:,} tasks over {args.keys} ordering keys (bursts of {args.burst}), one "
        f"worker (prefork, 2 processes, acks_late), median of {args.repeat} interleaved rounds; "
        "order counts summed over the rounds"
    )
    print_table(
        ["transport", "tasks/s", "ratio", "order violations", "overlaps", "duplicates"],
        rows,
        args.markdown,
    )


if __name__ == "__main__":
    main()
