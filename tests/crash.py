"""A member that crashes for real: a consumer in a child process polls, reports what it got,
and is then SIGKILLed by the test (no commit, no lease release, no leave), as a process crash
would leave it. No hook in the library is needed.

    offsets = poll_then_crash(url, namespace, "orders", "g", "victim", count=3)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

import redisq


def _member(
    url: str,
    namespace: str,
    topic: str,
    group: str,
    name: str,
    count: int,
    options: dict[str, Any],
    conn: Any,
) -> None:
    broker = redisq.connect(url, namespace=namespace)
    consumer = broker.consumer(topic, group, name, **options)
    got: list[tuple[int, str]] = []
    while len(got) < count:
        got += [(m.partition, m.offset) for m in consumer.poll(timeout=10, max_messages=count)]
    conn.send(got)
    signal.pause()  # until SIGKILL


def poll_then_crash(
    url: str, namespace: str, topic: str, group: str, name: str, count: int, **options: Any
) -> list[tuple[int, str]]:
    """(partition, offset) of the messages the member got before it was killed."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_member, args=(url, namespace, topic, group, name, count, options, child)
    )
    process.start()
    try:
        if not parent.poll(60):
            raise AssertionError("the member got nothing within 60 s")
        got: list[tuple[int, str]] = parent.recv()
        return got
    finally:
        if process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)
