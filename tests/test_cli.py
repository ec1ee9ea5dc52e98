"""The `redisq` command line, run in-process (cli.main) and as a console script."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

import redisq
from redisq import cli
from tests.servers import free_port


@pytest.fixture
def base(valkey_server, namespace) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--url", valkey_server.url, "--namespace", namespace]


def test_topic_commands(base: list[str], valkey_server, namespace, capsys) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["topic", "create", "orders", "--partitions", "3", *base]) == 0
    assert cli.main(["topic", "list", *base]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "orders"
    assert cli.main(["topic", "describe", "orders", *base]) == 0
    out = capsys.readouterr().out
    assert "3 partitions" in out
    assert len([line for line in out.splitlines() if re.match(r"^[0-2]\s+0\b", line)]) == 3
    assert cli.main(["topic", "add-partitions", "orders", "--partitions", "4", *base]) == 0
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    assert broker.topic_config("orders", refresh=True).partitions == 4
    assert cli.main(["topic", "delete", "orders", *base]) == 0
    assert broker.list_topics() == []


def test_errors_are_one_line_and_exit_2(base: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["topic", "describe", "missing", *base]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "redisq: TopicNotFound: topic 'missing' does not exist"
    assert cli.main(["topic", "create", "bad name", *base]) == 2
    assert "InvalidName" in capsys.readouterr().err


def test_produce_from_file_then_consume(
    base, tmp_path: Path, valkey_server, namespace, capsys
) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["topic", "create", "orders", "--partitions", "2", *base]) == 0
    lines = [f"key-{i % 5}:value-{i}" for i in range(200)]
    source = tmp_path / "lines.txt"
    source.write_text("\n".join(lines) + "\n")
    code = cli.main(
        ["produce", "orders", "--file", str(source), "--key-separator", ":", "--progress", *base]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "200 written, 0 duplicates skipped, 0 failed" in err
    assert "[##############################] 200/200" in err  # the progress bar reached the end

    # Default: the real consumer in a temporary group, which is gone afterwards.
    assert cli.main(["consume", "orders", "--max", "200", "--timeout", "20", *base]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 200
    by_key: dict[str, list[int]] = {}
    for row in printed:
        _partition, _offset, key, value = row.split("\t")
        by_key.setdefault(key, []).append(int(value.removeprefix("value-")))
    assert all(values == sorted(values) for values in by_key.values())
    assert sorted(v for values in by_key.values() for v in values) == list(range(200))
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    for p in range(2):
        assert broker.client.xinfo_groups(broker.keys.log("orders", p)) == []

    # Browsing one partition reads without a group.
    assert cli.main(["consume", "orders", "--partition", "0", *base]) == 0
    browsed = capsys.readouterr().out.splitlines()
    assert browsed and all(row.split("\t")[0] == "0" for row in browsed)


def test_produce_stdin_without_separator(valkey_server, namespace) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "REDIS_URL": valkey_server.url}
    subprocess.run(
        [sys.executable, "-m", "redisq.cli", "--namespace", namespace, "topic", "create", "t"],
        env=env,
        check=True,
        capture_output=True,
    )
    result = subprocess.run(
        [sys.executable, "-m", "redisq.cli", "--namespace", namespace, "produce", "t"],
        input=b"one\ntwo\nthree\n",
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    assert [m.value for m in broker.read("t", 0)] == [b"one", b"two", b"three"]
    assert all(m.key is None for m in broker.read("t", 0))


def _valkey_children(pid: int) -> list[int]:
    """Pids of the valkey-server processes whose parent is pid (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "<pid> (<comm>) <state> <ppid> ...": comm may hold spaces, so split after the ")".
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid and comm.startswith("valkey-server"):
            children.append(int(entry.name))
    return children


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan nobody reaps shows as one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.parametrize("when", ["starting", "serving"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_server_command_runs_and_stops(signum: signal.Signals, when: str) -> None:
    """`redisq server` stops on SIGTERM/SIGINT/SIGHUP, whenever the signal lands (also while its
    valkey-server is still starting), exits 0 and leaves no valkey-server behind."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "redisq.cli", "server", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not children:  # the valkey-server process exists (it may not answer yet)
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no valkey-server child appeared"
            children = _valkey_children(process.pid)
            time.sleep(0.005)
        if when == "serving":
            assert process.stdout is not None
            ready = process.stdout.readline().decode()  # it says so once it serves
            assert f"REDIS_URL=redis://127.0.0.1:{port}/0" in ready, process.communicate()
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            while True:
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise
                    time.sleep(0.05)
            assert "valkey_version" in client.info("server")
            client.close()
        process.send_signal(signum)
        _out, err = process.communicate(timeout=30)
        assert process.returncode == 0, err.decode()
        assert [pid for pid in children if _running(pid)] == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for pid in children:  # a failed run must not leak the server it started
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_demo_passes(valkey_server) -> None:  # type: ignore[no-untyped-def]
    """The main job: the demo's own checks must all come out clean on a real server."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "redisq.cli",
            "--url",
            valkey_server.url,
            "demo",
            "--messages",
            "5000",
            "--keys",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "per-key order intact, zero duplicates, nothing lost" in result.stdout
    assert "verdict: OK" in result.stdout


def test_topic_trim_applies_retention_to_idle_partitions(
    base, valkey_server, namespace, capsys
) -> None:  # type: ignore[no-untyped-def]
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    broker.create_topic("t", partitions=2, retention_messages=10)
    with broker.producer() as producer:
        for i in range(300):  # 150 per partition; approximate trimming leaves whole nodes
            producer.send_async("t", b"x", partition=i % 2)
        producer.flush()
    before = broker.describe_topic("t").total_messages
    assert before > 20
    assert cli.main(["topic", "trim", "t", *base]) == 0
    assert f"{before - 20:,} entries past retention removed" in capsys.readouterr().out
    assert [p.length for p in broker.describe_topic("t").partitions] == [10, 10]
