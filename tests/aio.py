"""Helpers for the asyncio guarantee tests (tests/test_asyncio_*.py).

pytest-asyncio is not a dependency: `@aio` runs a coroutine test function under asyncio.run
(one event loop per test, bounded by a deadline). `Env` pairs the test's backend url with the
sync `broker` fixture of the same namespace, which empties the namespace afterwards and reads
what the asyncio API wrote through a second, independent client. Conditions are polled with
deadlines, never waited for with fixed sleeps.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis

import redisq
import redisq.asyncio as rq
from redisq.model.records import Message
from tests.servers import ServerProcess

TEST_DEADLINE_S = 120.0

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}


def aio(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an `async def` test with asyncio.run; pytest still sees the test's fixtures."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(_within_deadline(test(*args, **kwargs)))

    return run


async def _within_deadline(body: Coroutine[Any, Any, None]) -> None:
    """Run the test; past the deadline, fail with the stack of every task still running (a hang
    shows where it is, instead of a bare TimeoutError from the cancelled test)."""
    task = asyncio.ensure_future(body)
    done, _ = await asyncio.wait([task], timeout=TEST_DEADLINE_S)
    if done:
        task.result()
        return
    stacks = [
        f"{other.get_name()}: {_awaiting(other)}"
        for other in asyncio.all_tasks()
        if other is not asyncio.current_task()
    ]
    task.cancel()
    await asyncio.wait([task], timeout=10)
    raise AssertionError(f"still running after {TEST_DEADLINE_S:g} s; tasks:\n" + "\n".join(stacks))


@dataclass
class Env:
    """One backend: its url, and the sync broker of the test's namespace (checks, cleanup)."""

    url: str
    sync: redisq.Broker

    @property
    def namespace(self) -> str:
        return self.sync.namespace

    @asynccontextmanager
    async def connect(self, **options: Any) -> AsyncIterator[rq.Broker]:
        broker = await rq.connect(self.url, namespace=self.namespace, **options)
        try:
            yield broker
        finally:
            await broker.close()


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: its chain of awaited coroutines, outermost first."""
    where = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            name = frame.f_code.co_filename.rsplit("/", 2)[-1]
            where.append(f"{name}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(where)


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, what: str = ""
) -> None:
    """Poll predicate (a function or a coroutine function) until it holds; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def read_all(broker: rq.Broker, topic: str) -> list[Message]:
    """Every message of a topic, partition by partition, in offset order (async broker.read)."""
    config = await broker.topic_config(topic, refresh=True)
    messages: list[Message] = []
    for p in range(config.partitions):
        messages += [m async for m in broker.read(topic, p)]
    return messages


async def produce(broker: rq.Broker, topic: str, keys: int, per_key: int) -> None:
    """{"k": k, "n": n} under key "key<k>", n = 0.. per key, through the asyncio producer."""
    async with broker.producer() as producer:
        for n in range(per_key):
            for k in range(keys):
                producer.send_async(topic, json.dumps({"k": k, "n": n}), key=f"key{k}")


class Recorder:
    """A handler that records (key, n) per call and checks per-key order and exclusivity: one
    handler call at a time per partition, whichever member or lane runs it.

    `recorder.handler("async")` is a coroutine function (run on the loop), `handler("sync")` a
    plain function (the consumer runs it in a worker thread); both record the same way.
    """

    def __init__(
        self, sleep: float = 0.0, fail: Callable[[dict[str, int]], bool] | None = None
    ) -> None:
        self.sleep = sleep
        self.fail = fail
        self.lock = threading.Lock()
        self.done: dict[int, list[int]] = defaultdict(list)
        self.calls: list[tuple[int, int, int]] = []  # (key, n, attempt)
        self.running: dict[tuple[str, int], int] = defaultdict(int)
        self.overlaps = 0
        self.events: list[tuple[str, ...]] = []  # ("handle", member, topic, partition), ...
        self.last: dict[tuple[str, int], str] = {}  # last offset handled per partition
        self.threads: set[str] = set()

    def _enter(self, message: Message) -> dict[str, int]:
        record: dict[str, int] = json.loads(message.value)
        tp = (message.topic, message.partition)
        with self.lock:
            self.calls.append((record["k"], record["n"], message.attempt))
            self.running[tp] += 1
            if self.running[tp] > 1:
                self.overlaps += 1
            self.threads.add(threading.current_thread().name)
        return record

    def _exit(self, message: Message, record: dict[str, int], ok: bool) -> None:
        tp = (message.topic, message.partition)
        with self.lock:
            if ok:
                self.done[record["k"]].append(record["n"])
                self.last[tp] = message.offset
            self.running[tp] -= 1

    def _check(self, record: dict[str, int]) -> None:
        if self.fail is not None and self.fail(record):
            raise RuntimeError(f"cannot handle key{record['k']}#{record['n']}")

    def __call__(self, message: Message) -> None:
        record = self._enter(message)
        ok = False
        try:
            if self.sleep:
                time.sleep(self.sleep)
            self._check(record)
            ok = True
        finally:
            self._exit(message, record, ok)

    async def handle(self, message: Message) -> None:
        record = self._enter(message)
        ok = False
        try:
            await asyncio.sleep(self.sleep)  # a suspension point: overlaps would show
            self._check(record)
            ok = True
        finally:
            self._exit(message, record, ok)

    def handler(self, kind: str) -> Callable[[Message], Any]:
        return self.handle if kind == "async" else self

    def handled(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.done.values())

    def complete(self, keys: int, per_key: int) -> bool:
        """Every (key, n) handled at least once."""
        with self.lock:
            return all(set(self.done.get(k, [])) >= set(range(per_key)) for k in range(keys))


async def start_running(
    consumer: rq.Consumer, handler: Callable[[Message], Any]
) -> asyncio.Task[int]:
    """consumer.run(handler) as a task, once the consumer joined its group (so the group exists
    and a close() that comes early finds run() under way)."""
    await consumer.start()
    return asyncio.ensure_future(consumer.run(handler))


async def run_until(
    consumer: rq.Consumer,
    handler: Callable[[Message], Any],
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout: float = 60.0,
    what: str = "",
) -> None:
    """consumer.run(handler) until predicate holds, then close the consumer."""
    task = await start_running(consumer, handler)
    try:
        await wait_until(lambda: task.done() or predicate(), timeout, what)
        if task.done():
            task.result()  # run() returned or raised before the condition held
            raise AssertionError(f"run() ended before {what}")
    finally:
        await consumer.close()
        await asyncio.wait_for(task, 30)


class Killer(threading.Thread):
    """CLIENT KILL TYPE normal SKIPME yes every `interval` seconds until stopped."""

    def __init__(self, server: ServerProcess, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.client = server.client(socket_timeout=5)
        self.interval = interval
        self.stopping = threading.Event()
        self.killed = 0

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.killed += int(
                    self.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                )
            except redis.RedisError:
                pass

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        self.client.close()


# -- a member that crashes for real --------------------------------------------------------------
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
    async def poll() -> None:
        broker = await rq.connect(url, namespace=namespace)
        consumer = broker.consumer(topic, group, name, **options)
        got: list[tuple[int, str]] = []
        while len(got) < count:
            got += [(m.partition, m.offset) for m in await consumer.poll(10, count - len(got))]
        conn.send(got)
        while True:  # until SIGKILL: no commit, no lease release, no leave
            await asyncio.sleep(3600)

    asyncio.run(poll())


def async_poll_then_crash(
    url: str, namespace: str, topic: str, group: str, name: str, count: int, **options: Any
) -> list[tuple[int, str]]:
    """An asyncio consumer in a child process polls `count` messages and is SIGKILLed; returns
    (partition, offset) of what it got (as tests.crash.poll_then_crash, with the asyncio API).
    Blocking: call it through asyncio.to_thread from a test's event loop."""
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
