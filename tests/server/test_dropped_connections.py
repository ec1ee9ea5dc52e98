"""A connection the server dropped (a restart, a proxy's idle timeout, CLIENT KILL) is recovered
from in both APIs, for every call outside a producer's own rounds: identities, topic metadata,
admin (topics and groups), group joins; nothing from redis.exceptions reaches the caller. Every
connection of the API under test (named, so that other tests sharing the server keep theirs) is
killed between two operations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

import redisq
from tests.apis import open_api


def drop_connections(broker: redisq.Broker, name: str) -> int:
    """CLIENT KILL ID of every connection named `name`, on every primary; how many."""
    if broker.is_cluster:
        nodes = [node for node in broker.client.get_nodes() if node.server_type == "primary"]
        urls = [f"redis://{node.host}:{node.port}" for node in nodes]
    else:
        kwargs = broker.client.connection_pool.connection_kwargs
        urls = [f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"]
    killed = 0
    for url in urls:
        killer = redis.Redis.from_url(url)
        try:
            for client in killer.client_list():
                if client.get("name") == name:
                    killed += int(killer.client_kill_filter(_id=client["id"]))
        finally:
            killer.close()
    return killed


@pytest.fixture(params=["sync", "async"])
def named_api(
    request: pytest.FixtureRequest, broker: redisq.Broker, server_url: str
) -> Iterator[tuple[Any, str]]:
    name = f"dropped-{broker.namespace}"
    driver = open_api(str(request.param), server_url, broker.namespace, client_name=name)
    try:
        yield driver, name
    finally:
        driver.shutdown()


def test_every_operation_recovers_after_the_server_dropped_its_connections(
    named_api: tuple[Any, str], broker: redisq.Broker
) -> None:
    api, name = named_api
    steps: list[tuple[str, Any]] = []
    kills: list[int] = []
    b = api.broker

    def step(label: str, call: Any) -> Any:
        kills.append(drop_connections(broker, name))
        result = call()
        steps.append((label, result))
        return result

    step("create_topic", lambda: b.create_topic("orders", 2))
    step("create_topic exist_ok", lambda: b.create_topic("orders", 2, exist_ok=True))
    assert step("list_topics", b.list_topics) == ["orders"]
    assert step("describe_topic", lambda: b.describe_topic("orders")).config.partitions == 2
    producer = step("named producer", lambda: b.producer(name="svc"))
    first = step("send", lambda: producer.send("orders", b"one", key="k"))
    assert first.offset is not None and not first.duplicate
    step("close producer", producer.close)
    producer = step("the name again", lambda: b.producer(name="svc"))
    step("send again", lambda: producer.send("orders", b"two", key="k"))
    step("close", producer.close)
    anonymous = step("anonymous producer", lambda: b.producer(idempotence="message_id"))
    step("send with an id", lambda: anonymous.send("orders", b"three", key="k", message_id="m1"))
    again = step("the id again", lambda: anonymous.send("orders", b"3", key="k", message_id="m1"))
    assert again.duplicate
    step("close anonymous", anonymous.close)
    read = step("read", lambda: list(b.read("orders", first.partition)))
    assert [m.value for m in read] == [b"one", b"two", b"three"]
    with broker.consumer("orders", "g") as member:  # a group, read by the test's own broker
        handled = member.poll(timeout=10, max_messages=10)
        assert len(handled) == 3
        member.ack(handled)
        member.commit()
    assert step("list_groups", lambda: b.list_groups("orders")) == [("orders", "g")]
    assert step("describe_group", lambda: b.describe_group("orders", "g")).total_lag == 0
    done = step("reset_offsets", lambda: b.reset_offsets("orders", "g", to_earliest=True))
    assert sum(r.lag_after or 0 for r in done) == 3
    step("delete_group", lambda: b.delete_group("orders", "g"))
    step("add_partitions", lambda: b.add_partitions("orders", 3))
    step("trim", lambda: b.trim("orders"))
    step("delete_topic", lambda: b.delete_topic("orders"))
    assert step("list_topics after", b.list_topics) == []
    assert sum(kills) >= len(kills)  # connections were there to drop, and were dropped
