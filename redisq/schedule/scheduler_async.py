"""The scheduler of delayed messages (DESIGN §12) as a driver: a task (a thread in the thread
API) running the rounds of redisq.schedule.core until close(), which hands its leases back.

    scheduler = Scheduler(broker, ["orders"])   # or all_topics=True
    ...
    await scheduler.close()

Consumers run one for their topics, producers for the topics they sent delayed messages to, and
`redisq scheduler` for all topics; where the timing and the guarantees are described:
redisq.schedule.core.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis

from redisq.model.timeouts import remaining
from redisq.runtime import AEvent, AGuard, ATask, acancel, ajoin, asleep, aspawn
from redisq.schedule.core import (
    MAX_BACKOFF_S,
    NETWORK_ERRORS,
    SchedulerCore,
    release_round,
    scheduler_round,
)
from redisq.server.scripts_async import run_steps
from redisq.server.transport_async import AsyncTransport

if TYPE_CHECKING:
    from redisq.server.handle_async import AsyncBrokerHandle

log = logging.getLogger("redisq.scheduler")


class Scheduler:
    """Delivers the delayed messages of its topics (or of all_topics) until close()."""

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
        # Topics come in from the API's callers (a producer's send) and are taken up by the
        # scheduler's own loop: nothing else touches the core, and add_topic never waits for I/O.
        self._incoming: deque[str] = deque(topics)
        self._wake = AEvent()
        self._guard = AGuard()
        self._task: ATask | None = None
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
        """Deliver this topic's delayed messages too (starts the scheduler on first use)."""
        self._incoming.append(topic)
        if self._autostart:
            self.start()
        self._wake.set()

    def start(self) -> None:
        """Start it (at once when created with topics, or by add_topic, unless start=False was
        given). The asyncio scheduler needs a running event loop."""
        with self._guard:
            self._autostart = True
            if self._task is None and not self._closed:
                self._task = aspawn(self._run, name="redisq-scheduler")

    async def close(self, timeout: float = 5.0) -> None:
        """Stop, and hand back the leases held, within about timeout seconds (from a silent
        server it does not hear back: the leases expire by themselves)."""
        deadline = time.monotonic() + timeout
        with self._guard:
            self._closed = True
            task, self._task = self._task, None
        if task is None:
            return
        # A flag and a wake-up, not a cancellation: the loop ends at its next check.
        self._wake.set()
        if not await ajoin(task, remaining(deadline)):
            acancel(task)
            log.warning("scheduler did not stop at close(): its leases expire by themselves")
            return
        # Connections of its own, whose reads end at the deadline (a silent server).
        left_ms = max(1, int(1000 * remaining(deadline)))
        transport = AsyncTransport(self._broker.client, left_ms)

        async def execute(steps: Any) -> Any:
            steps = steps if isinstance(steps, list) else [steps]
            return await transport.execute(steps, self._broker.scripts, deadline)

        try:
            await run_steps(release_round(self._core, self._broker.keys), execute)
        except (*NETWORK_ERRORS, redis.RedisError) as exc:  # the leases expire by themselves
            log.warning("scheduler: could not hand back its leases: %s", exc)
        finally:
            await transport.close()

    def halt(self) -> None:
        """Its owner's close was cancelled: stop now, without waiting (the leases run out by
        themselves)."""
        with self._guard:
            self._closed = True
            task, self._task = self._task, None
        self._wake.set()
        if task is not None:
            acancel(task)

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
                wait = await self._broker.scripts.run_operation(operation)
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
                # Set while the round ran (a topic added): the wait returns at once.
                await self._wake.wait(wait)
                self._wake.clear()
            else:
                await asleep(0)  # a backlog: let the others run between calls
