"""Numbers over time for the charts: a sampler thread reads the namespace snapshot every few
seconds (pipelined, see snapshot.py) and keeps the last points in memory.

Redis keeps no history of lag or throughput, so the console builds it while it runs: a chart
starts when the console starts. Throughput comes from each partition's entries-added counter
(every append counts, trimming does not lower it), lag from XINFO GROUPS, both read by the
server, so the sampling interval only sets the resolution.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from redisq.inspect import NamespaceSnapshot

log = logging.getLogger("redisq.console")

Point = tuple[float, float]  # (seconds since the epoch, value)


@dataclass(slots=True)
class _Series:
    points: deque[Point]


class History:
    """Ring buffers of (time, value) per topic (messages per second) and per group partition
    (lag), fed by `record`. Thread-safe: the sampler writes, request threads read."""

    def __init__(self, max_points: int = 360) -> None:
        self._max = max_points
        self._lock = threading.Lock()
        self._added: dict[str, deque[tuple[float, int]]] = {}
        self._lag: dict[tuple[str, str], deque[tuple[float, dict[int, int | None]]]] = {}
        self.samples = 0
        self.last_error: str | None = None

    def record(self, snapshot: NamespaceSnapshot) -> None:
        at = snapshot.now_ms / 1000
        with self._lock:
            for name, topic in snapshot.topics.items():
                self._added.setdefault(name, deque(maxlen=self._max)).append(
                    (at, topic.entries_added)
                )
            for ref, group in snapshot.groups.items():
                self._lag.setdefault(ref, deque(maxlen=self._max)).append(
                    (at, {p.partition: p.lag for p in group.partitions})
                )
            for name in set(self._added) - set(snapshot.topics):
                del self._added[name]
            for ref in set(self._lag) - set(snapshot.groups):
                del self._lag[ref]
            self.samples += 1
            self.last_error = None

    def throughput(self, topic: str) -> list[Point]:
        """Messages appended per second between consecutive samples."""
        with self._lock:
            points = list(self._added.get(topic, ()))
        rates = []
        for (t0, a0), (t1, a1) in zip(points, points[1:], strict=False):
            if t1 > t0:
                rates.append((t1, max(a1 - a0, 0) / (t1 - t0)))
        return rates

    def lag(self, topic: str, group: str) -> dict[str, list[Point]]:
        """ "total" and one series per partition ("p0", "p1", ...); unknown lags are skipped."""
        with self._lock:
            points = list(self._lag.get((topic, group), ()))
        series: dict[str, list[Point]] = {"total": []}
        for at, lags in points:
            known = [lag for lag in lags.values() if lag is not None]
            if len(known) == len(lags):
                series["total"].append((at, float(sum(known))))
            for p, lag in sorted(lags.items()):
                if lag is not None:
                    series.setdefault(f"p{p}", []).append((at, float(lag)))
        return series


class Sampler:
    """A daemon thread that calls read() every interval_s and records what it returns."""

    def __init__(
        self, history: History, read: Callable[[], NamespaceSnapshot], interval_s: float
    ) -> None:
        self.history = history
        self._read = read
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="redisq-console-sampler", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.history.record(self._read())
            except Exception as exc:  # the server is down: the pages say so; keep sampling
                self.history.last_error = f"{type(exc).__name__}"
                log.debug("sampling failed: %s", type(exc).__name__)
            elapsed = time.monotonic() - started
            self._stop.wait(max(self.interval_s - elapsed, 0.05))
