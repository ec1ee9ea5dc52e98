# ruff: noqa: F811  (the Spark fixtures are imported from tests.spark.fixtures)
"""Foreign and malformed entries (issue 9, item 8): an entry another client XADDs to a partition
never blocks or crashes anything.

The decoder's rules are checked without a server (and fuzzed); then, on every backend, foreign
entries of each kind sit between good messages while orderly and concurrent consumers read with
run() and poll(), under each failure policy; broker.read in both modes; describe_group and the
logs show them; the consumer tests that take `api` run through both APIs (thread and asyncio).
A Spark test checks the reader (nulls and a count, or failOnMalformed).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redisq
from redisq.consume.deadletter import RAW_FIELDS_HEADER, list_dead_letters
from redisq.model.fields import decode_fields, encode_fields
from redisq.model.offsets import offset_parts
from redisq.model.records import (
    MalformedEntry,
    MalformedMessage,
    Message,
    decode_entries,
    decode_entry,
    encode_headers,
    parse_id_field,
)
from tests.conftest import wait_until

try:  # the Spark test's fixtures; without pyspark that one test is skipped
    from tests.spark.fixtures import reader, spark, spark_broker  # noqa: F401
except pytest.skip.Exception:
    reader = None

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}

# Entries other clients write: each breaks one rule of records.py.
FOREIGN: dict[str, list[bytes]] = {
    "non-numeric producer id": [b"k", b"fk1", b"v", b"x", b"p", b"abc"],
    "non-numeric sequence": [b"v", b"x", b"p", b"5", b"s", b"seven"],
    "sequence that int() takes": [b"v", b"x", b"p", b"5", b"s", b" 7_0"],
    "producer id past 2**63": [b"v", b"x", b"p", b"9223372036854775808"],
    "garbage headers": [b"k", b"fk2", b"v", b"x", b"h", b"\x00\x09garbage"],
    "truncated headers": [b"v", b"x", b"h", encode_headers({"a": "bcd"})[:-1]],
    "no value": [b"payload", b"x", b"source", b"legacy"],
}
# Not malformed: fields redisq does not know are ignored (a newer producer may add some).
EXTRA_FIELDS = [b"k", b"fk3", b"v", b"extra", b"trace", b"t-1", b"origin", b"cron"]


def xadd(broker: redisq.Broker, topic: str, partition: int, fields: list[bytes]) -> str:
    """A plain XADD, as another client would write it (names may repeat)."""
    reply = broker.client.execute_command("XADD", broker.keys.log(topic, partition), "*", *fields)
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def fill(broker: redisq.Broker, topic: str, partition: int = 0) -> dict[str, str]:
    """good 0..4, every foreign kind and one extra-fields entry, good 5..9; returns the
    offsets of the foreign entries by kind."""
    offsets = {}
    with broker.producer() as producer:
        for n in range(5):
            producer.send(topic, json.dumps({"n": n}), key=f"key{n % 2}", partition=partition)
        for kind, fields in FOREIGN.items():
            offsets[kind] = xadd(broker, topic, partition, fields)
        offsets["extra fields"] = xadd(broker, topic, partition, EXTRA_FIELDS)
        for n in range(5, 10):
            producer.send(topic, json.dumps({"n": n}), key=f"key{n % 2}", partition=partition)
    return offsets


class Recorder:
    """A handler that records what it was given and fails the test's way if it ever sees a
    malformed entry (the consumer must never hand one over)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Message] = []

    def __call__(self, message: Message) -> None:
        with self.lock:
            self.seen.append(message)

    def numbers(self) -> list[int | str]:
        with self.lock:
            return [json.loads(m.value)["n"] if m.value != b"extra" else "extra" for m in self.seen]

    def malformed(self) -> int:
        with self.lock:
            return sum(isinstance(m, MalformedMessage) for m in self.seen)


EXPECTED = [0, 1, 2, 3, 4, "extra", 5, 6, 7, 8, 9]


def assert_dead_lettered(broker: redisq.Broker, topic: str, group: str, offsets: dict) -> None:
    """Each foreign entry is in the dead-letter topic, with its raw fields and reason."""
    letters = {d.offset: d for d in list_dead_letters(broker, topic, group)}
    assert sorted(letters) == sorted(offsets[k] for k in FOREIGN)
    for kind, fields in FOREIGN.items():
        letter = letters[offsets[kind]]
        assert letter.raw_fields == list(zip(fields[0::2], fields[1::2], strict=True)), kind
        assert letter.error.startswith("MalformedEntry: "), kind
        assert f"{topic}/0@{offsets[kind]}" in letter.error
        assert letter.topic == topic and letter.group == group
        assert RAW_FIELDS_HEADER in letter.message.headers
    assert letters[offsets["no value"]].message.value == b""
    assert letters[offsets["non-numeric producer id"]].message.key == b"fk1"
    assert letters[offsets["non-numeric producer id"]].message.value == b"x"


# -- the decoder, without a server -------------------------------------------------------------
def test_each_foreign_kind_decodes_as_a_malformed_message_with_a_reason() -> None:
    for kind, fields in FOREIGN.items():
        message = decode_entry("t", 3, b"1700000000000-7", fields)
        assert isinstance(message, MalformedMessage), kind
        assert message.offset == "1700000000000-7" and message.timestamp_ms == 1700000000000
        assert message.raw_fields == tuple(zip(fields[0::2], fields[1::2], strict=True))
        assert message.reason, kind
        error = message.error()
        assert isinstance(error, MalformedEntry) and isinstance(error, ValueError)
        assert "t/3@1700000000000-7" in str(error)
    readable = decode_entry("t", 0, b"5-0", FOREIGN["non-numeric sequence"])
    assert readable.producer_id == 5 and readable.sequence is None and readable.value == b"x"
    assert "sequence b'seven'" in readable.reason  # type: ignore[attr-defined]
    extra = decode_entry("t", 0, b"5-1", EXTRA_FIELDS)
    assert type(extra) is Message and extra.key == b"fk3" and extra.value == b"extra"


def test_a_repeated_name_counts_with_its_last_value_on_every_path() -> None:
    """redis-py's parsed replies keep the last value of a repeated name; raw replies must say
    the same, or a consumer and broker.read would disagree about one entry."""
    raw = [b"v", b"x", b"p", b"abc", b"v", b"y", b"p", b"7"]
    parsed = dict(zip(raw[0::2], raw[1::2], strict=True))
    from_raw, from_parsed = decode_entries("t", 0, [(b"1-0", raw), (b"1-0", parsed)])
    assert from_raw == from_parsed
    assert type(from_raw) is Message and from_raw.value == b"y" and from_raw.producer_id == 7


def test_good_layouts_decode_as_before() -> None:
    headers = encode_headers({"trace": "abc", "bin": b"\x00\xff"})
    pid = b"4611686018427387904"
    layouts = [
        [b"k", b"a", b"v", b"1", b"p", pid, b"s", b"0"],
        [b"k", b"a", b"v", b"1", b"p", pid],
        [b"v", b"1", b"p", pid, b"s", b"9"],
        [b"k", b"a", b"v", b"1", b"m", b"id-1", b"p", pid],
        [b"k", b"a", b"v", b"1"],
        [b"k", b"a", b"v", b"1", b"h", headers, b"p", pid, b"s", b"3"],
        [b"v", b"1", b"h", headers, b"m", b"id-2"],
        {b"v": b"1", b"k": b"a", b"s": b"4"},  # as redis-py's XRANGE callback gives fields
    ]
    entries = [(f"1700000000001-{i}".encode(), fields) for i, fields in enumerate(layouts)]
    messages = decode_entries("t", 1, entries, deliveries=[1, 2, 0, 1, 1, 1, 1, 5])
    assert all(type(m) is Message for m in messages)
    assert [m.attempt for m in messages] == [1, 2, 1, 1, 1, 1, 1, 5]
    assert messages[0].producer_id == 4611686018427387904 and messages[0].sequence == 0
    assert messages[3].message_id == b"id-1" and messages[4].producer_id is None
    assert messages[5].headers == {"trace": b"abc", "bin": b"\x00\xff"}
    assert messages[6].key is None and messages[7].sequence == 4


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from([b"k", b"v", b"h", b"m", b"p", b"s"]),
            st.binary(max_size=12),
            st.from_regex(rb"[0-9]{1,21}", fullmatch=True),
        ),
        max_size=12,
    )
)
def test_the_decoder_never_raises(flat: list[bytes]) -> None:
    (message,) = decode_entries("t", 0, [(b"1-1", flat)])
    assert isinstance(message, Message) and message.offset == "1-1"
    if isinstance(message, MalformedMessage):
        assert message.reason


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=22), st.from_regex(rb"[0-9]{1,20}", fullmatch=True)))
def test_spark_applies_the_same_id_rule(raw: bytes) -> None:
    """The Spark reader's vectorised producer_id/sequence column agrees with parse_id_field."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("pyspark")
    from spark_connector.source import _id_column

    column, bad = _id_column([raw, b"12"])
    expected = parse_id_field(raw)
    assert column.to_pylist() == [expected, 12]
    assert bad == ([] if expected is not None else [0])


def test_raw_fields_round_trip() -> None:
    pairs = [(b"v", b"x" * 70000), (b"", b""), (b"v", b"\x00")]
    assert decode_fields(encode_fields(pairs)) == pairs
    with pytest.raises(ValueError):
        decode_fields(encode_fields(pairs)[:-1])


# -- consumers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("lanes", [1, 3])
def test_orderly_run_dead_letters_each_foreign_entry_and_handles_the_rest_in_order(
    api: Any, broker: redisq.Broker, lanes: int
) -> None:
    broker.create_topic("orders", partitions=1)
    offsets = fill(broker, "orders")
    recorder = Recorder()
    with api.broker.consumer("orders", "g", key_concurrency=lanes, **FAST) as consumer:
        consumer.run(recorder, idle_timeout=1.5)
        stats = consumer.stats
    assert recorder.malformed() == 0
    if lanes == 1:
        assert recorder.numbers() == EXPECTED
    else:  # key lanes: each key in order, the keys interleaved
        assert sorted(recorder.numbers(), key=str) == sorted(EXPECTED, key=str)
    assert stats.malformed == len(FOREIGN) == stats.dead_letters
    assert_dead_lettered(broker, "orders", "g", offsets)
    description = broker.describe_group("orders", "g")
    assert description.total_malformed == len(FOREIGN)
    assert description.partitions[0].dead_letters == len(FOREIGN)
    assert description.total_lag == 0 and description.total_pending == 0
    assert description.dead_letter_messages == len(FOREIGN)


def test_concurrent_run_dead_letters_them(broker: redisq.Broker) -> None:
    broker.create_topic("jobs", partitions=2)
    offsets = fill(broker, "jobs")
    recorder = Recorder()
    with broker.consumer("jobs", "w", mode="concurrent", **FAST) as consumer:
        consumer.run(recorder, idle_timeout=1.5)
    assert recorder.malformed() == 0
    assert recorder.numbers() == EXPECTED  # one partition holds them all: one worker, in order
    assert_dead_lettered(broker, "jobs", "w", offsets)
    assert broker.describe_group("jobs", "w").total_pending == 0


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
def test_poll_returns_the_good_messages_in_order(
    api: Any, broker: redisq.Broker, mode: str
) -> None:
    broker.create_topic("orders", partitions=1)
    offsets = fill(broker, "orders")
    got: list[Message] = []
    with api.broker.consumer("orders", "g", mode=mode, **FAST) as consumer:
        deadline = time.monotonic() + 60
        while len(got) < len(EXPECTED) and time.monotonic() < deadline:
            messages = consumer.poll(timeout=0.5, max_messages=4)
            got += messages
            consumer.ack(messages)
        assert consumer.stats.malformed == len(FOREIGN)
    assert not any(isinstance(m, MalformedMessage) for m in got)
    assert [m.offset for m in got] == sorted((m.offset for m in got), key=offset_parts)
    assert [json.loads(m.value)["n"] if m.value != b"extra" else "extra" for m in got] == EXPECTED
    assert_dead_lettered(broker, "orders", "g", offsets)
    assert broker.describe_group("orders", "g").total_pending == 0


def test_park_key_parks_a_readable_key_and_dead_letters_the_rest(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="fk1")
        bad_keyed = xadd(broker, "orders", 0, FOREIGN["non-numeric producer id"])  # key fk1
        bad_keyless = xadd(broker, "orders", 0, FOREIGN["no value"])
        producer.send("orders", json.dumps({"n": 1}), key="fk1")  # held behind the parked key
        producer.send("orders", json.dumps({"n": 2}), key="other")
    recorder = Recorder()
    consumer = broker.consumer("orders", "g", failure_policy="park_key", **FAST)
    thread = threading.Thread(target=consumer.run, args=(recorder,), daemon=True)
    thread.start()
    wait_until(lambda: recorder.numbers() == [0, 2], what="the unparked messages")

    def recorded() -> bool:  # the group's counters land with the next commit (ack_interval_ms)
        part = broker.describe_group("orders", "g").partitions[0]
        return part.parked_keys == 1 and part.malformed == 2 and part.dead_letters == 2

    wait_until(recorded, what="the parked key and both dead letters in the group's state")
    assert redisq.consume.deadletter.parked_keys(broker, "orders", "g") == {0: {b"fk1": bad_keyed}}
    assert {d.offset for d in list_dead_letters(broker, "orders", "g")} == {bad_keyed, bad_keyless}
    assert redisq.consume.deadletter.release_key(broker, "orders", "g", "fk1") == 1
    wait_until(lambda: recorder.numbers() == [0, 2, 1], what="the held message after release")
    consumer.close()
    thread.join(10)
    assert recorder.malformed() == 0


def test_block_holds_the_partition_until_the_entry_is_deleted(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="a")
        bad = xadd(broker, "orders", 0, FOREIGN["garbage headers"])
        producer.send("orders", json.dumps({"n": 1}), key="b")
    recorder = Recorder()
    consumer = broker.consumer("orders", "g", failure_policy="block", **FAST)
    thread = threading.Thread(target=consumer.run, args=(recorder,), daemon=True)
    thread.start()
    wait_until(
        lambda: broker.describe_group("orders", "g").partitions[0].blocked_offset == bad,
        what="the partition blocked on the foreign entry",
    )
    time.sleep(0.5)  # it stays blocked: retrying cannot change an entry
    part = broker.describe_group("orders", "g").partitions[0]
    assert part.blocked_offset == bad and (part.blocked_error or "").startswith("MalformedEntry")
    assert recorder.numbers() == [0] and consumer.stats.malformed == 1
    broker.client.xdel(broker.keys.log("orders", 0), bad)  # the operator removes it
    wait_until(lambda: recorder.numbers() == [0, 1], what="the partition going on")
    wait_until(
        lambda: broker.describe_group("orders", "g").partitions[0].blocked_offset is None,
        what="the blocked state cleared",
    )
    consumer.close()
    thread.join(10)
    assert recorder.malformed() == 0 and list_dead_letters(broker, "orders", "g") == []


def test_block_in_poll_returns_what_came_before_and_waits(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="a")
        bad = xadd(broker, "orders", 0, FOREIGN["non-numeric sequence"])
        producer.send("orders", json.dumps({"n": 1}), key="b")
    with api.broker.consumer("orders", "g", failure_policy="block", **FAST) as consumer:
        first = consumer.poll(timeout=10)
        assert [json.loads(m.value)["n"] for m in first] == [0]
        consumer.ack(first)
        assert consumer.poll(timeout=1.0) == []  # blocked
        part = broker.describe_group("orders", "g").partitions[0]
        assert part.blocked_offset == bad
        assert (part.blocked_error or "").startswith("MalformedEntry")
        broker.client.xdel(broker.keys.log("orders", 0), bad)  # the operator removes it
        rest = consumer.poll(timeout=10)
        assert [json.loads(m.value)["n"] for m in rest] == [1]
        consumer.ack(rest)
    assert broker.describe_group("orders", "g").partitions[0].blocked_offset is None
    assert list_dead_letters(broker, "orders", "g") == []


def test_block_in_poll_is_cleared_by_a_seek_past_it(broker: redisq.Broker) -> None:
    """poll() blocks on a malformed entry; the caller seeks past it: describe_group no longer
    shows the partition blocked once the next commit lands (before, the mark stayed for ever)."""
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="a")
        bad = xadd(broker, "orders", 0, FOREIGN["non-numeric sequence"])
        after = producer.send("orders", json.dumps({"n": 1}), key="b").offset
    with broker.consumer("orders", "g", failure_policy="block", **FAST) as consumer:
        consumer.ack(consumer.poll(timeout=10))
        assert consumer.poll(timeout=0.5) == []  # blocked
        assert broker.describe_group("orders", "g").partitions[0].blocked_offset == bad
        consumer.seek(0, after or "")
        rest = consumer.poll(timeout=10)
        assert [json.loads(m.value)["n"] for m in rest] == [1]
        consumer.ack(rest)
        consumer.commit()
        assert broker.describe_group("orders", "g").partitions[0].blocked_offset is None


def test_block_in_poll_on_the_next_entry_after_a_deleted_one_stays_shown(
    broker: redisq.Broker,
) -> None:
    """Blocked on bad1; bad1 is deleted and the re-read blocks on bad2 at once: the commit that
    clears bad1's mark must not clear bad2's (before, describe_group showed no block while the
    partition sat blocked on bad2)."""
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="a")
        bad1 = xadd(broker, "orders", 0, FOREIGN["non-numeric sequence"])
        bad2 = xadd(broker, "orders", 0, FOREIGN["non-numeric producer id"])
        producer.send("orders", json.dumps({"n": 1}), key="b")
    with broker.consumer("orders", "g", failure_policy="block", **FAST) as consumer:
        consumer.ack(consumer.poll(timeout=10))
        assert consumer.poll(timeout=0.5) == []
        assert broker.describe_group("orders", "g").partitions[0].blocked_offset == bad1
        broker.client.xdel(broker.keys.log("orders", 0), bad1)
        assert consumer.poll(timeout=0.5) == []  # blocked on bad2 now
        consumer.commit()
        assert broker.describe_group("orders", "g").partitions[0].blocked_offset == bad2
        broker.client.xdel(broker.keys.log("orders", 0), bad2)
        rest = consumer.poll(timeout=10)
        assert [json.loads(m.value)["n"] for m in rest] == [1]
        consumer.ack(rest)
    assert broker.describe_group("orders", "g").partitions[0].blocked_offset is None


def test_a_seek_while_poll_marks_a_block_leaves_no_mark(broker: redisq.Broker) -> None:
    """A seek from another thread lands while poll() is marking its read's malformed entry
    blocked: the read is dropped, and the mark it wrote is cleared with the next commit once
    the read from the seek's offset goes past the entry (white-box: the seek is made from
    inside the consumer's mark_blocked step)."""
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}), key="a")
        xadd(broker, "orders", 0, FOREIGN["non-numeric sequence"])
        after = producer.send("orders", json.dumps({"n": 1}), key="b").offset
    with broker.consumer("orders", "g", failure_policy="block", **FAST) as consumer:
        consumer.ack(consumer.poll(timeout=10, max_messages=1))
        real_mark = consumer.io.mark_blocked

        def mark_then_seek(*args: Any) -> Any:
            consumer.io.mark_blocked = real_mark  # type: ignore[method-assign]
            result = real_mark(*args)
            seeker = threading.Thread(target=consumer.seek, args=(0, after))
            seeker.start()
            seeker.join()
            return result

        consumer.io.mark_blocked = mark_then_seek  # type: ignore[method-assign]
        rest = consumer.poll(timeout=10)
        assert [json.loads(m.value)["n"] for m in rest] == [1]  # from the seek's offset
        consumer.ack(rest)
        consumer.commit()
        assert broker.describe_group("orders", "g").partitions[0].blocked_offset is None


def test_logs_are_bounded_and_counted(
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """200 foreign entries: a line or two with a count, never one line (or traceback) each."""
    broker.create_topic("orders", partitions=1)
    pipe = broker.client.pipeline(transaction=False)
    for n in range(200):
        pipe.execute_command("XADD", broker.keys.log("orders", 0), "*", "v", str(n), "p", "x")
    pipe.execute()
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"n": 0}))
    recorder = Recorder()
    caplog.set_level(logging.INFO, logger="redisq")
    with api.broker.consumer("orders", "g", **FAST) as consumer:
        consumer.run(recorder, idle_timeout=1.5)
    assert recorder.numbers() == [0] and consumer.stats.malformed == 200
    assert consumer.stats.dead_letters == 200
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(lines) <= 4, lines  # one per 10 s, and what is left at close
    assert not any(r.exc_info for r in caplog.records)
    assert "1 malformed entry dead-lettered to orders~dlq~g" in lines[0]
    counts = [re.search(r"(\d+) (?:more )?malformed entr", line) for line in lines]
    assert sum(int(m.group(1)) for m in counts if m) == 200
    assert broker.describe_group("orders", "g").total_malformed == 200


# -- broker.read ---------------------------------------------------------------------------------
def test_read_yields_them_or_raises_naming_the_offset(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    offsets = fill(broker, "orders")
    read = list(broker.read("orders", 0))
    assert len(read) == 10 + len(FOREIGN) + 1
    malformed = {m.offset: m for m in read if isinstance(m, MalformedMessage)}
    assert sorted(malformed) == sorted(offsets[k] for k in FOREIGN)
    assert malformed[offsets["non-numeric sequence"]].producer_id == 5
    assert malformed[offsets["garbage headers"]].key == b"fk2"
    seen: list[Message] = []
    with pytest.raises(MalformedEntry) as raised:
        for message in broker.read("orders", 0, on_malformed="raise"):
            seen.append(message)
    first = offsets["non-numeric producer id"]  # the first foreign entry
    assert raised.value.offset == first and raised.value.topic == "orders"
    assert f"orders/0@{first}" in str(raised.value)
    assert [json.loads(m.value)["n"] for m in seen] == [0, 1, 2, 3, 4]
    with pytest.raises(redisq.InvalidConfig):
        next(broker.read("orders", 0, on_malformed="skip"))


# -- Spark -----------------------------------------------------------------------------------------
@pytest.mark.spark
@pytest.mark.skipif(reader is None, reason="needs pyspark and pyarrow")
def test_spark_reads_nulls_and_counts_or_fails_on_request(
    spark: Any, spark_broker: redisq.Broker
) -> None:
    spark_broker.create_topic("orders")
    offsets = fill(spark_broker, "orders")
    rows = {
        r["offset"]: r
        for r in reader(
            spark, spark_broker, subscribe="orders", includeHeaders=True, includeMetadata=True
        ).collect()
    }
    assert len(rows) == 10 + len(FOREIGN) + 1
    assert rows[offsets["non-numeric producer id"]]["producer_id"] is None
    assert rows[offsets["non-numeric sequence"]]["producer_id"] == 5
    assert rows[offsets["non-numeric sequence"]]["sequence"] is None
    assert rows[offsets["producer id past 2**63"]]["producer_id"] is None
    assert rows[offsets["garbage headers"]]["headers"] is None
    assert rows[offsets["garbage headers"]]["key"] == b"fk2"
    assert rows[offsets["no value"]]["value"] is None
    assert rows[offsets["extra fields"]]["value"] == b"extra"
    good = [r for o, r in rows.items() if o not in offsets.values()]
    assert len(good) == 10
    assert all(r["producer_id"] is not None and r["sequence"] is not None for r in good)
    first = offsets["non-numeric producer id"]
    with pytest.raises(Exception, match=f"malformed entry orders/0@{first}"):
        reader(
            spark, spark_broker, subscribe="orders", includeMetadata=True, failOnMalformed=True
        ).collect()
