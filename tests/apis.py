"""Both APIs behind one face: a test body written once runs on the thread API and on the asyncio
API (the `api` fixture of tests/conftest.py gives each, on each backend).

The asyncio objects are seen through `Bridge`: a sync facade whose calls run on one event loop
thread and are awaited there when they return an awaitable, so one body reads the same for both
and exceptions come out unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import redisq
import redisq.asyncio as rq

# Imported here, in the main thread: the brokers import these lazily, and with
# PYTHONDONTWRITEBYTECODE every import compiles; a compile in the event loop's thread racing
# pytest's own (assertion rewriting) trips CPython 3.11's "AST constructor recursion depth
# mismatch".
import redisq.consume.consumer  # noqa: F401
import redisq.consume.consumer_async  # noqa: F401
import redisq.produce.producer  # noqa: F401
import redisq.produce.producer_async  # noqa: F401
from redisq.schedule.scheduler import Scheduler
from redisq.schedule.scheduler_async import Scheduler as AsyncScheduler

# How long a bridged call may take (consumer.run of a long test included) before it fails.
BRIDGE_WAIT_S = 180


class Bridge:
    """An asyncio object behind sync calls: attribute reads and method calls run on the loop's
    thread; a returned coroutine is awaited there (an asyncio.Future is returned as it is)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, obj: Any) -> None:
        object.__setattr__(self, "_loop", loop)
        object.__setattr__(self, "_obj", obj)

    def _on_loop(self) -> bool:
        """Called from the loop's own thread (a callback of the asyncio API, a coroutine
        handler): waiting there for the loop would wait for ever."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _run(self, fn: Callable[[], Any]) -> Any:
        if self._on_loop():  # a plain call (pause, seek, assignment) made there: at once
            result = fn()
            if inspect.isawaitable(result) and not isinstance(result, asyncio.Future):
                result.close()
                raise RuntimeError("a bridged coroutine called from the event loop's thread")
            return result

        async def go() -> Any:
            result = fn()
            if inspect.isawaitable(result) and not isinstance(result, asyncio.Future):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(BRIDGE_WAIT_S)

    def __getattr__(self, name: str) -> Any:
        attr = self._run(lambda: getattr(self._obj, name))
        if callable(attr) and not isinstance(attr, type):

            def call(*args: Any, **kwargs: Any) -> Any:
                args = tuple(_unwrap(a) for a in args)
                kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
                return _wrap(self._loop, self._run(lambda: attr(*args, **kwargs)))

            return call
        return _wrap(self._loop, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A callable asyncio object (consumer.idempotent's handler): called on the loop."""
        return _wrap(self._loop, self._run(lambda: self._obj(*args, **kwargs)))

    def __enter__(self) -> Bridge:
        return self

    def __iter__(self) -> Any:
        """`for x in bridge`: the object's `async for`, an item at a time on the loop."""
        return BridgedIterator(self._loop, self._run(lambda: self._obj.__aiter__()))

    def __exit__(self, *exc: object) -> None:
        self.close()

    def await_(self, future: Any) -> Any:
        async def go() -> Any:
            return await future

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(BRIDGE_WAIT_S)


class BridgedIterator:
    """An async iterator behind a sync one (broker.read, iterating a consumer): each item is
    awaited on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, iterator: Any) -> None:
        self._loop = loop
        self._iterator = iterator

    def __iter__(self) -> BridgedIterator:
        return self

    def __next__(self) -> Any:
        async def step() -> Any:
            try:
                return True, await self._iterator.__anext__()
            except StopAsyncIteration:
                return False, None

        more, item = asyncio.run_coroutine_threadsafe(step(), self._loop).result(BRIDGE_WAIT_S)
        if not more:
            raise StopIteration
        return _wrap(self._loop, item)


def _unwrap(value: Any) -> Any:
    """A bridged object handed back to the asyncio API (a handler from consumer.idempotent) is
    the asyncio object itself there."""
    return object.__getattribute__(value, "_obj") if isinstance(value, Bridge) else value


def _wrap(loop: asyncio.AbstractEventLoop, value: Any) -> Any:
    if hasattr(value, "__anext__"):
        return BridgedIterator(loop, value)
    if type(value).__module__.endswith("_async"):  # an object of the asyncio API
        bridge = Bridge(loop, value)
        if type(value).__name__ in ("Producer", "Consumer"):
            bridge.start()  # what `async with` does (the thread API's starts in its constructor)
        return bridge
    return value


class SyncAPI:
    name = "sync"
    loop_thread = None

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        self.broker: Any = redisq.connect(url, namespace=namespace, **options)

    def result(self, future: Any) -> Any:
        return future.result(30)

    def scheduler(self, topics: list[str]) -> Any:
        """A thread scheduler for `topics`, running."""
        return Scheduler(self.broker, topics)

    def shutdown(self) -> None:
        self.broker.close()


class AsyncAPI:
    name = "async"

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.loop_thread = self._thread.name  # where coroutine handlers and callbacks run
        connecting = rq.connect(url, namespace=namespace, **options)
        inner = asyncio.run_coroutine_threadsafe(connecting, self.loop).result(30)
        self.broker: Any = Bridge(self.loop, inner)

    def result(self, future: Any) -> Any:
        return self.broker.await_(future)

    def scheduler(self, topics: list[str]) -> Any:
        """An asyncio scheduler for `topics`, running on the loop, behind a Bridge."""
        inner = object.__getattribute__(self.broker, "_obj")

        async def make() -> Any:
            return AsyncScheduler(inner, topics)

        return Bridge(self.loop, asyncio.run_coroutine_threadsafe(make(), self.loop).result(30))

    def shutdown(self) -> None:
        try:
            self.broker.close()
        finally:
            # As asyncio.run() ends: what close(timeout) left going on in the background is
            # cancelled and awaited before the loop stops (not left to find it closed).
            ending = asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop)
            try:
                ending.result(15)
            except Exception:  # noqa: BLE001 - the loop is stopped below all the same
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=10)


def open_api(name: str, url: str, namespace: str, **options: Any) -> SyncAPI | AsyncAPI:
    """The thread API ("sync") or the asyncio one ("async"); options go to redisq.connect."""
    if name == "sync":
        return SyncAPI(url, namespace, **options)
    return AsyncAPI(url, namespace, **options)


def run_until(
    consumer: Any,
    handler: Callable[..., Any],
    predicate: Callable[[], Any],
    timeout: float = 60.0,
    what: str = "",
) -> None:
    """consumer.run(handler) in a thread (either API) until predicate() holds, then close the
    consumer; what run() raised is raised here, and run() ending first is a failure."""
    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            outcome["handled"] = consumer.run(handler)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    held = False
    try:
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            if predicate():
                held = True
                break
            time.sleep(0.02)
    finally:
        consumer.close()
        thread.join(30)
    if "error" in outcome:
        raise outcome["error"]
    if not held:
        ended = "run() ended" if not thread.is_alive() and "handled" in outcome else "timed out"
        raise AssertionError(f"{ended} before {what or 'the condition held'}")


def poll_and_ack(consumer: Any, count: int, timeout: float = 30) -> list[Any]:
    """Poll (either API), acking each batch as an orderly poll loop must, until count messages
    came (never more: each poll asks for what is missing)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        messages = consumer.poll(timeout=0.2, max_messages=count - len(got))
        if messages:
            consumer.ack(messages)
            got.extend(messages)
    return got


def coroutine_on_asyncio(api: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn on the thread API; on the asyncio API a coroutine function calling it, which the
    consumer awaits on its loop (a plain function it runs in a worker thread): so a test run
    through both APIs also takes the asyncio API's other path for handlers and callbacks."""
    if api.name != "async":
        return fn

    async def call(*args: Any) -> Any:
        return fn(*args)

    return call


# -- reading what either API answers ------------------------------------------------------------


def read_all(broker: Any, topic: str) -> list[redisq.Message]:
    """Every message of a topic, partition by partition in offset order, through a broker of
    either API (the thread API's, or a Bridge)."""
    partitions = broker.describe_topic(topic).config.partitions
    messages: list[redisq.Message] = []
    for p in range(partitions):
        messages += broker.read(topic, p)
    return messages


def failure(api: Any, future: Any) -> BaseException | None:
    """The error a send future failed with (None once it answers), waiting for it."""
    try:
        api.result(future)
    except Exception as exc:
        return exc
    return None


def send_or_error(call: Callable[[], Any]) -> Any:
    """send_async's future, or the error it raised at once."""
    try:
        return call()
    except Exception as exc:
        return exc


def refused(api: Any, error: type[BaseException], call: Callable[[], Any], at_once: bool) -> None:
    """send_async(...) refused with `error`: at once when `at_once`, else at once or through its
    future (the asyncio API answers a topic it has not loaded yet through the future)."""
    outcome = send_or_error(call)
    if not isinstance(outcome, BaseException):
        assert not at_once, f"{api.name}: send_async returned instead of raising {error.__name__}"
        outcome = failure(api, outcome)
    assert isinstance(outcome, error), f"{api.name}: {outcome!r}, not {error.__name__}"
