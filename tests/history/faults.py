"""Fault drivers: worker processes the test can command, signal and kill, and a driver that does
the faults and records each one (local wall and monotonic time, and the server's TIME where the
server is up) in the driver's own history file."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

from tests.history.recorder import Recorder, ServerClock
from tests.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A `python -m tests.history.worker` process; stdin takes commands, stdout answers them."""

    def __init__(self, proc: str, args: list[str], history: Path) -> None:
        self.proc = proc
        self.history = history
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.history.worker", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def command(self, op: str, timeout: float = 120.0, **fields: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (AssertionError if the process died)."""
        self.start_command(op, **fields)
        return self.wait_reply(op, timeout)

    def start_command(self, op: str, **fields: Any) -> None:
        """Send one command; its answer is taken with wait_reply()."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.popen.stdin.flush()

    def wait_reply(self, op: str, timeout: float = 120.0) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.proc}: no answer to {op!r} within {timeout} s") from None
        if reply is None:
            raise AssertionError(f"{self.proc} exited ({self.popen.poll()}) during {op!r}")
        return reply

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def finish(self, timeout: float = 30.0) -> None:
        """Stop it politely (exit command / SIGTERM), by force after timeout; reap it."""
        if self.alive():
            self.signal(signal.SIGCONT)
            try:
                if self.popen.stdin is not None and not self.popen.stdin.closed:
                    self.popen.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    self.popen.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class Driver:
    """Does the faults and records them as `fault` events (action, target, server_ms). The
    server's TIME comes from the server a fault is about, else from clock_url, when it answers
    (a stop is recorded before its signal, a continue after it, so a recorded SIGSTOP window
    covers the real one)."""

    def __init__(self, history: Path, clock_url: str | None = None) -> None:
        self.recorder = Recorder(history, "driver")
        self.clock = ServerClock(clock_url)

    def record(
        self, action: str, target: str, server: ServerProcess | None = None, **detail: Any
    ) -> None:
        server_ms = _server_ms(server) if server is not None else self.clock.now_ms()
        self.recorder.record("fault", action=action, target=target, server_ms=server_ms, **detail)

    # -- servers -----------------------------------------------------------------------------
    def kill_server(self, server: ServerProcess, target: str = "server") -> None:
        self.record("kill", target, server, pid=server.pid)
        server.kill()

    def restart_server(self, server: ServerProcess, target: str = "server") -> None:
        """Start it again on the same port and directory (an AOF, if any, is replayed)."""
        server.start()
        self.record("restart", target, server, pid=server.pid)

    def stop_server(self, server: ServerProcess, target: str = "server") -> None:
        self.record("stop", target, server, pid=server.pid)
        os.kill(server.pid, signal.SIGSTOP)

    def cont_server(self, server: ServerProcess, target: str = "server") -> None:
        os.kill(server.pid, signal.SIGCONT)
        self.record("cont", target, server, pid=server.pid)

    # -- worker processes ----------------------------------------------------------------------
    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL: the process dies at once (recorded just before the signal)."""
        self.record("kill", worker.proc, pid=worker.pid)
        worker.signal(signal.SIGKILL)
        worker.popen.wait(10)

    def stop(self, worker: WorkerProcess) -> None:
        """SIGSTOP, recorded before the signal: the window starts no later than recorded."""
        self.record("stop", worker.proc, pid=worker.pid)
        worker.signal(signal.SIGSTOP)

    def cont(self, worker: WorkerProcess) -> None:
        """SIGCONT, recorded after the signal: the window ends no earlier than recorded."""
        worker.signal(signal.SIGCONT)
        self.record("cont", worker.proc, pid=worker.pid)

    def finish(self, worker: WorkerProcess) -> None:
        """Stop a worker politely and record when it was gone."""
        worker.finish()
        self.record("exit", worker.proc, pid=worker.pid, code=worker.popen.returncode)

    def close(self) -> None:
        self.recorder.close()
        self.clock.close()


def _server_ms(server: ServerProcess) -> float | None:
    if server.process is None or server.process.poll() is not None:
        return None
    try:
        with redis.Redis(port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5) as c:
            seconds, micros = c.time()
    except (redis.RedisError, OSError):
        return None
    return int(seconds) * 1000.0 + int(micros) / 1000.0


def wait_until(condition: Any, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll condition() until true; AssertionError naming `what` after timeout. Returns the
    seconds it took. Errors of a server that is down count as false."""
    started = time.monotonic()
    deadline = started + timeout
    last: BaseException | None = None
    while True:
        try:
            if condition():
                return time.monotonic() - started
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} ({last!r})")
        time.sleep(interval)
