"""The asyncio driver of the delayed-message scheduler: the same core and rounds as the thread
driver (redisq.scheduler, where the timing and the guarantees are described), run by a task."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from redisq.asyncio.client import run_operation
from redisq.futures import remaining
from redisq.scheduler import (
    MAX_BACKOFF_S,
    NETWORK_ERRORS,
    SchedulerCore,
    release_round,
    scheduler_round,
)

if TYPE_CHECKING:
    from redisq.asyncio.handle import AsyncBrokerHandle

log = logging.getLogger("redisq.scheduler")


class Scheduler:
    """Delivers the delayed messages of its topics (or of all_topics) from a task, until
    close(), which hands its leases back.

        from redisq.asyncio.scheduler import Scheduler
        scheduler = Scheduler(broker, ["orders"])
        ...
        await scheduler.close()
    """

    def __init__(
        self,
        broker: AsyncBrokerHandle,
        topics: Iterable[str] = (),
        *,
        all_topics: bool = False,
        start: bool = True,
    ) -> None:
        self._broker = broker
        self._core = SchedulerCore(all_topics=all_topics)
        self._incoming: deque[str] = deque(topics)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._autostart = start  # False: nothing runs before start()
        if start and (all_topics or self._incoming):
            self.start()

    @property
    def delivered(self) -> int:
        """Messages this scheduler appended so far."""
        return self._core.delivered

    @property
    def topics(self) -> list[str]:
        return sorted({*self._core.topics, *self._incoming})

    def held(self) -> list[tuple[str, int]]:
        """The partitions whose scheduler lease this scheduler holds (as of its last call)."""
        return self._core.held()

    def add_topic(self, topic: str) -> None:
        """Deliver this topic's delayed messages too (starts the task on first use)."""
        self._incoming.append(topic)
        if self._autostart:
            self.start()
        self._wake.set()

    def start(self) -> None:
        """Start the task (at once when created with topics, or by add_topic, unless
        start=False was given); needs a running event loop."""
        self._autostart = True
        if self._task is None and not self._closed:
            self._task = asyncio.ensure_future(self._run())

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the task and hand back the leases it holds, within about timeout seconds (from
        a silent server it does not hear back: the leases expire by themselves)."""
        deadline = time.monotonic() + timeout
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        # A flag, not task.cancel(): wait_for() in Python 3.11 can swallow a cancellation that
        # comes as the event it waits for is set.
        self._wake.set()
        try:
            await asyncio.wait_for(task, remaining(deadline))
        except TimeoutError:  # stuck on a silent server: cancelled by wait_for
            log.warning("scheduler did not stop at close(): its leases expire by themselves")
            return
        except Exception as exc:
            log.warning("scheduler did not stop cleanly: %r", exc)
        try:
            await asyncio.wait_for(
                run_operation(release_round(self._core, self._broker.keys), self._broker.scripts),
                remaining(deadline),
            )
        except Exception as exc:  # the leases expire by themselves
            log.warning("scheduler: could not hand back its leases: %r", exc)

    def halt(self) -> None:
        """The close of its owner was cancelled: stop the task now, without waiting (its leases
        run out by themselves)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            self._wake.set()
            task.cancel()

    async def __aenter__(self) -> Scheduler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self) -> None:
        core, keys = self._core, self._broker.keys
        failing = False
        while not self._closed:
            while self._incoming:
                core.add_topic(self._incoming.popleft())
            wait: Any
            try:
                operation = scheduler_round(core, keys, time.monotonic)
                wait = await run_operation(operation, self._broker.scripts)
                if failing:
                    log.info("scheduler: the server answers again")
                failing = False
            except NETWORK_ERRORS as exc:
                if not failing:
                    log.warning("scheduler: %s: %s (retrying)", type(exc).__name__, exc)
                failing = True
                core.round_failed(time.monotonic())
                wait = core.next_wakeup(time.monotonic())
            except Exception:  # never let the scheduler die silently
                log.exception("scheduler round failed")
                core.round_failed(time.monotonic())
                wait = MAX_BACKOFF_S
            if wait > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # a backlog: let other tasks run between calls
