"""Names (issue 9, item 9): full-string validation, dead-letter topics that cannot collide and
fit for every valid topic and group, replay to the topic a letter came from, and consumers that
pick up added partitions within metadata_max_age_ms."""

from __future__ import annotations

import json
import threading
import time

import fakeredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redisq
from redisq import cli
from redisq.consume.deadletter import DeadLetterWriter, list_dead_letters, replay_dead_letters
from redisq.errors import InvalidConfig, InvalidName
from redisq.model.keys import (
    MAX_INTERNAL_TOPIC_CHARS,
    KeySpace,
    dead_letter_topic,
    parse_dead_letter_topic,
    validate_name,
    validate_namespace,
    validate_topic,
)
from redisq.model.records import Message
from tests.conftest import wait_until

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}
NAME = st.from_regex(r"[A-Za-z0-9._-]{1,200}", fullmatch=True).filter(
    lambda name: name not in (".", "..")  # refused: they read as directories in paths
)


def fail_all(message: Message) -> None:
    raise RuntimeError(f"cannot handle {message.value!r}")


def dead_letter_everything(broker: redisq.Broker, topic: str, group: str) -> None:
    with broker.consumer(topic, group, max_attempts=1, **FAST) as consumer:
        consumer.run(fail_all, idle_timeout=1.5)


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["orders\n", "orders\r\n", "\norders", "or ders", "", "a" * 201])
def test_names_are_checked_whole(bad: str) -> None:
    """re.match with "$" took "orders\\n": every name is checked as a whole string."""
    with pytest.raises(InvalidName):
        validate_topic(bad)
    for kind in ("producer", "group", "consumer"):
        with pytest.raises(InvalidName):
            validate_name(kind, bad)


@pytest.mark.parametrize("bad", ["rq\n", "rq\r\n", "\nrq", "r q", "r.q", "", "a" * 65])
def test_namespaces_are_checked_whole(bad: str) -> None:
    with pytest.raises(InvalidName):
        validate_namespace(bad)


def test_the_api_refuses_a_trailing_newline_everywhere() -> None:
    with pytest.raises(InvalidName):
        redisq.connect(client=fakeredis.FakeRedis(), namespace="rq\n")
    with pytest.raises(InvalidName):
        KeySpace("rq\n")
    broker = redisq.connect(client=fakeredis.FakeRedis(), namespace="names")
    with pytest.raises(InvalidName):
        broker.create_topic("orders\n")
    broker.create_topic("orders")
    with pytest.raises(InvalidName):
        broker.producer(name="svc\n")
    with pytest.raises(InvalidName):
        broker.consumer("orders", "billing\n")
    with pytest.raises(InvalidName):
        broker.consumer("orders", "billing", "member-1\n")
    assert broker.list_topics() == ["orders"]


# -- dead-letter topic names ---------------------------------------------------------------------
def test_dead_letter_topics_of_different_pairs_differ() -> None:
    assert dead_letter_topic("pay.eu", "billing") == "pay.eu~dlq~billing"
    assert dead_letter_topic("pay", "eu.billing") == "pay~dlq~eu.billing"
    assert parse_dead_letter_topic("pay.eu~dlq~billing") == ("pay.eu", "billing")
    assert parse_dead_letter_topic("pay~dlq~eu.billing") == ("pay", "eu.billing")
    assert parse_dead_letter_topic("pay.eu.billing.dlq") is None  # a user topic
    nested = dead_letter_topic(dead_letter_topic("t", "g"), "fixer")
    assert nested == "t~dlq~g~dlq~fixer" and parse_dead_letter_topic(nested) == ("t~dlq~g", "fixer")
    for bad in ["a~b", "a~dlq~", "~dlq~g", "a~dlqx~g", "a~dlq~g\n", "a~dlq~g~", "a~~dlq~g"]:
        with pytest.raises(InvalidName):
            validate_topic(bad)
        assert parse_dead_letter_topic(bad) is None
    with pytest.raises(InvalidName):
        dead_letter_topic("t", "bad~group")


@settings(max_examples=200, deadline=None)
@given(NAME, NAME, NAME)
def test_every_valid_pair_has_its_own_dead_letter_topic(topic: str, group: str, other: str) -> None:
    name = dead_letter_topic(topic, group)
    assert validate_topic(name) == name and len(name) <= 405 <= MAX_INTERNAL_TOPIC_CHARS
    assert parse_dead_letter_topic(name) == (topic, group)  # so no two pairs share one
    assert dead_letter_topic(name, other)  # a group reading dead letters has one too
    assert name != other and parse_dead_letter_topic(other) is None


def test_past_its_length_limit_a_group_needs_policy_block(broker: redisq.Broker) -> None:
    topic = "t" * 200
    while len(topic) + 5 + 200 <= MAX_INTERNAL_TOPIC_CHARS:
        topic = dead_letter_topic(topic, "g" * 200)
    broker.create_topic(topic)
    with pytest.raises(InvalidName, match="failure_policy='block'"):
        broker.consumer(topic, "g" * 200)
    with broker.consumer(topic, "g" * 200, failure_policy="block", **FAST) as consumer:
        assert consumer.stats.malformed == 0
    assert broker.describe_group(topic, "g" * 200).dead_letter_topic == ""


# -- dead letters end to end --------------------------------------------------------------------
def test_pay_eu_and_pay_keep_their_letters_apart(
    broker: redisq.Broker, server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    broker.create_topic("pay")
    broker.create_topic("pay.eu")
    with broker.producer() as producer:
        producer.send("pay", b"from pay", key="a")
        producer.send("pay.eu", b"from pay.eu", key="b")
    dead_letter_everything(broker, "pay", "eu.billing")
    dead_letter_everything(broker, "pay.eu", "billing")
    [pay_letter] = list_dead_letters(broker, "pay", "eu.billing")
    [eu_letter] = list_dead_letters(broker, "pay.eu", "billing")
    assert pay_letter.message.value == b"from pay" and eu_letter.message.value == b"from pay.eu"
    assert pay_letter.stored_in == "pay~dlq~eu.billing" != eu_letter.stored_in
    base = ["--url", server_url, "--namespace", broker.namespace]
    assert cli.main(["dlq", "replay", "pay", "eu.billing", "--all", *base]) == 0
    capsys.readouterr()
    assert [m.value for m in broker.read("pay", 0)] == [b"from pay", b"from pay"]
    assert [m.value for m in broker.read("pay.eu", 0)] == [b"from pay.eu"]
    assert list_dead_letters(broker, "pay", "eu.billing") == []
    assert len(list_dead_letters(broker, "pay.eu", "billing")) == 1


def test_replay_follows_the_letter_header_and_to_topic_overrides(broker: redisq.Broker) -> None:
    """Letters of the old shared name "pay.eu.billing.dlq" are told apart by their headers."""
    for topic in ("pay", "pay.eu", "audit"):
        broker.create_topic(topic)
    legacy = "pay.eu.billing.dlq"
    broker.create_topic(legacy)
    with broker.producer(idempotence=None) as producer:
        for source, group, value in (("pay.eu", "billing", b"eu"), ("pay", "eu.billing", b"p")):
            headers = {
                "x-redisq-topic": source,
                "x-redisq-partition": "0",
                "x-redisq-offset": "1-0",
                "x-redisq-group": group,
                "x-redisq-error": "RuntimeError: boom",
                "x-redisq-attempts": "1",
                "x-redisq-at-ms": "1",
                "trace": "t-1",
            }
            producer.send(legacy, value, key="k", headers=headers)
    assert [d.message.value for d in list_dead_letters(broker, "pay", "eu.billing")] == [b"p"]
    assert [d.message.value for d in list_dead_letters(broker, "pay.eu", "billing")] == [b"eu"]
    assert replay_dead_letters(broker, "pay", "eu.billing") == 1
    [back] = list(broker.read("pay", 0))
    assert back.value == b"p" and back.headers == {"trace": b"t-1"}
    assert list(broker.read("pay.eu", 0)) == []
    assert [m.value for m in broker.read(legacy, 0)] == [b"eu"]  # the other pair's letter stays
    assert replay_dead_letters(broker, "pay.eu", "billing", to_topic="audit") == 1
    assert [m.value for m in broker.read("audit", 0)] == [b"eu"]
    assert list(broker.read("pay.eu", 0)) == []


def test_a_letter_goes_back_to_the_topic_in_its_header(broker: redisq.Broker) -> None:
    broker.create_topic("orders")
    broker.create_topic("orders-v2")
    writer = DeadLetterWriter(broker, "orders", "g")
    message = Message("orders-v2", 0, "5-0", b"k", b"moved", {"trace": b"1"})
    writer.write(message, "RuntimeError: boom", 3)  # a letter that names another source topic
    writer.close()
    [letter] = list_dead_letters(broker, "orders", "g")
    assert letter.topic == "orders-v2" and letter.attempts == 3 and letter.error.endswith("boom")
    assert replay_dead_letters(broker, "orders", "g") == 1
    assert [m.value for m in broker.read("orders-v2", 0)] == [b"moved"]
    assert list(broker.read("orders", 0)) == []


def test_longest_names_are_consumable_and_listed(
    broker: redisq.Broker, server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 200-character topic with a 200-character group (150 + 60 failed before)."""
    topic, group = "t" * 200, "g" * 200
    broker.create_topic(topic)
    with broker.producer() as producer:
        producer.send(topic, b"poison", key="k")
    dead_letter_everything(broker, topic, group)
    dlq = f"{topic}~dlq~{group}"
    [letter] = list_dead_letters(broker, topic, group)
    assert letter.stored_in == dlq and letter.topic == topic
    description = broker.describe_group(topic, group)
    assert description.dead_letter_topic == dlq and description.dead_letter_messages == 1
    assert cli.main(["topic", "list", "--url", server_url, "--namespace", broker.namespace]) == 0
    assert capsys.readouterr().out.split() == [topic, dlq]
    # A group reading the dead letters has a dead-letter topic of its own.
    dead_letter_everything(broker, dlq, "fixer")
    [again] = list_dead_letters(broker, dlq, "fixer")
    assert again.stored_in == f"{dlq}~dlq~fixer" and again.message.value == b"poison"
    assert replay_dead_letters(broker, dlq, "fixer") == 1
    assert [m.value for m in broker.read(dlq, 0)] == [b"poison", b"poison"]  # acked, replayed


# -- partitions added while consuming -----------------------------------------------------------
def test_metadata_max_age_ms_is_checked(broker: redisq.Broker) -> None:
    broker.create_topic("orders")
    with pytest.raises(InvalidConfig, match="metadata_max_age_ms=0"):
        broker.consumer("orders", "g", metadata_max_age_ms=0)


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
def test_a_partition_added_elsewhere_is_read_within_metadata_max_age(
    broker: redisq.Broker, server_url: str, mode: str
) -> None:
    """add_partitions from another connection (another process would do the same): the group
    reads the new partition within metadata_max_age_ms, not after the 30 s topic cache."""
    broker.create_topic("orders", partitions=1)
    seen: list[Message] = []
    consumer = broker.consumer("orders", "g", mode=mode, metadata_max_age_ms=1000, **FAST)
    thread = threading.Thread(target=consumer.run, args=(seen.append,), daemon=True)
    thread.start()
    wait_until(lambda: consumer.assignment == [0], what="partition 0")
    with redisq.connect(server_url, namespace=broker.namespace) as admin:
        admin.add_partitions("orders", 3)
        added = time.monotonic()
        with admin.producer() as producer:
            producer.send("orders", json.dumps({"p": 2}), partition=2)
    wait_until(lambda: len(seen) == 1, timeout=30, what="the message in the new partition")
    took = time.monotonic() - added
    consumer.close()
    thread.join(10)
    assert seen[0].partition == 2
    assert took < 1.0 + 3.0, f"read {took:.1f} s after add_partitions"  # 1 s max age + slack
