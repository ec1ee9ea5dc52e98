"""History files: one JSON object per line, one file per process, each line flushed at once.

Every event has `ev` (its kind), `proc` (the process that wrote it), `wall` (time.time() in ms)
and `mono` (time.monotonic() in s, for durations inside one process). Events that need a
cross-process order also carry `server_ms`, the server's TIME in ms, or None when the server
did not answer within a short timeout (stopped, killed, cut off): then `wall` stands in, which
is the same clock on this machine (see the package docstring).

Event kinds (fields beyond the common ones):
    proc_start        pid
    proc_exit         (the process is about to exit cleanly)
    init_done         inst, name, server_ms, producer_id, epoch    a producer instance is ready
    send_invoke       inst, name, key, value, seq [, delay_ms]    before send()/send_async()
    send_ok           inst, value, partition, offset, dup [, schedule_id, deliver_at_ms]
                      (a delayed send: offset None, the message is in the partition's schedule;
                      deliver_at_ms is its due time, None when it had already been delivered)
    send_fail         inst, value, error, message
    handle_start      member, call, partition, offset, key, value, attempt, server_ms
    handle_end        member, call, partition, offset, server_ms
    fault             action, target, server_ms, detail           written by fault drivers
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis


def now_wall_ms() -> float:
    return time.time() * 1000.0


class Recorder:
    """Appends events to one history file; thread-safe; each event is one os.write of one line
    (O_APPEND), so a SIGKILL leaves at most one partial last line, which the reader skips."""

    def __init__(self, path: Path | str, proc: str) -> None:
        self.path = Path(path)
        self.proc = proc
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, ev: str, **fields: Any) -> dict[str, Any]:
        event = {"ev": ev, "proc": self.proc, "wall": now_wall_ms(), "mono": time.monotonic()}
        event.update(fields)
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class ServerClock:
    """The server's TIME in ms on a connection of its own, with a short timeout: a recorder must
    never hang on a stopped server (None then; the event's wall time stands in)."""

    def __init__(self, url: str | None, timeout: float = 0.5) -> None:
        self._client = (
            redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
            if url
            else None
        )
        self._lock = threading.Lock()

    def now_ms(self) -> float | None:
        if self._client is None:
            return None
        try:
            with self._lock:
                seconds, micros = self._client.time()
        except (redis.RedisError, OSError):
            return None
        return int(seconds) * 1000.0 + int(micros) / 1000.0

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one file; a torn last line (the writer was killed) is skipped."""
    events = []
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                break
            try:
                events.append(json.loads(raw))
            except ValueError:
                continue
    return events


class Tail:
    """Reads the new complete lines of every history file of a directory, incrementally, so a
    test can poll a condition over the history without re-reading everything each time."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """New events since the last poll (also appended to self.events)."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1
            for raw in data[:end].splitlines():
                try:
                    new.append(json.loads(raw))
                except ValueError:
                    continue
            self._offsets[path] = offset + end
        self.events.extend(new)
        return new

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.events)
