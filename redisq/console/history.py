"""Numbers over time for the charts: a sampler thread reads the namespace snapshot every few
seconds (pipelined, see snapshot.py), keeps the last points in memory, and stores them in Redis
so the charts survive a console restart.

Redis keeps no history of lag or throughput, so the console builds it: throughput from each
partition's entries-added counter (every append counts, trimming does not lower it), lag from
XINFO GROUPS, both read by the server, so the sampling interval only sets the resolution.

Stored history: one sorted set per series in the namespace (keys.console_series: a topic's
appended count, a group's lag per partition), a sample per member scored by its time, trimmed
to the newest `max_points` on every write and expiring a week after the last one (a deleted
topic's series goes away). A series is loaded the first time the sampler sees its topic or
group (one pipelined round trip per sample that brings new ones). A read-only console loads
the stored history but writes none: it changes nothing in Redis.

Time without samples is never drawn as a line: throughput is a step per sampling interval
(the rate holds from one sample to the next, so a silent interval is a flat zero, not a slope
from the last busy sample), and where samples are missing (the console was stopped) the line
breaks, unless the counter did not move, which is a known zero.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from redisq.protocol.overview import NamespaceSnapshot

if TYPE_CHECKING:
    from redisq.broker import Broker

log = logging.getLogger("redisq.console")

Point = tuple[float, float | None]  # (seconds since the epoch, value); None: the line breaks
Lags = dict[int, int | None]
MAX_POINTS = 720  # per series: an hour at the default 5 s
STORED_TTL_MS = 7 * 24 * 3600 * 1000
GAP_INTERVALS = 2.5  # samples further apart than this many intervals leave a gap


def _added_series(topic: str) -> str:
    return f"added:{topic}"


def _lag_series(topic: str, group: str) -> str:
    return f"lag:{topic}:{group}"


class ChartStore:
    """The charts' samples in Redis (see the module docstring)."""

    def __init__(self, broker: Broker, *, write: bool, max_points: int = MAX_POINTS) -> None:
        self._broker = broker
        self.write = write
        self._max = max_points

    def _key(self, series: str) -> str:
        return self._broker.keys.console_series(series)

    def load(self, series: list[str]) -> dict[str, list[tuple[float, str]]]:
        """The stored samples of each series, oldest first: (seconds, the value as stored)."""
        if not series:
            return {}
        pipe = self._broker.client.pipeline(transaction=False)
        for name in series:
            pipe.zrange(self._key(name), -self._max, -1)
        found: dict[str, list[tuple[float, str]]] = {}
        for name, reply in zip(series, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                log.debug("chart history of %s not loaded: %s", name, type(reply).__name__)
                continue
            points = []
            for member in reply:
                ms, _, value = (member.decode() if isinstance(member, bytes) else member).partition(
                    ":"
                )
                if ms.isdigit():
                    points.append((int(ms) / 1000, value))
            found[name] = points
        return found

    def save(self, now_ms: int, samples: dict[str, str]) -> None:
        """One sample per series at now_ms, each set trimmed to its newest points."""
        if not self.write or not samples:
            return
        pipe = self._broker.client.pipeline(transaction=False)
        for name, value in samples.items():
            key = self._key(name)
            pipe.zadd(key, {f"{now_ms}:{value}": now_ms})
            pipe.zremrangebyrank(key, 0, -self._max - 1)
            pipe.pexpire(key, STORED_TTL_MS)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise reply

    def delete(self, series: list[str]) -> None:
        if self.write and series:
            self._broker.client.delete(*(self._key(name) for name in series))


class History:
    """Ring buffers of (time, value) per topic (messages appended) and per group (lag per
    partition), fed by `record`, loaded from and saved to `store` when one is given.
    Thread-safe: the sampler writes, request threads read."""

    def __init__(
        self,
        max_points: int = MAX_POINTS,
        *,
        store: ChartStore | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self._max = max_points
        self._store = store
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._added: dict[str, deque[tuple[float, int]]] = {}
        self._lag: dict[tuple[str, str], deque[tuple[float, Lags]]] = {}
        self.samples = 0
        self.last_error: str | None = None
        self._forgotten: set[str] = set()  # deleted topics the next sample must not bring back

    def record(self, snapshot: NamespaceSnapshot) -> None:
        at = snapshot.now_ms / 1000
        with self._lock:
            gone, self._forgotten = self._forgotten, set()
        if gone:  # the sampler may have read before the delete: that sample skips them
            snapshot = NamespaceSnapshot(
                now_ms=snapshot.now_ms,
                topics={n: t for n, t in snapshot.topics.items() if n not in gone},
                groups={ref: g for ref, g in snapshot.groups.items() if ref[0] not in gone},
            )
        new_topics = [name for name in snapshot.topics if name not in self._added]
        new_groups = [ref for ref in snapshot.groups if ref not in self._lag]
        stored = self._load(new_topics, new_groups)
        with self._lock:
            for name in new_topics:
                self._added[name] = deque(
                    ((t, int(v)) for t, v in stored.get(_added_series(name), []) if t < at),
                    maxlen=self._max,
                )
            for ref in new_groups:
                self._lag[ref] = deque(
                    ((t, _lags(v)) for t, v in stored.get(_lag_series(*ref), []) if t < at),
                    maxlen=self._max,
                )
            for name, topic in snapshot.topics.items():
                self._added[name].append((at, topic.appended))
            for ref, group in snapshot.groups.items():
                self._lag[ref].append((at, {p.partition: p.lag for p in group.partitions}))
            for name in set(self._added) - set(snapshot.topics):
                del self._added[name]
            for ref in set(self._lag) - set(snapshot.groups):
                del self._lag[ref]
            self.samples += 1
            self.last_error = None
        if self._store is not None:
            samples = {_added_series(n): str(t.appended) for n, t in snapshot.topics.items()}
            for (topic_name, group_name), g in snapshot.groups.items():
                lags = {str(p.partition): p.lag for p in g.partitions}
                encoded = json.dumps(lags, separators=(",", ":"))
                samples[_lag_series(topic_name, group_name)] = encoded
            try:
                self._store.save(snapshot.now_ms, samples)
            except Exception as exc:  # the charts go on in memory; the pages say nothing
                log.debug("chart history not stored: %s", type(exc).__name__)

    def forget(self, topic: str, groups: list[str]) -> None:
        """A deleted topic's series, in memory and stored (a topic created again under its name
        starts a chart of its own)."""
        with self._lock:
            self._forgotten.add(topic)
            self._added.pop(topic, None)
            for group in groups:
                self._lag.pop((topic, group), None)
        if self._store is not None:
            names = [_added_series(topic)] + [_lag_series(topic, g) for g in groups]
            try:
                self._store.delete(names)
            except Exception as exc:  # they expire anyway
                log.debug("chart history of %s not deleted: %s", topic, type(exc).__name__)

    def _load(
        self, topics: list[str], groups: list[tuple[str, str]]
    ) -> dict[str, list[tuple[float, str]]]:
        if self._store is None or not (topics or groups):
            return {}
        names = [_added_series(t) for t in topics] + [_lag_series(*ref) for ref in groups]
        try:
            return self._store.load(names)
        except Exception as exc:  # no stored history: the chart starts now
            log.debug("chart history not loaded: %s", type(exc).__name__)
            return {}

    def _gap(self, t0: float, t1: float) -> bool:
        return t1 - t0 > GAP_INTERVALS * self.interval_s

    def throughput(self, topic: str) -> list[Point]:
        """Messages appended per second, as steps: each interval between two samples is drawn
        flat at its rate (zero when nothing was appended); across missing samples, zero if the
        counter did not move, else a break (None: the rate there is unknown)."""
        with self._lock:
            samples = list(self._added.get(topic, ()))
        points: list[Point] = []
        for (t0, a0), (t1, a1) in zip(samples, samples[1:], strict=False):
            if t1 <= t0:
                continue
            added = max(a1 - a0, 0)
            if self._gap(t0, t1) and added:
                points.append((t0, None))
                continue
            rate = added / (t1 - t0)
            points += [(t0, rate), (t1, rate)]
        return points

    def current_rate(self, topic: str) -> float:
        """The rate of the last interval sampled (0 before there is one)."""
        for _, value in reversed(self.throughput(topic)):
            return value or 0.0
        return 0.0

    def lag(self, topic: str, group: str) -> dict[str, list[Point]]:
        """ "total" and one series per partition ("p0", "p1", ...); unknown lags are skipped,
        and the lines break where samples are missing."""
        with self._lock:
            samples = list(self._lag.get((topic, group), ()))
        series: dict[str, list[Point]] = {"total": []}
        previous: float | None = None
        for at, lags in samples:
            if previous is not None and self._gap(previous, at):
                for points in series.values():
                    points.append((previous, None))
            previous = at
            known = [lag for lag in lags.values() if lag is not None]
            if len(known) == len(lags):
                series["total"].append((at, float(sum(known))))
            for p, lag in sorted(lags.items()):
                if lag is not None:
                    series.setdefault(f"p{p}", []).append((at, float(lag)))
        return series


def _lags(stored: str) -> Lags:
    try:
        raw = json.loads(stored)
        return {int(p): (None if lag is None else int(lag)) for p, lag in raw.items()}
    except (ValueError, AttributeError, TypeError):
        return {}


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
