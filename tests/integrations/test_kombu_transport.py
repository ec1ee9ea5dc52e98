"""The Kombu transport's own mapping, beyond Kombu's suite: what the ordering key holds back,
where a rejection goes, the task-id and eta headers, names that are not topic names."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta

import kombu
import pytest

import redisq
from redisq.integrations.kombu import Transport
from redisq.integrations.kombu.mapping import due_time, outgoing, task_message_id
from redisq.integrations.kombu.names import BINDINGS_TOPIC, topic_for

TRANSPORT = "redisq.integrations.kombu:Transport"


@pytest.fixture
def connection(redis_url: str, integration_namespace: str) -> Iterator[kombu.Connection]:
    with kombu.Connection(
        redis_url, transport=TRANSPORT, transport_options={"namespace": integration_namespace}
    ) as conn:
        yield conn


@pytest.fixture
def broker(redis_url: str, integration_namespace: str) -> Iterator[redisq.Broker]:
    broker = redisq.connect(redis_url, namespace=integration_namespace)
    yield broker
    broker.close()


def drain_until(conn: kombu.Connection, received: list[object], count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(received) < count and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def test_a_keys_next_message_waits_for_the_ack_other_keys_do_not(
    connection: kombu.Connection,
) -> None:
    queue = kombu.Queue("held")
    producer = kombu.Producer(connection)
    for n in range(3):
        producer.publish({"n": n}, routing_key="held", declare=[queue],
                         headers={"ordering_key": "same"})  # fmt: skip
    for n in range(3, 9):  # each without a key: spread over the partitions
        producer.publish({"n": n}, routing_key="held", declare=[queue])
    received: list[kombu.Message] = []
    with kombu.Consumer(connection, [queue], callbacks=[lambda b, m: received.append(m)]):
        drain_until(connection, received, 7, timeout=10)
        # Nothing acked: of the keyed three only the first came; the keyless six all did.
        assert sorted(m.payload["n"] for m in received) == [0, 3, 4, 5, 6, 7, 8]
        for n in (1, 2):
            first = [m for m in received if m.payload["n"] == n - 1][0]
            first.ack()
            drain_until(connection, received, 7 + n, timeout=10)
            assert received[-1].payload["n"] == n
        for message in received:
            if not message.acknowledged:
                message.ack()


def test_a_rejected_message_goes_to_the_dead_letter_topic(
    connection: kombu.Connection, broker: redisq.Broker
) -> None:
    with closing(connection.SimpleQueue("rejects")) as queue:
        queue.put({"poison": True})
        queue.get(timeout=5).reject(requeue=False)
        queue.put({"poison": False})
        after = queue.get(timeout=5)  # the queue goes on past it
        assert after.payload == {"poison": False}
        after.ack()
    dead_letter_topic = "rejects~dlq~kombu"
    partitions = broker.describe_topic(dead_letter_topic).config.partitions
    (dead,) = [m for p in range(partitions) for m in broker.read(dead_letter_topic, p)]
    stored = json.loads(dead.value)  # the Kombu message as it was published
    assert json.loads(base64.b64decode(stored["body"])) == {"poison": True}


def test_requeued_past_max_requeues_is_dead_lettered(
    redis_url: str, integration_namespace: str, broker: redisq.Broker
) -> None:
    options = {"namespace": integration_namespace, "max_requeues": 2}
    with kombu.Connection(redis_url, transport=TRANSPORT, transport_options=options) as conn:
        with closing(conn.SimpleQueue("requeues")) as queue:
            queue.put({"again": True})
            for attempt in range(3):
                message = queue.get(timeout=5)
                assert message.delivery_info["redelivered"] is (attempt > 0)
                message.requeue()
            with pytest.raises(queue.Empty):
                queue.get(timeout=1)
    assert broker.describe_topic("requeues~dlq~kombu").total_messages == 1


def test_a_message_not_acked_is_not_committed_and_comes_back(
    redis_url: str, integration_namespace: str, broker: redisq.Broker
) -> None:
    """basic_ack alone moves the group's position: a worker that got a message and died before
    acking it (here: left without acking) leaves it to the next member, however many polls the
    bridge made meanwhile (auto-commit would have acked it at the next one)."""
    options = {"namespace": integration_namespace}
    with kombu.Connection(redis_url, transport=TRANSPORT, transport_options=options) as first:
        with closing(first.SimpleQueue("unacked")) as queue:
            queue.put({"n": 1})
            assert queue.get(timeout=5).payload == {"n": 1}  # not acked
            time.sleep(1.0)  # four polls of the bridge, ten ack intervals
            lags = [p.lag for p in broker.describe_group("unacked", "kombu").partitions]
            assert sum(lag or 0 for lag in lags) == 1
    with kombu.Connection(redis_url, transport=TRANSPORT, transport_options=options) as second:
        with closing(second.SimpleQueue("unacked")) as queue:
            again = queue.get(timeout=10)
            assert again.payload == {"n": 1}
            again.ack()


def test_the_same_message_id_is_stored_once(
    connection: kombu.Connection, broker: redisq.Broker
) -> None:
    with closing(connection.SimpleQueue("dedup")) as queue:
        for _ in range(2):
            queue.put({"pay": 7}, headers={"message_id": "payment-7"})
        assert queue.get(timeout=5).payload == {"pay": 7}
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
    assert broker.describe_topic("dedup").total_messages == 1


def test_an_eta_header_is_a_delayed_message(
    connection: kombu.Connection, broker: redisq.Broker
) -> None:
    eta = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    with closing(connection.SimpleQueue("later")) as queue:
        queue.put({"later": True}, headers={"eta": eta})
        assert broker.describe_topic("later").total_scheduled == 1
        message = queue.get(timeout=10)
        assert datetime.now(UTC) >= datetime.fromisoformat(eta)
        message.ack()


def test_the_redisq_scheme_and_names_that_are_not_topic_names(
    redis_url: str, integration_namespace: str, broker: redisq.Broker
) -> None:
    url = "redisq://" + redis_url.split("://", 1)[1]
    with kombu.Connection(url, transport_options={"namespace": integration_namespace}) as conn:
        assert isinstance(conn.transport, Transport)
        with closing(conn.SimpleQueue("w1@host.celery pidbox")) as queue:
            queue.put("hello")
            message = queue.get(timeout=5)
            assert message.payload == "hello"
            message.ack()
    assert topic_for("w1@host.celery pidbox") in broker.list_topics()


def test_mapping_of_names_and_headers() -> None:
    assert topic_for("celery") == "celery"
    assert topic_for("a@b") != topic_for("a#b")  # the digest keeps distinct names apart
    assert topic_for(BINDINGS_TOPIC) != BINDINGS_TOPIC  # the transport's own topic is reserved
    assert len(topic_for("x" * 500)) <= 200
    celery = {"task": "t", "id": "abc", "retries": 0}
    assert task_message_id(celery) == "abc"
    assert task_message_id({**celery, "retries": 2}) == "abc.retry-2"  # a retry is a new message
    assert task_message_id({"message_id": "m"}) == "m"
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    assert due_time({"eta": past}) is None
    out = outgoing({"body": "", "headers": {"ordering_key": "k", **celery}, "properties": {}})
    assert (out.key, out.message_id) == ("k", "abc")
