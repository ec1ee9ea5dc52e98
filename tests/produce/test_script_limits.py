"""Managed servers cap a command's arguments (ElastiCache Serverless refuses 4,000 or more): the
largest batches the producers may make (max_batch_messages=10,000, messages with a key, headers
and a message id; delayed messages; a transaction) go as script calls of fewer than 3,999
arguments each, as the server's own SLOWLOG counts them, and every message is stored once. Both
APIs, on a server of each kind started for the test (its SLOWLOG set to log every command)."""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import redisq
from tests.apis import open_api, read_all
from tests.servers import ServerProcess, binary_for

LIMIT = 3_999
COUNT = 6_000
# linger long: the batches are sealed by the argument limit or by flush(), whatever the pace
BIG = {"max_batch_messages": 10_000, "max_batch_bytes": 64 << 20, "linger_ms": 60_000}
SCRIPT_COMMANDS = {b"evalsha", b"eval", b"evalsha_ro", b"eval_ro", b"fcall"}


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    server = ServerProcess(binary_for(request.param)).start()
    yield server
    server.kill(signal.SIGCONT)
    server.stop()


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[Any]:
    namespace = f"lim{uuid.uuid4().hex[:8]}"
    driver = open_api(str(request.param), server.url, namespace)
    try:
        yield driver
    finally:
        driver.shutdown()


def logging_every_command(server: ServerProcess) -> redis.Redis:
    client = redis.Redis.from_url(server.url)
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 1_000_000)
    client.slowlog_reset()
    return client


def script_call_sizes(client: redis.Redis) -> list[int]:
    """The argument count of every script call the server ran (SLOWLOG shows 32 arguments of
    a longer command and then "... (N more arguments)")."""
    sizes = []
    for entry in client.execute_command("SLOWLOG", "GET", -1):
        args = entry[3]
        if args[0].lower() not in SCRIPT_COMMANDS:
            continue
        more = re.fullmatch(rb"\.\.\. \((\d+) more arguments\)", args[-1])
        sizes.append(len(args) - 1 + int(more.group(1)) if more else len(args))
    return sizes


def values(messages: list[redisq.Message]) -> list[bytes]:
    return [m.value for m in messages]


@pytest.mark.parametrize("entry_format", ["message", "batch"])
@pytest.mark.parametrize("mode", ["sequence", "message_id"])
def test_the_largest_batches_go_in_calls_under_the_limit(
    api: Any, server: ServerProcess, mode: str, entry_format: str
) -> None:
    api.broker.create_topic("orders", partitions=1, entry_format=entry_format)
    client = logging_every_command(server)
    sent = [b"v%d" % i for i in range(COUNT)]
    with api.broker.producer(idempotence=mode, **BIG) as producer:
        for i, value in enumerate(sent):
            extra = {"message_id": f"id-{i}"} if mode == "message_id" else {}
            producer.send_async("orders", value, key="k", headers={"h": "x"}, **extra)
        producer.flush()
    sizes = script_call_sizes(client)
    assert max(sizes) < LIMIT
    if entry_format == "message":  # a batch entry's messages go as one argument (its blob)
        assert max(sizes) > 3_000  # the batches were as large as the limit lets them be
    assert values(read_all(api.broker, "orders")) == sent  # each once, in order


def test_delayed_messages_and_transactions_stay_under_the_limit(
    api: Any, server: ServerProcess
) -> None:
    api.broker.create_topic("orders", partitions=1)
    client = logging_every_command(server)
    with api.broker.producer(**BIG) as producer:
        for i in range(COUNT):
            producer.send_async("orders", b"d%d" % i, key="k", delay_ms=3_600_000)
        producer.flush()
    with api.broker.producer(name="tx-big", transactional=True, **BIG) as producer:
        tx = producer.transaction()
        for i in range(COUNT):
            tx.send("orders", b"t%d" % i, key="k", headers={"h": "x"})
        tx.commit()
    sizes = script_call_sizes(client)
    assert max(sizes) < LIMIT
    assert max(sizes) > 3_000
    assert api.broker.describe_topic("orders").total_scheduled == COUNT
    assert values(read_all(api.broker, "orders")) == [b"t%d" % i for i in range(COUNT)]
