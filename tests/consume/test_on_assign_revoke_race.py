"""A partition revoked while on_assign is still running for it (in poll()'s thread or task, the
first announcement after the grant) is still told to on_revoke once on_assign returned: every
partition a member was told of is either held or was revoked (Kafka's pairing), and no reader
starts on a partition that is being handed over.

Both APIs (on the asyncio API on_assign is a coroutine function suspended on the loop while the
hand-over goes on), on each backend."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import redisq
from tests.aio import FAST
from tests.conftest import wait_until

PARTITIONS = 4


def told_and_held(calls: list[tuple[str, list[Any]]]) -> set[int]:
    held: set[int] = set()
    for name, tps in calls:
        parts = {p for _, p in tps}
        if name == "assign":
            assert not held & parts, f"told twice: {calls}"
            held |= parts
        else:
            assert parts <= held, f"revoked without assign: {calls}"
            held -= parts
    return held


def on_assign_held_until(
    api: Any, calls: list[tuple[str, list[Any]]], release: threading.Event
) -> Callable[[list[Any]], Any]:
    """An on_assign that records its call, then does not return before `release` (20 s at
    most): it blocks poll()'s thread on the thread API, and is a coroutine function awaiting on
    the loop (which goes on running the coordinator) on the asyncio API."""

    def on_assign(tps: list[Any]) -> None:
        calls.append(("assign", list(tps)))
        release.wait(20)

    async def on_assign_async(tps: list[Any]) -> None:
        calls.append(("assign", list(tps)))
        deadline = time.monotonic() + 20
        while not release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    return on_assign_async if api.name == "async" else on_assign


def test_revoked_during_on_assign_is_told_to_on_revoke(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=PARTITIONS)
    calls: list[tuple[str, list[Any]]] = []
    release = threading.Event()

    def on_revoke(tps: list[Any]) -> None:
        calls.append(("revoke", list(tps)))

    on_assign = on_assign_held_until(api, calls, release)
    a = api.broker.consumer("t", "g", on_assign=on_assign, on_revoke=on_revoke, **FAST)
    b = None
    try:
        wait_until(lambda: len(a.assignment) == PARTITIONS, what="a holds every partition")
        poller = threading.Thread(target=lambda: a.poll(timeout=0))
        poller.start()
        wait_until(lambda: bool(calls), what="on_assign under way")
        b = api.broker.consumer("t", "g", **FAST)
        wait_until(lambda: len(b.assignment) > 0, timeout=30, what="b takes some over")
        release.set()
        poller.join(20)
        assert not poller.is_alive()
        wait_until(lambda: len(a.assignment) + len(b.assignment) == PARTITIONS, what="settled")

        def paired() -> bool:
            a.poll(timeout=0)  # what is left to announce is announced in poll()
            return told_and_held(calls) == set(a.assignment)

        wait_until(paired, timeout=30, what="what a was told matching what it holds")
        assert told_and_held(calls) == set(a.assignment), calls
    finally:
        release.set()
        a.close()
        if b is not None:
            b.close()
