"""A partition revoked while on_assign is still running for it (in poll()'s thread or task, the
first announcement after the grant) is still told to on_revoke once on_assign returned: every
partition a member was told of is either held or was revoked (Kafka's pairing), and no reader
starts on a partition that is being handed over.

Both APIs, on each backend."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import redisq
from tests.aio import FAST, Env, aio
from tests.aio import wait_until as async_wait_until
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


def test_revoked_during_on_assign_is_told_to_on_revoke(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=PARTITIONS)
    calls: list[tuple[str, list[Any]]] = []
    release = threading.Event()

    def on_assign(tps: list[Any]) -> None:
        calls.append(("assign", list(tps)))
        release.wait(20)

    def on_revoke(tps: list[Any]) -> None:
        calls.append(("revoke", list(tps)))

    a = broker.consumer("t", "g", on_assign=on_assign, on_revoke=on_revoke, **FAST)
    b = None
    try:
        wait_until(lambda: len(a.assignment) == PARTITIONS, what="a holds every partition")
        poller = threading.Thread(target=lambda: a.poll(timeout=0))
        poller.start()
        wait_until(lambda: bool(calls), what="on_assign under way")
        b = broker.consumer("t", "g", **FAST)
        wait_until(lambda: len(b.assignment) > 0, timeout=30, what="b takes some over")
        release.set()
        poller.join(20)
        wait_until(lambda: len(a.assignment) + len(b.assignment) == PARTITIONS, what="settled")
        time.sleep(0.5)
        a.poll(timeout=0)
        assert told_and_held(calls) == set(a.assignment), calls
    finally:
        release.set()
        a.close()
        if b is not None:
            b.close()


@aio
async def test_asyncio_revoked_during_on_assign_is_told_to_on_revoke(env: Env) -> None:
    env.sync.create_topic("t", partitions=PARTITIONS)
    calls: list[tuple[str, list[Any]]] = []
    release = asyncio.Event()

    async def on_assign(tps: list[Any]) -> None:
        calls.append(("assign", list(tps)))
        try:
            await asyncio.wait_for(release.wait(), 20)
        except TimeoutError:
            pass

    def on_revoke(tps: list[Any]) -> None:
        calls.append(("revoke", list(tps)))

    async with env.connect() as broker:
        a = broker.consumer("t", "g", on_assign=on_assign, on_revoke=on_revoke, **FAST)
        b = broker.consumer("t", "g", **FAST)
        await a.start()
        try:
            await async_wait_until(lambda: len(a.assignment) == PARTITIONS, what="a holds all")
            poller = asyncio.ensure_future(a.poll(timeout=0))
            await async_wait_until(lambda: bool(calls), what="on_assign under way")
            await b.start()
            await async_wait_until(lambda: len(b.assignment) > 0, timeout=30, what="b takes some")
            release.set()
            await poller
            await async_wait_until(
                lambda: len(a.assignment) + len(b.assignment) == PARTITIONS, what="settled"
            )
            await asyncio.sleep(0.5)
            await a.poll(timeout=0)
            assert told_and_held(calls) == set(a.assignment), calls
        finally:
            release.set()
            await a.close()
            await b.close()
