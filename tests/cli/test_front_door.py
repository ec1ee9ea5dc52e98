"""Issue 36, "a front door without traps": what a new user of the `redisq` command met.

Re-running `produce` stores nothing twice (message ids from the input); commands say one short
line about the embedded server, draw progress only on a terminal; the slips (a topic re-created
with another partition count, `.` and `..` as names, a long line, a signal during produce, GROUP
TOPIC, rediss:// to a plain port, "1 partitions", no way to wipe the embedded server, no
REDISQ_NAMESPACE) are refused or fixed. Commands run in-process (cli.main) where that is enough,
as a subprocess where a signal, a terminal or the environment matters.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import redisq
import redisq.model.keys
from redisq import cli
from redisq.cli.common import Progress
from redisq.server import embedded
from tests.conftest import wait_until

REDISQ = [sys.executable, "-m", "redisq.cli"]


@pytest.fixture(autouse=True)
def _own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Never the user's data directory, whatever a command falls back to; an embedded server a
    test started is stopped afterwards."""
    root = tmp_path / "redisq-home"
    monkeypatch.setenv("REDISQ_HOME", str(root))
    yield root
    embedded.stop_shared_server()


@pytest.fixture
def base(valkey_server: Any, namespace: str) -> list[str]:
    return ["--url", valkey_server.url, "--namespace", namespace]


@pytest.fixture
def broker(valkey_server: Any, namespace: str) -> Iterator[redisq.Broker]:
    with redisq.connect(valkey_server.url, namespace=namespace) as broker:
        yield broker


def run(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REDISQ, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=env if env is not None else os.environ.copy(),
    )


def stored(broker: redisq.Broker, topic: str) -> list[redisq.Message]:
    partitions = broker.topic_config(topic, refresh=True).partitions
    return [m for p in range(partitions) for m in broker.read(topic, p)]


# -- 1. produce takes its message ids from the input ---------------------------------------------
@pytest.mark.parametrize(
    ("options", "lines"),
    [
        (["--message-id", "field:id"], [json.dumps({"id": f"o-{i}", "n": i}) for i in range(30)]),
        (["--message-id", "key", "--key-separator", ":"], [f"k{i}:v{i}" for i in range(30)]),
        (["--message-id", "hash"], [f"line {i}" for i in range(30)]),
    ],
)
def test_a_rerun_of_produce_stores_nothing_twice(
    base: list[str],
    broker: redisq.Broker,
    capsys: Any,
    tmp_path: Path,
    options: list[str],
    lines: list[str],
) -> None:
    broker.create_topic("t", partitions=3)
    source = tmp_path / "lines"
    source.write_text("".join(line + "\n" for line in lines))
    for attempt, expected in enumerate(
        ["30 written, 0 duplicates skipped, 0 failed", "0 written, 30 duplicates skipped, 0 failed"]
    ):
        assert cli.main(["produce", "t", "--file", str(source), *options, *base]) == 0, attempt
        assert capsys.readouterr().err.strip().splitlines()[-1] == expected
        assert len(stored(broker, "t")) == 30


def test_produce_message_id_refusals(base: list[str], broker: redisq.Broker, capsys: Any) -> None:
    broker.create_topic("t")
    # message_id mode without ids from the input would give each line a fresh id every run.
    assert cli.main(["produce", "t", "--idempotence", "message_id", *base]) == 2
    assert "--idempotence message_id needs --message-id" in capsys.readouterr().err
    assert cli.main(["produce", "t", "--message-id", "key", *base]) == 2
    assert "--message-id key needs --key-separator" in capsys.readouterr().err
    assert (
        cli.main(["produce", "t", "--message-id", "hash", "--idempotence", "sequence", *base]) == 2
    )
    assert cli.main(["produce", "t", "--message-id", "field:", *base]) == 2
    assert stored(broker, "t") == []


def test_produce_field_ids_name_the_lines_without_one(
    base: list[str], broker: redisq.Broker, valkey_server: Any, namespace: str
) -> None:
    broker.create_topic("t")
    lines = ['{"id": 1}', "not json", '{"other": 2}', '{"id": "x"}', '{"id": true}']
    done = run(*base, "produce", "t", "--message-id", "field:id", stdin="\n".join(lines) + "\n")
    assert done.returncode == 1, done.stderr
    assert "line 2: not a JSON object" in done.stderr
    assert "line 3: no string or integer field 'id'" in done.stderr
    assert "line 5: no string" in done.stderr
    assert "2 written, 0 duplicates skipped, 3 failed" in done.stderr
    assert [m.value for m in stored(broker, "t")] == [b'{"id": 1}', b'{"id": "x"}']


# -- 2. noise ------------------------------------------------------------------------------------
def test_one_short_line_when_the_embedded_server_starts_none_after(_own_home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    first = run("topic", "create", "t", "--namespace", "frontdoor", env=env)
    assert first.returncode == 0, first.stderr
    notice = first.stderr.splitlines()
    assert len(notice) == 1 and len(notice[0]) <= 80 + len(str(_own_home)), first.stderr
    assert notice[0].startswith("redisq: started the embedded valkey-server on 127.0.0.1:")
    again = run("topic", "list", "--namespace", "frontdoor", env=env)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == "t\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_only() -> None:
    log = io.StringIO()
    meter = Progress("produce t", 1000, stream=log, force=True)
    for _ in range(1000):
        meter.update()
    meter._last = 0.0
    meter.close()
    assert "\r" not in log.getvalue() and len(log.getvalue().splitlines()) == 1
    assert log.getvalue().startswith("produce t [##############################] 1,000/1,000")
    quiet = io.StringIO()
    unforced = Progress("produce t", 10, stream=quiet)
    unforced.update(10)
    unforced.close()
    assert quiet.getvalue() == ""
    terminal = _Terminal()
    drawn = Progress("produce t", 10, stream=terminal)
    drawn.update(10)
    drawn.close()
    assert terminal.getvalue().startswith("\rproduce t [") and terminal.getvalue().endswith("\n")


def test_produce_with_progress_into_a_log_is_one_summary_line(
    base: list[str], broker: redisq.Broker, tmp_path: Path
) -> None:
    broker.create_topic("t")
    source = tmp_path / "lines"
    source.write_text("".join(f"{i}\n" for i in range(5000)))
    done = run(*base, "produce", "t", "--file", str(source), "--progress")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    assert done.stderr.splitlines()[0].startswith("produce t [") and "5,000/5,000" in done.stderr
    assert len(done.stderr.splitlines()) == 2  # the progress summary, what was written


# -- 3. slips ------------------------------------------------------------------------------------
def test_create_exist_ok_refuses_another_partition_count(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    assert cli.main(["topic", "create", "t", "--partitions", "2", *base]) == 0
    assert capsys.readouterr().out == "topic t: 2 partitions, entry_format=batch\n"
    assert cli.main(["topic", "create", "t", "--partitions", "2", "--exist-ok", *base]) == 0
    capsys.readouterr()
    assert cli.main(["topic", "create", "t", "--partitions", "5", "--exist-ok", *base]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "TopicExists: topic 't' exists with 2 partitions, not 5" in captured.err
    given = ["--partitions", "2", "--retention-ms", "60000", "--exist-ok"]
    assert cli.main(["topic", "create", "t", *given, *base]) == 1
    assert "retention_ms=0, not 60000" in capsys.readouterr().err
    assert broker.topic_config("t", refresh=True).partitions == 2


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_refused(
    base: list[str], broker: redisq.Broker, capsys: Any, name: str
) -> None:
    assert cli.main(["topic", "create", name, *base]) == 2
    assert capsys.readouterr().err.startswith(f"redisq: InvalidName: invalid topic name '{name}'")
    assert broker.list_topics() == []
    broker.create_topic("t")
    with pytest.raises(redisq.InvalidName):
        broker.consumer("t", name)
    with pytest.raises(redisq.InvalidName):
        redisq.model.keys.validate_name("producer", name)
    for fine in ("...", ".a", "a..b"):
        redisq.model.keys.validate_topic(fine)


def test_a_long_line_is_named_and_the_limit_can_be_raised(
    base: list[str], broker: redisq.Broker, tmp_path: Path
) -> None:
    broker.create_topic("t")
    source = tmp_path / "lines"
    big = "x" * (1536 * 1024)
    source.write_text(f"one\ntwo\n{big}\nfour\n")
    done = run(*base, "produce", "t", "--file", str(source))
    assert done.returncode == 1, done.stderr
    assert "line 3: MessageTooLarge" in done.stderr and "--max-message-bytes" in done.stderr
    assert "3 written, 0 duplicates skipped, 1 failed" in done.stderr
    assert [m.value for m in stored(broker, "t")] == [b"one", b"two", b"four"]
    raised = run(*base, "produce", "t", "--file", str(source), "--max-message-bytes", "2097152")
    assert raised.returncode == 0, raised.stderr
    assert "4 written" in raised.stderr
    assert [len(m.value) for m in stored(broker, "t")][3:] == [3, 3, len(big), 4]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_produce_saying_what_was_written(
    base: list[str], broker: redisq.Broker, signum: signal.Signals
) -> None:
    """stdin stays open (a quiet pipe): the signal has to end the wait for the next line."""
    broker.create_topic("t")
    process = subprocess.Popen(
        [*REDISQ, *base, "produce", "t"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None
    try:
        process.stdin.write("".join(f"m{i}\n" for i in range(40)))
        process.stdin.flush()
        # Sent once 40 lines are stored: linger and batching send them without a flush.
        wait_until(lambda: len(stored(broker, "t")) == 40, 60, "40 messages stored")
        process.send_signal(signum)
        _out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert f"stopped by {signum.name} after line 40" in err
    assert "40 written, 0 duplicates skipped, 0 failed" in err
    assert len(stored(broker, "t")) == 40


def test_topic_comes_before_group_everywhere(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("orders")
    with broker.producer() as producer:
        producer.send("orders", b"v")
    with broker.consumer("orders", "billing") as consumer:
        consumer.ack(consumer.poll(timeout=5))
    for args in (
        ["group", "reset-offsets", "orders", "billing", "--to-earliest", "--dry-run"],
        ["group", "describe", "orders", "billing"],
        ["lag", "orders", "billing"],
    ):
        assert cli.main([*args, *base]) == 0, args
    capsys.readouterr()
    for args in (
        ["group", "reset-offsets", "billing", "orders", "--to-earliest"],
        ["group", "describe", "billing", "orders"],
        ["group", "delete", "billing", "orders"],
        ["lag", "billing", "orders"],
        ["dlq", "list", "billing", "orders"],
        ["dlq", "release", "billing", "orders", "k"],
    ):
        assert cli.main([*args, *base]) == 2, args
        err = capsys.readouterr().err
        assert "the arguments are TOPIC GROUP: 'billing' names no topic and 'orders' does" in err
    assert broker.list_groups("orders") == [("orders", "billing")]  # nothing deleted
    assert cli.main(["group", "describe", "nope", "billing", *base]) == 3  # simply missing


def _silent_port() -> Iterator[int]:
    """A plain TCP port that accepts and reads but never answers (as a plain server reads a TLS
    hello, waiting for the end of a command line)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("target", ["plain-server", "silent-port"])
def test_rediss_to_a_plain_port_fails_fast(valkey_server: Any, capsys: Any, target: str) -> None:
    ports = _silent_port()
    port = valkey_server.port if target == "plain-server" else next(ports)
    try:
        url = f"rediss://:s3cret-pw@127.0.0.1:{port}/0"
        started = time.monotonic()
        assert cli.main(["topic", "list", "--url", url]) == 2
        assert time.monotonic() - started < 6
        err = capsys.readouterr().err
        assert "no TLS handshake" in err and "use redis://" in err
        assert "s3cret-pw" not in err and "rediss://:***@127.0.0.1" in err
    finally:
        ports.close()


def test_plural_forms(base: list[str], broker: redisq.Broker, capsys: Any) -> None:
    assert cli.main(["topic", "create", "t", *base]) == 0
    assert capsys.readouterr().out == "topic t: 1 partition, entry_format=batch\n"
    with broker.producer() as producer:
        producer.send("t", b"v")
    assert cli.main(["topic", "describe", "t", *base]) == 0
    assert "1 partition, " in capsys.readouterr().out
    with broker.consumer("t", "g") as consumer:
        consumer.ack(consumer.poll(timeout=5))
    assert cli.main(["group", "reset-offsets", "t", "g", "--to-earliest", *base]) == 0
    assert "on 1 partition\n" in capsys.readouterr().out
    assert cli.main(["consume", "t", "--max", "1", *base]) == 0
    assert "Processed a total of 1 message\n" in capsys.readouterr().err


def test_server_wipe_wipes_the_embedded_server_only(
    _own_home: Path, valkey_server: Any, namespace: str
) -> None:
    configured = {**os.environ, "REDIS_URL": valkey_server.url}
    embedded_env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    assert run("topic", "create", "kept", "--namespace", namespace, env=configured).returncode == 0
    assert (
        run("topic", "create", "mine", "--namespace", namespace, env=embedded_env).returncode == 0
    )
    state = embedded.server_status()
    assert state is not None
    client = redis.Redis.from_url(state.url)
    keys = client.dbsize()
    assert keys > 0

    refused = subprocess.run(  # no terminal to ask on: refused
        [*REDISQ, "server", "wipe"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=embedded_env,
        timeout=60,
    )
    assert refused.returncode == 2 and "without --yes" in refused.stderr
    assert client.dbsize() == keys
    with_url = run("--url", valkey_server.url, "server", "wipe", "--yes", env=embedded_env)
    assert with_url.returncode == 2 and "wipes only the embedded" in with_url.stderr

    wiped = run("server", "wipe", "--yes", env=configured)
    assert wiped.returncode == 0, wiped.stderr
    assert f"{keys} keys deleted" in wiped.stdout and "REDIS_URL was not touched" in wiped.stdout
    assert client.dbsize() == 0
    client.close()
    with redisq.connect(valkey_server.url, namespace=namespace) as broker:
        assert broker.list_topics() == ["kept"]
        broker.delete_topic("kept")

    # Not running: its data files go.
    assert run("topic", "create", "again", env=embedded_env).returncode == 0
    assert run("server", "stop").returncode == 0
    data = Path(state.data_dir)
    assert any(data.iterdir())
    files = run("server", "wipe", "--yes", env=embedded_env)
    assert files.returncode == 0 and "it was not running" in files.stdout, files.stderr
    assert not any(data.iterdir())
    listed = run("topic", "list", env=embedded_env)
    assert listed.returncode == 0 and listed.stdout == ""


def test_redisq_namespace_is_the_default_namespace(
    valkey_server: Any, namespace: str, broker: redisq.Broker
) -> None:
    env = {**os.environ, "REDIS_URL": valkey_server.url, "REDISQ_NAMESPACE": namespace}
    assert run("topic", "create", "from-env", env=env).returncode == 0
    assert broker.list_topics() == ["from-env"]
    other = f"{namespace}x"
    assert run("topic", "create", "given", "--namespace", other, env=env).returncode == 0
    with redisq.connect(valkey_server.url, namespace=other) as given:
        assert given.list_topics() == ["given"]
        given.delete_topic("given")
    bad = run("topic", "list", env={**env, "REDISQ_NAMESPACE": "no good"})
    assert bad.returncode == 2 and "InvalidName: invalid namespace 'no good'" in bad.stderr


_SPARK_NOISE = """
import logging, subprocess, sys, warnings
from redisq.cli.common import warn
from redisq.cli.spark_output import spark_log

logging.basicConfig(level=logging.WARNING, format="redisq: %(message)s")
with spark_log() as log:
    # What the JVM does: a process that inherits descriptor 2 and writes to it.
    subprocess.run(["sh", "-c", "echo 'Setting default log level to WARN.' >&2"], check=True)
    warnings.warn_explicit(
        "PySpark does not yet fully support pandas", FutureWarning, "utils.py", 1,
        module="pyspark.testing.utils",
    )
    warn("redisq: said by the command")
    logging.getLogger("redisq.x").warning("logged by the command")
    print(log.path.read_text().strip(), flush=True)
print("after", file=sys.stderr)
"""


def test_spark_output_stays_out_of_the_commands_stderr() -> None:
    """Fast: no JVM, a child process standing in for it."""
    done = subprocess.run(
        [sys.executable, "-c", _SPARK_NOISE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Setting default log level to WARN.\n"  # it went to the log
    assert done.stderr.splitlines() == [
        "redisq: said by the command",
        "redisq: logged by the command",
        "after",
    ]


@pytest.mark.spark
@pytest.mark.timeout(900)  # a Spark start takes minutes on a busy machine
def test_audit_prints_no_jvm_banner_and_no_pandas_warning(
    base: list[str], broker: redisq.Broker, tmp_path: Path
) -> None:
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for i in range(20):
            producer.send_async("t", b"v%d" % i, key=f"k{i % 3}")
    done = subprocess.run(
        [*REDISQ, *base, "audit", "order", "t", "--plot", str(tmp_path / "o.png")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "CLEAN" in done.stdout
    assert done.stderr == ""  # no log4j banner, no WARN lines, no FutureWarning


@pytest.mark.parametrize(("answer", "code"), [("n", 1), ("y", 0)])
def test_server_wipe_asks_at_a_terminal(_own_home: Path, answer: str, code: int) -> None:
    import pty

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    assert run("topic", "create", "t", env=env).returncode == 0
    state = embedded.server_status()
    assert state is not None
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [*REDISQ, "server", "wipe"],
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        os.write(leader, f"{answer}\n".encode())
        out, err = process.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert process.returncode == code, err
    assert "wipe the embedded valkey-server at" in err  # the question
    with redis.Redis.from_url(state.url) as client:
        assert (client.dbsize() == 0) == (answer == "y")
