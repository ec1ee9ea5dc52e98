"""The `redisq` command line, run in-process (cli.main) and as a console script: exit codes,
errors, formats, signals and pipes, group administration, plots, the server and the demo."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import click
import pytest
import redis

import redisq
from redisq import cli
from tests.servers import free_port

REDISQ = [sys.executable, "-m", "redisq.cli"]


@pytest.fixture(autouse=True)
def _own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never the user's data directory, whatever a command falls back to."""
    monkeypatch.setenv("REDISQ_HOME", str(tmp_path / "redisq-home"))


@pytest.fixture
def base(valkey_server: Any, namespace: str) -> list[str]:
    return ["--url", valkey_server.url, "--namespace", namespace]


@pytest.fixture
def broker(valkey_server: Any, namespace: str) -> Any:
    with redisq.connect(valkey_server.url, namespace=namespace) as broker:
        yield broker


def run(
    *args: str, stdin: str | None = None, timeout: float = 120, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REDISQ, *args], input=stdin, capture_output=True, text=True, timeout=timeout, **kwargs
    )


def fill(
    broker: redisq.Broker,
    topic: str,
    partitions: int,
    per_partition: int,
    entry_format: str | None = None,
) -> None:
    broker.create_topic(topic, partitions=partitions, entry_format=entry_format)
    with broker.producer() as producer:
        for i in range(partitions * per_partition):
            producer.send_async(topic, f"v{i}".encode(), partition=i % partitions)
        producer.flush()


def drain(broker: redisq.Broker, topic: str, group: str, count: int, **options: Any) -> list:  # type: ignore[type-arg]
    """Handle and ack `count` messages as a member of group, then leave."""
    got: list = []  # type: ignore[type-arg]
    with broker.consumer(topic, group, **options) as consumer:
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            batch = consumer.poll(timeout=0.5, max_messages=count - len(got))
            consumer.ack(batch)
            got += batch
    return got


def group_keys(broker: redisq.Broker, group: str) -> list[bytes]:
    return [
        k for k in broker.client.scan_iter(match=f"{broker.namespace}:*") if group.encode() in k
    ]


# -- topics, errors, exit codes ------------------------------------------------------------------
def test_topic_commands(base: list[str], broker: redisq.Broker, capsys: Any) -> None:
    assert cli.main(["topic", "create", "orders", "--partitions", "3", *base]) == 0
    assert cli.main(["topic", "list", *base]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "orders"
    assert cli.main(["topic", "describe", "orders", *base]) == 0
    out = capsys.readouterr().out
    assert "3 partitions" in out
    assert len([line for line in out.splitlines() if re.match(r"^[0-2]\s+0\b", line)]) == 3
    assert cli.main(["topic", "add-partitions", "orders", "--partitions", "4", *base]) == 0
    assert broker.topic_config("orders", refresh=True).partitions == 4
    assert cli.main(["topic", "delete", "orders", *base]) == 0
    assert broker.list_topics() == []


def test_global_options_go_before_or_after_the_command(base: list[str], capsys: Any) -> None:
    assert cli.main([*base, "topic", "create", "t"]) == 0
    assert cli.main(["topic", "list", *base]) == 0
    assert cli.main([*base, "topic", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["t", "t"]


@pytest.mark.parametrize(
    ("args", "code", "error"),
    [
        (["topic", "describe", "missing"], 3, "TopicNotFound: topic 'missing' does not exist"),
        (["group", "describe", "orders", "nope"], 3, "GroupNotFound: group 'nope' of topic"),
        (["group", "delete", "orders", "nope"], 3, "GroupNotFound"),
        (["group", "reset-offsets", "orders", "nope", "--to-earliest"], 3, "GroupNotFound"),
        (["lag", "missing"], 3, "TopicNotFound"),
        (["lag", "orders", "nope"], 3, "GroupNotFound"),
        (["dlq", "list", "orders", "nope"], 3, "GroupNotFound"),
        (["dlq", "release", "orders", "nope", "k"], 3, "GroupNotFound"),
        (["consume", "missing", "--max", "1"], 3, "TopicNotFound"),
        (["produce", "missing"], 3, "TopicNotFound"),
        (["topic", "create", "bad name"], 2, "InvalidName"),
        (["topic", "create", "orders"], 1, "TopicExists"),
    ],
)
def test_errors_are_one_line_with_a_documented_code(
    base: list[str], broker: redisq.Broker, capsys: Any, args: list[str], code: int, error: str
) -> None:
    broker.create_topic("orders", partitions=2)
    assert cli.main([*args, *base]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"redisq: {error}"), err
    assert broker.list_groups("orders") == []  # nothing was created on the way


def test_usage_errors_and_an_unreachable_server_exit_2(base: list[str], capsys: Any) -> None:
    assert cli.main(["topic", "create", *base]) == 2
    assert "Missing argument" in capsys.readouterr().err
    assert cli.main(["consume", "t", "--max", "0", *base]) == 2
    assert cli.main(["group", "reset-offsets", "t", "g", *base]) == 2
    assert "choose one of --to-earliest" in capsys.readouterr().err
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert cli.main(["topic", "list", "--url", url]) == 2
    assert capsys.readouterr().err.startswith(f"redisq: cannot reach {url}")


def _commands(command: click.Command, path: str = "redisq") -> list[tuple[str, click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            found += _commands(sub, f"{path} {name}")
    return found


def test_every_command_and_option_has_help_and_exit_codes_are_documented() -> None:
    for path, command in _commands(cli.cli):
        assert command.help, f"{path} has no help"
        for param in command.params:
            if isinstance(param, click.Option) and param.name not in ("help", "version"):
                assert param.help, f"{path} {param.opts[0]} has no help"
    text = cli.cli.get_help(click.Context(cli.cli, info_name="redisq"))
    for code in (0, 1, 2, 3, 130, 141):
        assert re.search(rf"^\s+{code}\s+\S", text, re.M), f"exit code {code} not in --help"


def test_version_and_shell_completion() -> None:
    version = run("--version")
    assert (
        version.stdout.strip() == f"redisq, version {importlib.metadata.version('redisq-broker')}"
    )
    env = {**os.environ, "_REDISQ_COMPLETE": "bash_complete", "COMP_WORDS": "redisq gr"}
    completed = run(env={**env, "COMP_CWORD": "1"})
    assert completed.stdout.split() == ["plain,group"], completed.stderr
    script = run("completion", "bash")
    assert script.returncode == 0 and "_REDISQ_COMPLETE=bash_complete" in script.stdout


# -- produce and consume -------------------------------------------------------------------------
def test_produce_from_file_then_consume(
    base: list[str], tmp_path: Path, broker: redisq.Broker, capsys: Any
) -> None:
    assert cli.main(["topic", "create", "orders", "--partitions", "2", *base]) == 0
    source = tmp_path / "lines.txt"
    source.write_text("".join(f"key-{i % 5}:value-{i}\n" for i in range(200)))
    code = cli.main(
        ["produce", "orders", "--file", str(source), "--key-separator", ":", "--progress", *base]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "200 written, 0 duplicates skipped, 0 failed" in err
    assert "[##############################] 200/200" in err  # the progress bar reached the end

    # Default: the real consumer in a temporary group, which is gone afterwards.
    args = ["consume", "orders", "--max", "200", "--print-key", "--print-partition", *base]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 200
    by_key: dict[str, list[int]] = {}
    for row in printed:
        partition, key, value = row.split("\t")
        assert partition == f"Partition:{redisq.partition_for_key(key.encode(), 2)}"
        by_key.setdefault(key, []).append(int(value.removeprefix("value-")))
    assert all(values == sorted(values) for values in by_key.values())
    assert sorted(v for values in by_key.values() for v in values) == list(range(200))
    assert broker.list_groups("orders") == [] and group_keys(broker, "console-") == []

    # Browsing one partition reads without a group.
    assert cli.main(["consume", "orders", "--partition", "0", "--print-partition", *base]) == 0
    browsed = capsys.readouterr().out.splitlines()
    assert browsed and all(row.startswith("Partition:0\t") for row in browsed)


def test_produce_headers_and_lines_without_a_key(
    base: list[str], broker: redisq.Broker, valkey_server: Any, namespace: str
) -> None:
    broker.create_topic("t")
    env = {**os.environ, "REDIS_URL": valkey_server.url}
    args = ["--namespace", namespace, "produce", "t", "--key-separator", ":"]
    result = run(
        *args, "--header", "source=cli", "--header", "x=a=b", stdin="k:1\nno key\nk:2\n", env=env
    )
    assert result.returncode == 1  # one line failed
    assert "line 2: no key separator ':'" in result.stderr
    assert "2 written, 0 duplicates skipped, 1 failed" in result.stderr
    messages = list(broker.read("t", 0))
    assert [(m.key, m.value) for m in messages] == [(b"k", b"1"), (b"k", b"2")]
    assert all(m.headers == {"source": b"cli", "x": b"a=b"} for m in messages)
    plain = run("--namespace", namespace, "produce", "t", stdin="one\ntwo\n", env=env)
    assert plain.returncode == 0, plain.stderr
    assert [m.key for m in broker.read("t", 0)][2:] == [None, None]


def unescape(text: str) -> bytes:
    """The inverse of redisq.cli.messages.escape."""
    out = bytearray()
    i = 0
    while i < len(text):
        if text[i] != "\\":
            out += text[i].encode()
            i += 1
            continue
        kind = text[i + 1]
        if kind in "\\ntr":
            out += {"\\": b"\\", "n": b"\n", "t": b"\t", "r": b"\r"}[kind]
            i += 2
        elif kind == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        else:
            out += chr(int(text[i + 2 : i + 6], 16)).encode()
            i += 6
    return bytes(out)


AWKWARD = [
    (b"k1", b"line one\nline two\r\n", {"h": b"a\tb"}),
    (None, b"back\\slash and tab\t", {}),
    (b"new\nline key", b"\xff\x00binary\x85", {"bin": b"\xfe"}),
    (b"k2", "caf\u00e9 \u2028 next \x85 nel".encode(), {}),
    (b"k3", b"", {}),
]


def test_consume_formats_keep_one_message_per_line(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("t")
    with broker.producer() as producer:
        for key, value, headers in AWKWARD:
            producer.send("t", value, key=key, headers=headers or None, partition=0)
    stored = list(broker.read("t", 0))
    flags = ["--print-key", "--print-headers", "--print-timestamp", "--print-offset"]
    assert cli.main(["consume", "t", "--max", "5", *flags, *base]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(AWKWARD)
    for line, message in zip(lines, stored, strict=True):
        timestamp, offset, headers, key, value = line.split("\t")
        assert (
            timestamp == f"Timestamp:{message.timestamp_ms}"
            and offset == f"Offset:{message.offset}"
        )
        assert unescape(value) == message.value
        assert key == "null" if message.key is None else unescape(key) == message.key
        if message.headers:
            assert {n: unescape(v) for n, v in (h.split("=", 1) for h in headers.split(","))} == (
                message.headers
            )
        else:
            assert headers == "NO_HEADERS"

    assert cli.main(["consume", "t", "--max", "5", "--format", "json", *base]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    def raw(value: Any) -> bytes | None:
        if value is None or isinstance(value, str):
            return None if value is None else value.encode()
        return base64.b64decode(value["base64"])

    assert [(raw(r["key"]), raw(r["value"]), r["offset"]) for r in records] == [
        (m.key, m.value, m.offset) for m in stored
    ]
    assert [{k: raw(v) for k, v in r["headers"].items()} for r in records] == [
        m.headers for m in stored
    ]

    assert cli.main(["consume", "t", "--max", "5", "--format", "hex", "--print-key", *base]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [bytes.fromhex(value) for _key, value in rows] == [m.value for m in stored]


def test_consume_max_is_a_total_of_any_size(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    """More than the 100,000 one poll() may return, in one command."""
    fill(broker, "big", 2, 50_100)
    assert cli.main(["consume", "big", "--max", "100001", *base]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 100_001
    assert broker.list_groups("big") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_console_consumer_leaves_nothing_behind(
    broker: redisq.Broker, valkey_server: Any, namespace: str, signum: int
) -> None:
    fill(broker, "t", 2, 50)
    process = subprocess.Popen(
        [*REDISQ, "--url", valkey_server.url, "--namespace", namespace, "consume", "t"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline()  # it consumes: its temporary group exists
        assert [g for _t, g in broker.list_groups("t")][0].startswith("console-")
        process.send_signal(signum)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, err
    assert "Processed a total of 100 messages" in err and "Traceback" not in err
    assert broker.list_groups("t") == [] and group_keys(broker, "console-") == []
    for p in range(2):
        assert broker.client.xinfo_groups(broker.keys.log("t", p)) == []


@pytest.mark.parametrize("per_partition", [4000, 3], ids=["writing", "idle"])
def test_a_closed_pipe_ends_quietly(
    broker: redisq.Broker, valkey_server: Any, namespace: str, tmp_path: Path, per_partition: int
) -> None:
    """consume | head: the consumer stops at its next write, or while it waits for messages
    with nothing more to write; no traceback, and its temporary group is gone."""
    broker.create_topic("t", partitions=2)
    with broker.producer() as producer:
        for i in range(2 * per_partition):  # 4000: more than a pipe buffer holds
            producer.send_async("t", f"{i:08d}".encode() * 8, partition=i % 2)
        producer.flush()
    redisq_cmd = " ".join([*REDISQ, "--url", valkey_server.url, "--namespace", namespace])
    script = (
        f"{redisq_cmd} consume t 2>{tmp_path}/err | head -n 1 >{tmp_path}/out; "
        f"echo ${{PIPESTATUS[0]}} >{tmp_path}/status"
    )
    subprocess.run(["bash", "-c", script], timeout=60, check=True)
    assert (tmp_path / "status").read_text().strip() == "141"
    assert len((tmp_path / "out").read_text().splitlines()) == 1
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err
    assert broker.list_groups("t") == []


def test_closed_stdout_is_no_error(base: list[str], broker: redisq.Broker, tmp_path: Path) -> None:
    fill(broker, "t", 1, 5)
    for command in ("topic list", "consume t --max 3"):
        closed = subprocess.run(
            ["bash", "-c", f"{' '.join([*REDISQ, *base])} {command} >&-; echo $? >{tmp_path}/c"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (tmp_path / "c").read_text().strip() == "0", closed.stderr
        assert "Traceback" not in closed.stderr


# -- groups --------------------------------------------------------------------------------------
def test_group_describe_shows_held_and_malformed(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("t")
    with broker.producer() as producer:
        for value in (b"fail", b"held-1", b"held-2"):
            producer.send("t", value, key="k", partition=0)
        producer.send("t", b"fine", key="other", partition=0)
    broker.client.xadd(broker.keys.log("t", 0), {"not": "a redisq message"})

    def handle(message: redisq.Message) -> None:
        if message.value == b"fail":
            raise RuntimeError("poison")

    with broker.consumer("t", "g", failure_policy="park_key", max_attempts=1) as consumer:
        consumer.run(handle, idle_timeout=1.5)
    assert cli.main(["group", "describe", "t", "g", *base]) == 0
    out = capsys.readouterr().out
    assert "2 held, 1 malformed" in out
    header = next(line for line in out.splitlines() if line.startswith("partition"))
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    columns = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row), strict=False))
    assert columns["held"] == "2" and columns["malformed"] == "1" and columns["parked keys"] == "1"


def lags(broker: redisq.Broker, topic: str, group: str) -> list[int | None]:
    return [p.lag for p in broker.describe_group(topic, group).partitions]


def test_reset_offsets_moves_positions_and_refuses_live_groups(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    # message entries: single-message shifts (tests/batches/test_reading.py: batch entries,
    # where a position moves by whole batches)
    fill(broker, "t", 2, 10, entry_format="message")
    assert len(drain(broker, "t", "g", 20)) == 20
    assert lags(broker, "t", "g") == [0, 0]
    before = [p.last_delivered for p in broker.describe_group("t", "g").partitions]

    reset = ["group", "reset-offsets", "t", "g"]
    assert cli.main([*reset, "--to-earliest", "--dry-run", *base]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing changed" in out and re.search(
        r"^0\s+\S+\s+0-0\s+0\s+10\s+0$", out, re.M
    )
    assert lags(broker, "t", "g") == [0, 0]

    assert cli.main([*reset, "--to-earliest", *base]) == 0
    assert lags(broker, "t", "g") == [10, 10]
    assert sorted(m.value for m in drain(broker, "t", "g", 20)) == sorted(
        f"v{i}".encode() for i in range(20)
    )
    assert cli.main([*reset, "--shift-by", "-3", "--partition", "0", *base]) == 0
    assert lags(broker, "t", "g") == [3, 0]
    assert [m.value for m in drain(broker, "t", "g", 3)] == [b"v14", b"v16", b"v18"]

    entries = list(broker.read("t", 1))
    assert cli.main([*reset, "--to-offset", entries[6].offset, "--partition", "1", *base]) == 0
    assert lags(broker, "t", "g") == [0, 4]
    moment = entries[4].timestamp_ms + (
        1 if entries[4].timestamp_ms < entries[5].timestamp_ms else 0
    )
    first_at = next(m for m in entries if m.timestamp_ms >= moment)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(moment // 1000))
    iso += f".{moment % 1000:03d}"  # local time, as Kafka reads a zone-less date-time
    assert cli.main([*reset, "--to-datetime", iso, "--partition", "1", *base]) == 0
    assert lags(broker, "t", "g")[1] == 10 - entries.index(first_at)
    assert cli.main([*reset, "--to-latest", *base]) == 0
    assert lags(broker, "t", "g") == [0, 0]
    assert [p.last_delivered for p in broker.describe_group("t", "g").partitions] == before
    capsys.readouterr()

    with broker.consumer("t", "g") as member:  # a live member: refused, nothing moves
        deadline = time.monotonic() + 10
        while not member.assignment and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cli.main([*reset, "--to-earliest", *base]) == 1
        assert "GroupInUse" in capsys.readouterr().err
        assert lags(broker, "t", "g") == [0, 0]

    assert cli.main(["group", "reset-offsets", "g", "t", "--to-earliest", *base]) == 2
    assert "the arguments are TOPIC GROUP" in capsys.readouterr().err


def test_reset_offsets_drops_a_concurrent_groups_pending_entries(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    fill(broker, "t", 1, 10, entry_format="message")  # XPENDING counts entries: one per message
    with broker.consumer("t", "c", mode="concurrent", enable_auto_commit=False) as consumer:
        deadline = time.monotonic() + 10
        got: list = []  # type: ignore[type-arg]
        while len(got) < 10 and time.monotonic() < deadline:
            got += consumer.poll(timeout=0.5, max_messages=10)
        consumer.ack(got[:4])  # six stay pending
    key = broker.keys.log("t", 0)
    assert broker.client.xpending(key, "c")["pending"] == 6
    assert cli.main(["group", "reset-offsets", "t", "c", "--shift-by", "-2", *base]) == 0
    assert re.search(r"^0\s+\S+\s+\S+\s+0\s+2\s+6$", capsys.readouterr().out, re.M)
    assert broker.client.xpending(key, "c")["pending"] == 0
    again = drain(broker, "t", "c", 2, mode="concurrent")
    assert [m.value for m in again] == [b"v8", b"v9"]


def test_group_delete_leaves_nothing_and_refuses_live_members(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    fill(broker, "t", 2, 3)

    def fail(message: redisq.Message) -> None:
        raise RuntimeError("to the dead letters")

    with broker.consumer("t", "g", max_attempts=1) as consumer:
        consumer.run(fail, idle_timeout=1.5)
    assert "t~dlq~g" in broker.list_topics()
    with broker.consumer("t", "g"):
        assert cli.main(["group", "delete", "t", "g", *base]) == 1
        assert "live members" in capsys.readouterr().err
        assert cli.main(["group", "delete", "t", "g", "--force", *base]) == 0
    assert broker.list_groups("t") == [] and "t~dlq~g" not in broker.list_topics()
    assert group_keys(broker, ":g") == [] and group_keys(broker, "dlq~g") == []

    with broker.consumer("t", "kept", max_attempts=1) as consumer:
        consumer.run(fail, idle_timeout=1.5)
    assert cli.main(["group", "delete", "t", "kept", "--keep-dead-letters", *base]) == 0
    assert cli.main(["dlq", "list", "t", "kept", *base]) == 0  # its letters outlive it
    assert capsys.readouterr().out.count("RuntimeError") == 6


def test_dlq_replay_says_where_letters_went(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    fill(broker, "t", 1, 3)
    broker.create_topic("elsewhere")

    def fail(message: redisq.Message) -> None:
        raise RuntimeError("no")

    with broker.consumer("t", "g", max_attempts=1) as consumer:
        consumer.run(fail, idle_timeout=1.5)
    offsets = [d.split()[0] for d in capsys.readouterr().out.splitlines()]
    assert cli.main(["dlq", "list", "t", "g", *base]) == 0
    offsets = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert cli.main(["dlq", "replay", "t", "g", "--offset", offsets[0], *base]) == 0
    assert capsys.readouterr().out.strip() == "replayed 1 dead letter: 1 to t"
    assert cli.main(["dlq", "replay", "t", "g", "--all", "--to", "elsewhere", *base]) == 0
    assert capsys.readouterr().out.strip() == "replayed 2 dead letters: 2 to elsewhere"
    assert broker.describe_topic("elsewhere").total_messages == 2
    assert broker.describe_topic("t").total_messages == 4


# -- plots ---------------------------------------------------------------------------------------
def ticks(ax: Any) -> list[float]:
    return [float(t) for t in ax.get_xticks()]


def texts(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_lag_plot_says_its_verdict(
    base: list[str], broker: redisq.Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from redisq.cli import lag

    figures: list[Any] = []
    real_save = lag.save
    monkeypatch.setattr(lag, "save", lambda fig, path: (figures.append(fig), real_save(fig, path)))
    fill(broker, "t", 3, 4)
    drain(broker, "t", "g", 4, lease_ttl_ms=1000)  # some partitions read, others not
    plot = tmp_path / "lag.png"
    assert cli.main(["lag", "t", "--plot", str(plot), *base]) == 0
    assert plot.stat().st_size > 1000
    ax = figures[-1].axes[0]
    behind = sum(lag for lag in lags(broker, "t", "g") if lag)
    assert ax.get_title() == f"consumer lag on t: {behind} messages behind in 2 of 3 partitions"
    assert ticks(ax) == [0.0, 1.0, 2.0] and ax.get_xlabel() == "partition"
    assert "messages" in ax.get_ylabel() and texts(ax) == []

    drain(broker, "t", "g", 8)
    assert (
        cli.main(["lag", "t", "g", "--plot", str(plot), "--samples", "2", "--interval", "0", *base])
        == 0
    )
    ax = figures[-1].axes[0]
    assert ax.get_title() == "consumer lag on t: no lag" and ax.get_ylim() == (0.0, 1.0)
    assert texts(ax) == ["no lag: every group has handled every message"]
    assert "(s)" in ax.get_xlabel()

    broker.create_topic("quiet")
    assert cli.main(["lag", "quiet", "--plot", str(plot), *base]) == 0
    assert texts(figures[-1].axes[0]) == ["no data: quiet has no consumer groups"]

    missing = tmp_path / "missing.png"
    assert cli.main(["lag", "nope", "--plot", str(missing), *base]) == 3
    assert not missing.exists()


def test_spark_job_charts_say_their_verdict() -> None:
    """The audit charts from collected rows (no Spark needed for the figures)."""
    pytest.importorskip("matplotlib")
    from spark_connector import plots

    audit = namedtuple("audit", "partition producer_id messages gaps duplicates out_of_order")
    clean = [audit(0, 7, 100, 0, 0, 0), audit(1, 7, 100, 0, 0, 0), audit(2, 7, 50, 0, 0, 0)]
    ax = plots.audit_figure(clean, "ordering audit of t").axes[0]
    assert ax.get_title() == "ordering audit of t: CLEAN"
    assert ticks(ax) == [0.0, 1.0, 2.0] and ax.get_ylim() == (0.0, 1.0)
    assert texts(ax) == ["CLEAN: 250 messages, no gaps, duplicates or out-of-order ones"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("partition", "messages")
    faulty = [audit(0, 7, 100, 2, 0, 0), audit(1, 7, 100, 1, 1, 0), audit(2, 7, 50, 0, 0, 0)]
    ax = plots.audit_figure(faulty, "ordering audit of t").axes[0]
    assert (
        ax.get_title() == "ordering audit of t: 3 gaps in 2 partitions, 1 duplicate in 1 partition"
    )
    assert all(float(t).is_integer() for t in ax.get_yticks())
    assert texts(plots.audit_figure([], "a").axes[0]) == [
        "no data: no messages carry a producer sequence"
    ]

    lag = namedtuple("lag", "partition group lag")
    ax = plots.lag_figure([lag(0, "g", 0), lag(1, "g", 0)], "lag of t").axes[0]
    assert ax.get_title() == "lag of t: no lag" and ticks(ax) == [0.0, 1.0]
    assert texts(ax) and ax.get_ylim() == (0.0, 1.0)
    ax = plots.lag_figure(
        [lag(0, "g", 5), lag(1, "g", 0), lag(0, "h", 2), lag(1, "h", 0)], "l"
    ).axes[0]
    assert ax.get_title() == "l: 7 messages behind in 1 of 2 partitions"
    assert plots.lag_figure([], "l").axes[0].get_title() == "l: no consumer groups"

    skew = namedtuple("skew", "partition messages")
    ax = plots.skew_figure([skew(0, 30), skew(1, 10)], "skew").axes[0]
    assert ax.get_title() == "skew: largest partition 1.50x the mean" and ticks(ax) == [0.0, 1.0]
    assert texts(plots.skew_figure([], "skew").axes[0]) == ["no data: the topic holds no messages"]
    empty = plots.throughput_figure([], "throughput").axes[0]
    assert empty.get_title() == "throughput: no data" and empty.get_ylabel() == "messages/s"


def test_audit_checks_topic_and_server_before_spark(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("t")
    started = time.monotonic()
    assert cli.main(["audit", "order", "nope", *base]) == 3
    assert cli.main(["audit", "lag", "t", "--group", "nope", *base]) == 3
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert cli.main(["audit", "skew", "t", "--url", url]) == 2
    assert time.monotonic() - started < 10  # no Spark was started
    err = capsys.readouterr().err
    assert "TopicNotFound" in err and "GroupNotFound" in err and "cannot reach" in err
    assert "Traceback" not in err


# -- server and demo -----------------------------------------------------------------------------
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
        [*REDISQ, "server", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
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
            with redis.Redis(port=port, socket_connect_timeout=0.5) as client:
                assert "valkey_version" in client.info("server")
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


def test_foreground_server_dies_with_a_killed_command() -> None:
    process = subprocess.Popen(
        [*REDISQ, "server", "--port", str(free_port())], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None and process.stdout.readline()
        [child] = _valkey_children(process.pid)
        process.kill()
        process.wait(10)
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.timeout(660)
def test_demo_passes_and_leaves_nothing(valkey_server: Any) -> None:
    """The main job: the demo's own checks must all come out clean on a real server, and the
    server holds nothing of it afterwards."""
    # the demo runs every step, Spark's audit too: minutes on a loaded 2-core machine
    result = run(
        "--url", valkey_server.url, "demo", "--messages", "5000", "--keys", "50", timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "per-key order intact, zero duplicates, nothing lost" in result.stdout
    assert "4 partitions, 3 members (member-0 killed)" in result.stdout
    assert "lease ttl (2 s)" in result.stdout and "verdict: OK" in result.stdout
    namespace = re.search(r"namespace (demo-\w+)", result.stdout)
    assert namespace is not None
    with redis.Redis.from_url(valkey_server.url) as client:
        assert list(client.scan_iter(match=f"{namespace.group(1)}:*")) == []


def test_topic_trim_applies_retention_to_idle_partitions(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    # message entries (tests/cli/test_batch_entries.py: batch entries)
    broker.create_topic("t", partitions=2, retention_messages=10, entry_format="message")
    with broker.producer() as producer:
        for i in range(300):  # 150 per partition; approximate trimming leaves whole nodes
            producer.send_async("t", b"x", partition=i % 2)
        producer.flush()
    before = broker.describe_topic("t").total_messages
    assert before > 20
    assert cli.main(["topic", "trim", "t", *base]) == 0
    assert f"{before - 20:,} entries past retention removed" in capsys.readouterr().out
    assert [p.length for p in broker.describe_topic("t").partitions] == [10, 10]
