"""Primaries with real replicas (REPLICAOF) and Sentinels, started as processes on loopback
ports for the durability, Sentinel and deployment tests. Everything is stopped by process id."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tests.servers import ServerProcess, free_port

SERVICE = "mymaster"


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "") -> None:
    """Poll condition until it is true (errors count as false), or fail after timeout."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what or condition}: {last!r}")


def replication_info(server: ServerProcess) -> dict[str, object]:
    with server.client(socket_timeout=5) as client:
        return dict(client.info("replication"))


def in_sync(primary: ServerProcess, replica: ServerProcess) -> bool:
    """The replica's link is up and it has acknowledged the primary's whole stream."""
    p = replication_info(primary)
    r = replication_info(replica)
    if r.get("master_link_status") != "up" or not p.get("connected_slaves"):
        return False
    return int(r.get("slave_repl_offset", -1)) >= int(p.get("master_repl_offset", 0))  # type: ignore[call-overload]


def start_replica(
    primary: ServerProcess,
    binary: str | None = None,
    config: dict[str, str] | None = None,
    config_file: str | None = None,
) -> ServerProcess:
    """A replica of primary (REPLICAOF on the command line), returned once in sync."""
    replica = ServerProcess(
        binary or primary.binary,
        config={"replicaof": f"127.0.0.1 {primary.port}", **(config or {})},
        config_file=config_file,
    ).start()
    wait_for(lambda: in_sync(primary, replica), what="the replica to sync")
    return replica


SENTINEL_CONF = """\
sentinel monitor {service} 127.0.0.1 {port} {quorum}
sentinel down-after-milliseconds {service} {down_after_ms}
sentinel failover-timeout {service} 10000
sentinel parallel-syncs {service} 1
"""


class SentinelProcess(ServerProcess):
    """redis-server/valkey-server --sentinel with a config file of its own (Sentinel rewrites it).

    template: a sentinel.conf to start from (docker/sentinel.conf); its `sentinel monitor` line
    is pointed at the test's primary. Without one, a minimal config is written."""

    def __init__(
        self,
        binary: str,
        primary: ServerProcess,
        *,
        quorum: int = 1,
        down_after_ms: int = 1000,
        template: Path | None = None,
        service: str = SERVICE,
    ) -> None:
        super().__init__(binary, port=free_port(), config={})
        self.config = {}  # no save/appendonly: not sentinel directives on every version
        conf = self.dir / "sentinel.conf"
        if template is None:
            text = SENTINEL_CONF.format(
                service=service, port=primary.port, quorum=quorum, down_after_ms=down_after_ms
            )
        else:
            lines = []
            for line in template.read_text().splitlines():
                words = line.split()
                if words[:2] == ["sentinel", "monitor"]:
                    service = words[2]
                    line = f"sentinel monitor {service} 127.0.0.1 {primary.port} {quorum}"
                elif words[:2] == ["sentinel", "down-after-milliseconds"]:
                    line = f"sentinel down-after-milliseconds {service} {down_after_ms}"
                elif words[:1] in (["port"], ["dir"], ["logfile"]):
                    continue  # given on the command line
                lines.append(line)
            text = "\n".join(lines) + "\n"
        conf.write_text(text)
        self.config_file = str(conf)
        self.service = service

    def start(self, timeout: float = 15.0) -> SentinelProcess:
        args = [self.binary, str(self.config_file), "--sentinel", "--port", str(self.port)]
        args += ["--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--logfile", str(self.dir / "server.log"), "--daemonize", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def master_port(self) -> int:
        with self.client(socket_timeout=5) as client:
            host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def knows_replica(self) -> bool:
        with self.client(socket_timeout=5) as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.service)
        for entry in replicas:
            pairs = (
                entry.items()
                if isinstance(entry, dict)
                else zip(entry[::2], entry[1::2], strict=False)
            )
            fields = {_text(k): _text(v) for k, v in pairs}
            flags, link = fields.get("flags", ""), fields.get("master-link-status", "")
            if "disconnected" not in flags and "s_down" not in flags and link == "ok":
                return True
        return False


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
