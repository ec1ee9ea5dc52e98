"""The embedded server: one per user, shared by every process, found again, never a stranger's;
throwaway servers that never outlive their parent.

Every test works in a REDISQ_HOME of its own (never the user's data directory) and stops the
servers it started, by pid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import redisq
from redisq.server import embedded

REDISQ = [sys.executable, "-m", "redisq.cli"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """REDISQ_HOME in the test's directory and no REDIS_URL, here and in the subprocesses; the
    shared server is stopped afterwards."""
    root = tmp_path / "redisq-home"
    monkeypatch.setenv("REDISQ_HOME", str(root))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(embedded, "_noticed", False)
    yield root
    embedded.stop_shared_server()
    for pid in _servers_in(root / "data"):  # a failed test may have started more than one
        os.kill(pid, signal.SIGKILL)


def _servers_in(directory: Path) -> list[int]:
    """Pids of the processes working in directory (valkey-server works in its --dir)."""
    return sorted(
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _cwd(entry).removesuffix(" (deleted)") == str(directory)
    )


def _state(root: Path) -> dict | None:  # type: ignore[type-arg]
    try:
        return json.loads((root / embedded.STATE_FILE).read_text())  # type: ignore[no-any-return]
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REDISQ, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


def test_what_one_command_writes_the_next_one_reads(home: Path) -> None:
    """The README's sequence on a fresh machine: each command is a process of its own."""
    created = _run("topic", "create", "orders", "--partitions", "4")
    assert created.returncode == 0, created.stderr
    state = _state(home)
    assert state is not None and state["data_dir"] == str(home / "data")
    notice = created.stderr.strip().splitlines()
    assert len(notice) == 1, created.stderr  # one line, once per process
    assert "started the embedded valkey-server" in notice[0]
    assert f"127.0.0.1:{state['port']}" in notice[0] and str(home / "data") in notice[0]

    produced = _run("produce", "orders", "--key-separator", ":", stdin=b"a:1\nb:2\n")
    assert produced.returncode == 0, produced.stderr
    assert "embedded" not in produced.stderr  # nothing said of a server that runs already
    consumed = _run("consume", "orders", "--max", "2", "--print-key", "--timeout", "20")
    assert consumed.returncode == 0, consumed.stderr
    assert sorted(consumed.stdout.splitlines()) == ["a\t1", "b\t2"]
    assert _state(home) == state  # the same server all along
    assert (home / "data" / "appendonlydir").is_dir()  # its data where the notice says


def test_data_survives_a_stop_and_a_killed_server(home: Path) -> None:
    url, started = embedded.shared_server()[0].url, True
    assert started
    with redisq.connect(url, namespace="keep") as broker:
        broker.create_topic("t", partitions=2)
        with broker.producer() as producer:
            producer.send("t", b"kept", key="k")
    assert _run("server", "stop").returncode == 0
    assert embedded.server_status() is None
    status = _run("server", "status")
    assert status.returncode == 3 and "no embedded valkey-server runs" in status.stdout

    started_state, started = embedded.shared_server()  # the same data, read back from the AOF
    assert started
    with redisq.connect(started_state.url, namespace="keep") as broker:
        assert broker.describe_topic("t").total_messages == 1
        broker.client.execute_command("WAITAOF", 1, 0, 5000)  # on disk before the SIGKILL
    os.kill(started_state.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(started_state.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    again, started = embedded.shared_server()
    assert started and again.pid != started_state.pid
    with redisq.connect(again.url, namespace="keep") as broker:
        assert [m.value for p in range(2) for m in broker.read("t", p)] == [b"kept"]


def test_concurrent_first_uses_start_one_server(home: Path) -> None:
    """Six processes that ask at the same moment share one server (the file lock)."""
    script = (
        "import sys, time\n"
        "from redisq.server import embedded\n"
        "time.sleep(max(0.0, float(sys.argv[1]) - time.time()))\n"
        "state, _ = embedded.shared_server()\n"
        "print(state.pid, state.port)\n"
    )
    start_at = str(time.time() + 2.0)  # after every interpreter has started
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, start_at],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        for _ in range(6)
    ]
    answers = {p.communicate(timeout=90)[0].strip() for p in processes}
    assert all(p.returncode == 0 for p in processes)
    assert len(answers) == 1, answers
    assert _servers_in(home / "data") == [int(answers.pop().split()[0])]


def _cwd(process: Path) -> str:
    """A process's working directory: valkey-server works in its --dir (and rewrites its
    command line, so that does not tell)."""
    try:
        return os.readlink(process / "cwd")
    except OSError:
        return ""


def test_a_stranger_on_the_recorded_port_is_never_used(home: Path) -> None:
    """The recorded server died and another server took its port: the pid INFO answers is not
    the recorded one, so a server of our own starts (on its own data) instead."""
    with embedded.throwaway_server() as stranger:
        home.mkdir(parents=True)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (home / embedded.STATE_FILE).write_text(
            json.dumps(
                {
                    "port": stranger.port,
                    "pid": dead.pid,
                    "data_dir": str(home / "data"),
                    "log_file": str(home / "valkey.log"),
                    "started_ms": 0,
                }
            )
        )
        with redis.Redis(port=stranger.port) as client:
            client.set("stranger", "1")
        state, started = embedded.shared_server()
        assert started and state.port != stranger.port and state.pid != stranger.pid
        with redis.Redis(port=state.port) as client:
            assert client.get("stranger") is None


def test_connect_without_url_uses_the_shared_server_and_says_so_once(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="redisq.embedded")
    first = redisq.connect(namespace="a")
    second = redisq.connect(namespace="a")
    try:
        assert first.embedded and second.embedded
        first.create_topic("seen", partitions=1)
        assert second.list_topics() == ["seen"]
    finally:
        first.close()
        second.close()
    notices = [r.getMessage() for r in caplog.records if r.name == "redisq.embedded"]
    assert len(notices) == 1 and str(home / "data") in notices[0]


def test_server_start_status_stop(home: Path) -> None:
    started = _run("server", "start")
    assert started.returncode == 0 and "started: REDIS_URL=redis://127.0.0.1:" in started.stdout
    again = _run("server", "start")
    assert "already running" in again.stdout
    status = _run("server", "status")
    state = _state(home)
    assert status.returncode == 0 and state is not None
    assert f"REDIS_URL=redis://127.0.0.1:{state['port']}/0" in status.stdout
    assert f"pid {state['pid']}" in status.stdout and str(home / "data") in status.stdout
    stopped = _run("server", "stop")
    assert stopped.returncode == 0 and f"pid {state['pid']}" in stopped.stdout
    assert not _alive(state["pid"])
    assert _run("server", "stop").stdout.startswith("no embedded valkey-server was running")


def test_throwaway_server_dies_with_its_parent_even_on_sigkill(tmp_path: Path) -> None:
    """SIGKILL gives the parent no chance to clean up: the kernel kills the server
    (PR_SET_PDEATHSIG), and its directory was never kept."""
    script = (
        "import sys, time\n"
        "from redisq.server.embedded import throwaway_server\n"
        "with throwaway_server() as server:\n"
        "    print(server.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        directory = _cwd(Path(f"/proc/{pid}"))
        assert directory.startswith(tempfile.gettempdir()) and directory.endswith(" (deleted)")
        assert _alive(pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the throwaway server outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_throwaway_server_stops_at_the_end_of_its_block() -> None:
    with embedded.throwaway_server() as server:
        with redisq.connect(server.url, namespace="x") as broker:
            broker.create_topic("t")
        pid = server.pid
    assert not _alive(pid)


def test_home_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REDISQ_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert embedded.home() == tmp_path / "xdg" / "redisq"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert embedded.home() == tmp_path / "user" / ".local" / "share" / "redisq"
    monkeypatch.setenv("REDISQ_HOME", str(tmp_path / "explicit"))
    assert embedded.home() == tmp_path / "explicit"


def _environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_embedded_servers_run_with_a_larger_malloc_cache(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared server and a throwaway one start with glibc's per-thread cache of freed chunks
    enlarged: the produce scripts' server time grows with the heap without it (README)."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    expected = f"{embedded.MALLOC_TUNABLE}=65535"
    state, started = embedded.shared_server()
    assert started
    assert _environment_of(state.pid)["GLIBC_TUNABLES"] == expected
    with embedded.throwaway_server() as server:
        assert _environment_of(server.pid)["GLIBC_TUNABLES"] == expected


def test_a_users_own_glibc_tunables_are_kept() -> None:
    # (glibc rewrites GLIBC_TUNABLES in the environment of a process it starts with several, so
    # this is checked on what the server is given rather than in /proc)
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}
    assert embedded.server_environment(theirs) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=65535",
        "PATH": "/bin",
    }
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    assert embedded.server_environment(mine) == mine
