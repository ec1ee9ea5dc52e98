"""The command line on a batch topic (DESIGN §14): `topic create --entry-format`, what `topic
describe`, `lag` and `group` say (the messages counted, beside the entries), and `consume` printing
every message of each batch at its own offset, browsing and as a group member.

In-process (cli.main) against the session's real server, as tests/cli/test_cli.py does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import redisq
from redisq import cli

BATCHES, SIZE = 3, 5


@pytest.fixture(autouse=True)
def _own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISQ_HOME", str(tmp_path / "redisq-home"))


@pytest.fixture
def base(valkey_server: Any, namespace: str) -> list[str]:
    return ["--url", valkey_server.url, "--namespace", namespace]


@pytest.fixture
def broker(valkey_server: Any, namespace: str) -> Iterator[redisq.Broker]:
    with redisq.connect(valkey_server.url, namespace=namespace) as broker:
        yield broker


def produce_batches(broker: redisq.Broker, topic: str, partition: int = 0) -> list[str]:
    """BATCHES producer batches of SIZE messages (a flush after each: one entry each); the
    offsets of the messages in order (their values are "b<j>-m<i>")."""
    offsets = []
    with broker.producer(linger_ms=1000) as producer:
        for j in range(BATCHES):
            futures = [
                producer.send_async(topic, f"b{j}-m{i}", key=f"k{i}", partition=partition)
                for i in range(SIZE)
            ]
            producer.flush()
            offsets += [f.result().offset for f in futures]
    assert broker.client.xlen(broker.keys.log(topic, partition)) == BATCHES
    return offsets


VALUES = [f"b{j}-m{i}" for j in range(BATCHES) for i in range(SIZE)]


def test_create_with_an_entry_format(base: list[str], broker: redisq.Broker, capsys: Any) -> None:
    assert cli.main(["topic", "create", "bt", "--entry-format", "batch", *base]) == 0
    assert capsys.readouterr().out == "topic bt: 1 partition, entry_format=batch\n"
    assert broker.topic_config("bt", refresh=True).entry_format == "batch"
    assert cli.main(["topic", "create", "plain", "--entry-format", "message", *base]) == 0
    assert capsys.readouterr().out == "topic plain: 1 partition, entry_format=message\n"
    assert broker.topic_config("plain", refresh=True).entry_format == "message"
    # Not told: batch entries (the default), and it says so.
    assert cli.main(["topic", "create", "told", "--partitions", "2", *base]) == 0
    assert capsys.readouterr().out == "topic told: 2 partitions, entry_format=batch\n"
    assert broker.topic_config("told", refresh=True).entry_format == "batch"
    # A bad value: a usage error naming the choices, and nothing is created.
    assert cli.main(["topic", "create", "odd", "--entry-format", "columns", *base]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for '--entry-format'" in err and "'message', 'batch'" in err
    assert "odd" not in broker.list_topics()
    # --exist-ok holds only for the same format.
    args = ["topic", "create", "bt", "--exist-ok", *base]
    assert cli.main([*args, "--entry-format", "batch"]) == 0
    assert cli.main([*args, "--entry-format", "message"]) == 1
    assert "exists with entry_format=batch, not message" in capsys.readouterr().err


def test_describe_names_the_format_and_counts_entries(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("bt", partitions=2, entry_format="batch")
    produce_batches(broker, "bt")
    broker.create_topic("plain", partitions=1, entry_format="message")
    assert cli.main(["topic", "describe", "bt", *base]) == 0
    out = capsys.readouterr().out
    head, table = out.splitlines()[0], out.splitlines()[1:]
    # the messages, as the partitions' counters tell (DESIGN §14.6), and the entries
    assert f"{BATCHES * SIZE} messages in {BATCHES} entries" in head, head
    assert table[0].split()[:4] == ["partition", "length", "(entries)", "messages"]
    assert table[2].split()[:3] == ["0", str(BATCHES), str(BATCHES * SIZE)]
    assert table[3].split()[:3] == ["1", "0", "0"]
    assert cli.main(["topic", "describe", "plain", *base]) == 0
    out = capsys.readouterr().out
    assert "entry_format=message" in out and "0 messages" in out
    assert "(entries)" not in out


def test_lag_and_groups_count_messages_on_a_batch_topic(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("bt", partitions=1, entry_format="batch")
    with broker.consumer("bt", "billing", start="earliest") as consumer:
        consumer.poll(timeout=0.2)  # the group exists, before anything is produced
    produce_batches(broker, "bt")
    assert cli.main(["lag", "bt", *base]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["group", "partition", "lag"]
    assert lines[2].split()[:3] == ["billing", "0", str(BATCHES * SIZE)]  # messages, not entries
    assert cli.main(["group", "describe", "bt", "billing", *base]) == 0
    out = capsys.readouterr().out
    assert f"lag {BATCHES * SIZE}," in out and "(entries)" not in out
    assert cli.main(["group", "list", "bt", *base]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[:2] == ["bt", "billing"] and row[4] == str(BATCHES * SIZE)


def test_consume_prints_every_message_of_each_batch(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("bt", partitions=1, entry_format="batch")
    offsets = produce_batches(broker, "bt")
    expected = [f"Offset:{o}\t{v}" for o, v in zip(offsets, VALUES, strict=True)]
    # Browsing, without a group.
    assert cli.main(["consume", "bt", "--partition", "0", "--print-offset", *base]) == 0
    assert capsys.readouterr().out.splitlines() == expected
    # From a message inside the second entry, and a count that ends inside the third.
    middle = offsets[SIZE + 2]
    args = ["consume", "bt", "--start", middle, "--max", "5", "--print-offset", *base]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines() == expected[SIZE + 2 : SIZE + 7]
    # As a member of a (temporary) group, both modes.
    for mode in ("orderly", "concurrent"):
        args = ["consume", "bt", "--mode", mode, "--max", str(BATCHES * SIZE), "--timeout", "20"]
        assert cli.main([*args, "--format", "json", *base]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(r["offset"], r["value"]) for r in records] == list(
            zip(offsets, VALUES, strict=True)
        )


def test_topic_trim_says_the_messages_and_the_entries_it_removed(
    base: list[str], broker: redisq.Broker, capsys: Any
) -> None:
    broker.create_topic("bt", retention_messages=SIZE, entry_format="batch")
    produce_batches(broker, "bt")  # approximate trimming as they are written leaves them all
    assert cli.main(["topic", "trim", "bt", *base]) == 0
    removed = (BATCHES - 1) * SIZE
    assert capsys.readouterr().out == (
        f"topic bt: {removed} messages in {BATCHES - 1} entries past retention removed\n"
    )
    assert [m.value for m in broker.read("bt", 0)] == [v.encode() for v in VALUES[-SIZE:]]
