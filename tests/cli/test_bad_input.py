"""Adversarial tests of the command line: inputs at the edges of what a command takes must be a
one-line error with the documented exit code (2: bad arguments or could not run; never a
traceback, never 3 "not found" for something else), and a command that did nothing must not
exit 0 saying it did.

Each test runs `python -m redisq.cli` in a subprocess against the machine's Redis (REDIS_URL,
else a redis-server) in a namespace of its own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import redisq
from tests.conftest import broker_in
from tests.console.test_http_edges import dead_lettered

REDISQ = [sys.executable, "-m", "redisq.cli"]


@pytest.fixture(autouse=True)
def _own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISQ_HOME", str(tmp_path / "redisq-home"))


@pytest.fixture
def broker(redis_url: str, namespace: str) -> Iterator[redisq.Broker]:
    with broker_in(redis_url, f"advcli{namespace}") as broker:
        yield broker


@pytest.fixture
def base(redis_url: str, broker: redisq.Broker) -> list[str]:
    return ["--url", redis_url, "--namespace", broker.namespace]


def run(
    *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REDISQ, *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def consumed(broker: redisq.Broker, topic: str, group: str, messages: int) -> None:
    broker.create_topic(topic, partitions=1)
    with broker.producer() as producer:
        for i in range(messages):
            producer.send(topic, f"v{i}".encode(), key=f"k{i}")
    with broker.consumer(topic, group=group) as consumer:
        consumer.run(lambda m: None, idle_timeout=0.5)


def position(broker: redisq.Broker, topic: str, group: str) -> str:
    [info] = [
        g
        for g in broker.client.xinfo_groups(broker.keys.log(topic, 0))
        if g["name"] == group.encode()
    ]
    last = info["last-delivered-id"]
    return last.decode() if isinstance(last, bytes) else str(last)


def test_reset_to_a_datetime_before_1970_is_a_usage_error(
    broker: redisq.Broker, base: list[str]
) -> None:
    """`--to-datetime 1969-01-01` was a Python traceback and exit 1."""
    consumed(broker, "orders", "billing", 3)
    before = position(broker, "orders", "billing")
    done = run(*base, "group", "reset-offsets", "orders", "billing", "--to-datetime", "1969-01-01")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "1970" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert position(broker, "orders", "billing") == before


@pytest.mark.parametrize("shift", ["99999999999999999999999", "-99999999999999999999999"])
def test_reset_shift_beyond_the_partition_is_clamped(
    broker: redisq.Broker, base: list[str], shift: str
) -> None:
    """reset_offsets documents "Targets are clamped to the partition"; a shift past the int64
    range went to the server as an XRANGE COUNT and came back as "the server refused:
    ResponseError: value is not an integer or out of range" (exit 2, as an ACL refusal)."""
    consumed(broker, "orders", "billing", 3)
    entries = broker.client.xrange(broker.keys.log("orders", 0))
    last = entries[-1][0].decode()
    done = run(*base, "group", "reset-offsets", "orders", "billing", "--shift-by", shift)
    assert done.returncode == 0, done.stderr
    expected = last if not shift.startswith("-") else "0-0"
    assert position(broker, "orders", "billing") == expected


def test_dlq_replay_of_an_offset_that_is_no_dead_letter_is_not_success(
    broker: redisq.Broker, base: list[str]
) -> None:
    """`dlq replay --offset X` where X is no dead letter said "replayed 0 dead letters" and
    exited 0."""
    dead_lettered(broker, "dead_letter")
    done = run(*base, "dlq", "replay", "orders", "billing", "--offset", "1-1")
    assert done.returncode != 0, done.stdout
    assert "1-1" in done.stderr and "Traceback" not in done.stderr
    assert broker.client.xlen(broker.keys.log("orders~dlq~billing", 0)) == 1
    assert broker.client.xlen(broker.keys.log("orders", 0)) == 1


@pytest.mark.parametrize("value", ["nocolon", "user:", ":pw"])
def test_console_with_malformed_basic_auth_is_a_usage_error(base: list[str], value: str) -> None:
    """`redisq console --basic-auth nocolon` was a ValueError traceback and exit 1."""
    done = run(*base, "console", "--basic-auth", value, "--port", "0", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "USER:PASSWORD" in done.stderr


@pytest.mark.parametrize("option", ["--token", "--basic-auth"])
def test_console_with_an_empty_secret_is_a_usage_error(base: list[str], option: str) -> None:
    """`redisq console --token ""` served without any authentication (the empty value was
    dropped as if none was given)."""
    done = run(*base, "console", option, "", "--port", "0", timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "empty" in done.stderr


def test_console_on_a_port_in_use_exits_2_not_3(base: list[str]) -> None:
    """uvicorn exits 3 when it cannot bind; the CLI passed that on, and 3 is documented as
    "not found: the topic or group does not exist". It could not run: 2."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = run(*base, "console", "--port", str(port), timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and str(port) in done.stderr
