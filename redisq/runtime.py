"""What asyncio and threads do differently, side by side, and nothing else.

The drivers above the socket are written once, in asyncio (`*_async.py`); their thread twins are
generated (tools/async_to_sync.py), which maps every name here that starts with `A` or `a` to the
same name without it: `AEvent` -> `Event`, `aspawn` -> `spawn`. So each pair below must behave
the same way for the code that uses it, each in its own runtime.

The state guard deserves a word. In asyncio, code between two awaits runs alone, so the state a
driver shares between its tasks needs no lock; threads need one. `AGuard` is therefore no lock
at all and `Guard` is a re-entrant lock; the generator refuses an `await` under
`with self._guard:` (it would become a blocking call holding the lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeAlias, TypeVar

T = TypeVar("T")


def is_async() -> Literal[True]:
    """True in the asyncio drivers. `if is_async(): ... else: ...` keeps only the else branch in
    the generated thread drivers: for what no primitive here names."""
    return True


# -- tasks and threads -----------------------------------------------------------------------
ATask: TypeAlias = "asyncio.Task[Any]"
Task: TypeAlias = threading.Thread


def aspawn(func: Callable[..., Awaitable[Any]], *args: Any, name: str) -> ATask:
    """func(*args) in a task of its own."""
    return asyncio.ensure_future(func(*args))


def spawn(func: Callable[..., Any], *args: Any, name: str) -> Task:
    """func(*args) in a daemon thread of its own."""
    thread = threading.Thread(target=func, args=args, name=name, daemon=True)
    thread.start()
    return thread


async def ajoin(task: ATask, timeout: float | None = None) -> bool:
    """Wait up to timeout seconds (None: for ever) for the task to end; True if it has."""
    if not task.done():
        await asyncio.wait({task}, timeout=timeout)
    return task.done()


def join(thread: Task, timeout: float | None = None) -> bool:
    if thread is not threading.current_thread():
        thread.join(timeout)
    return not thread.is_alive()


def alive(task: ATask | Task) -> bool:
    """Still running (a task not done, a thread alive)."""
    if isinstance(task, threading.Thread):
        return task.is_alive()
    return not task.done()


def acancel(task: ATask) -> None:
    """Cancel the task (its loop's flag is set too: a cancel can be lost on Python 3.11)."""
    task.cancel()


def cancel(thread: Task) -> None:
    """Threads are not cancelled: the flag the thread's loop checks is what stops it."""


async def astop(task: ATask, grace_s: float | None, halt: Callable[[], None]) -> bool:
    """Stop a background task that was told to finish: it gets grace_s (None: no limit) to end
    on its own; then halt() (which sets the flag its loop checks and stops its reads) and
    cancellations, again until it has ended. One cancellation is not enough: on Python 3.11 a
    wait_for() inside redis-py (or the task) whose inner call has just completed returns its
    result and drops the cancel. True if the task ended on its own. If the caller is cancelled
    meanwhile, the task is halted and cancelled before the cancellation goes on (not left
    running)."""
    try:
        done, _ = await asyncio.wait({task}, timeout=grace_s)
    except asyncio.CancelledError:
        halt()
        task.cancel()
        raise
    if done:
        return True
    halt()
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1)
    return False


def stop(thread: Task, grace_s: float | None, halt: Callable[[], None]) -> bool:
    """The thread's twin of astop: grace_s to end on its own, then halt() (its reads raise
    redisq.server.transport.Halted within 50 ms) and one more second. True if it ended on its
    own; a thread that is still stuck is left to end by itself (daemon)."""
    if thread is threading.current_thread():
        halt()
        return False
    thread.join(grace_s)
    if not thread.is_alive():
        return True
    halt()
    thread.join(1.0)
    return False


async def asingle_flight(
    running: dict[Any, asyncio.Future[T]], key: Any, start: Callable[[], Awaitable[T]]
) -> T:
    """start()'s result, with one call per key under way at a time (in `running`), shared by
    every caller that asks meanwhile. Shielded: a cancelled caller does not cancel the others'
    call. (300 gathered first sends to a topic made 300 reads at once without it.)"""
    call = running.get(key)
    if call is None:
        call = running[key] = asyncio.ensure_future(start())

        def done(task: asyncio.Future[T]) -> None:
            if running.get(key) is task:
                del running[key]
            if not task.cancelled():
                task.exception()  # retrieved: every caller may have been cancelled

        call.add_done_callback(done)
    return await asyncio.shield(call)


def single_flight(running: dict[Any, Any], key: Any, start: Callable[[], T]) -> T:
    """Threads each make their own call (a caller is blocked while it runs)."""
    return start()


asleep = asyncio.sleep
sleep = time.sleep


async def arun_blocking(func: Callable[..., T], *args: Any) -> T:
    """A blocking call (a user's plain function, starting a server) off the event loop."""
    return await asyncio.to_thread(func, *args)


def run_blocking(func: Callable[..., T], *args: Any) -> T:
    return func(*args)


async def amaybe_await(value: Any) -> Any:
    """A callback's result: awaited if the callback was a coroutine function."""
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


def maybe_await(value: Any) -> Any:
    return value


def is_coroutine_callable(func: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one (the asyncio drivers await such
    a user function; a plain one goes to acall_user's worker thread)."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


async def acall_user(func: Callable[..., Any], coroutine: bool, *args: Any) -> Any:
    """A user's function (a handler): awaited when it is a coroutine function (`coroutine`, from
    is_coroutine_callable), else run in a worker thread, so a slow one does not stall the
    event loop."""
    if coroutine:
        return await func(*args)
    return await asyncio.to_thread(func, *args)


def call_user(func: Callable[..., Any], coroutine: bool, *args: Any) -> Any:
    return func(*args)


# -- a few calls at once -------------------------------------------------------------------------
class APool:
    """Up to `size` calls of one function at once, over a list of items, until all have ended:
    tasks of the caller's (their context is the caller's, so `initializer` is not needed)."""

    __slots__ = ()

    def __init__(
        self, size: int, name: str, initializer: Callable[..., Any] | None = None, *initargs: Any
    ) -> None:
        pass

    async def run_each(
        self, func: Callable[[Any], Awaitable[Any]], items: Iterable[Any]
    ) -> list[BaseException | None]:
        """func(item) for every item at once; what each raised (None: it returned)."""
        results = await asyncio.gather(*(func(item) for item in items), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    def shutdown(self) -> None:
        pass


class Pool:
    """The same on a pool of `size` threads, started on first use; initializer(*initargs) runs
    first in each (a thread starts with a context of its own)."""

    __slots__ = ("_args", "_executor")

    def __init__(
        self, size: int, name: str, initializer: Callable[..., Any] | None = None, *initargs: Any
    ) -> None:
        self._args = (size, name, initializer, initargs)
        self._executor: ThreadPoolExecutor | None = None

    def run_each(
        self, func: Callable[[Any], Any], items: Iterable[Any]
    ) -> list[BaseException | None]:
        if self._executor is None:
            size, name, initializer, initargs = self._args
            self._executor = ThreadPoolExecutor(
                size, thread_name_prefix=name, initializer=initializer, initargs=initargs
            )
        futures = [self._executor.submit(func, item) for item in items]
        return [future.exception() for future in futures]

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


# -- cancellation ----------------------------------------------------------------------------
ACancelled = asyncio.CancelledError


class Cancelled(BaseException):
    """Threads are not cancelled: the generated drivers' `except Cancelled` never runs. (A
    thread driver is stopped by a flag its loop checks, which the asyncio driver also sets.)"""


# -- events and locks ------------------------------------------------------------------------
class AEvent:
    """asyncio.Event with threading.Event's wait(timeout) -> bool."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout: float | None = None) -> bool:
        if self._event.is_set():
            return True
        if timeout is None:
            await self._event.wait()
            return True
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._event.wait()
        except TimeoutError:
            pass
        return self._event.is_set()


Event = threading.Event

ALock = asyncio.Lock
Lock = threading.Lock


class AGuard(contextlib.AbstractContextManager["AGuard"]):
    """The state guard of an asyncio driver: no lock (see the module doc)."""

    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        return None


Guard = threading.RLock


__all__ = [
    "ACancelled",
    "AEvent",
    "AGuard",
    "ALock",
    "APool",
    "ATask",
    "Cancelled",
    "Event",
    "Guard",
    "Lock",
    "Pool",
    "Task",
    "acall_user",
    "acancel",
    "asingle_flight",
    "aspawn",
    "astop",
    "ajoin",
    "alive",
    "call_user",
    "cancel",
    "amaybe_await",
    "arun_blocking",
    "asleep",
    "is_async",
    "is_coroutine_callable",
    "join",
    "maybe_await",
    "run_blocking",
    "single_flight",
    "sleep",
    "spawn",
    "stop",
]
