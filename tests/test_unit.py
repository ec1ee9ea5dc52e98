"""Fast unit tests on fakeredis: key names, records, partitioner, errors, urls, producer input
checks, generated message ids, and the whole produce path (no real server, except one repr
check)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis
from redis.asyncio.connection import Connection as AsyncConnection
from redis.crc import key_slot

import redisq
from redisq import errors
from redisq.errors import (
    InvalidConfig,
    InvalidName,
    MessageTooLarge,
    OutOfOrderSequence,
    PartitionOutOfRange,
    ProducerFenced,
    TopicExists,
    TopicNotFound,
)
from redisq.model.keys import KeySpace, validate_name, validate_namespace, validate_topic
from redisq.model.msgid import MessageIdGenerator, decode_ulid, ulid_time_ms
from redisq.model.offsets import offset_at, offset_parts
from redisq.model.partitioner import StickyPartitioner, partition_for_key
from redisq.model.records import decode_entry, decode_headers, encode_headers
from redisq.protocol.resp import pack_commands
from redisq.server.connection import open_client, redact_url
from tests.servers import free_port


@pytest.fixture
def fake() -> Iterator[redisq.Broker]:
    broker = redisq.connect(client=fakeredis.FakeRedis(), namespace="unit")
    yield broker
    broker.close()


def namespace_keys(broker: redisq.Broker) -> list[bytes]:
    return sorted(broker.client.scan_iter(match=broker.keys.pattern()))


# -- keys ----------------------------------------------------------------------------------------


def hash_tag(key: str) -> str:
    start = key.index("{")
    return key[start + 1 : key.index("}", start)]


def test_partition_keys_share_one_hash_tag() -> None:
    keys = KeySpace("ns")
    partition_keys = [
        keys.log("orders", 3),
        keys.producer_state("orders", 3, 17),
        keys.dedup_bucket("orders", 3, 123456),
        keys.dedup_bucket("orders", 3, 123455),
    ]
    assert {hash_tag(k) for k in partition_keys} == {"orders:3"}
    assert len({key_slot(k.encode()) for k in partition_keys}) == 1
    assert all(k.startswith("ns:") for k in partition_keys)
    # Different partitions use different tags (they may land on different nodes).
    assert hash_tag(keys.log("orders", 2)) != hash_tag(keys.log("orders", 3))
    assert keys.partition_pattern("orders", 3).startswith("ns:{orders:3}:")


def test_namespace_keys_share_one_hash_tag() -> None:
    keys = KeySpace("ns")
    global_keys = [
        keys.topics(),
        keys.topic_meta("orders"),
        keys.named_producer("svc"),
        keys.named_producer_topics("svc"),
    ]
    assert {hash_tag(k) for k in global_keys} == {"ns"}
    assert len({key_slot(k.encode()) for k in global_keys}) == 1
    assert len(set(global_keys)) == len(global_keys)
    assert keys.pattern() == "ns:*"


def test_every_key_of_a_namespace_matches_its_pattern() -> None:
    keys = KeySpace("a")
    other = KeySpace("ab")
    for key in (keys.topics(), keys.log("t", 0), keys.producer_state("t", 0, 1)):
        assert key.startswith(keys.pattern()[:-1])
        # A namespace that is a prefix of another never matches the other's keys.
        assert not key.startswith(other.pattern()[:-1])


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "a{b", "x" * 65, "ns*", None, 5, b"ns"])
def test_invalid_namespace(bad: object) -> None:
    with pytest.raises(InvalidName, match="namespace"):
        validate_namespace(bad)
    with pytest.raises(InvalidName):
        KeySpace(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "t{1}", "x" * 201, "ü", None, 3, b"t"])
def test_invalid_topic_and_names(bad: object) -> None:
    with pytest.raises(InvalidName, match="topic"):
        validate_topic(bad)
    with pytest.raises(InvalidName, match="producer"):
        validate_name("producer", bad)


def test_valid_names() -> None:
    assert validate_namespace("rq_1-x") == "rq_1-x"
    assert validate_topic("orders.v2_eu-1") == "orders.v2_eu-1"
    assert validate_topic("x" * 200) == "x" * 200
    assert validate_name("group", "billing") == "billing"
    assert issubclass(InvalidName, ValueError)


# -- records -------------------------------------------------------------------------------------


def test_headers_round_trip() -> None:
    headers = {
        "trace-id": "abc123",
        "raw": b"\x00\xff\r\n binary",
        "ünïcødé 名前": "värde ✓ 値",
        "empty": b"",
        "": "empty name",
    }
    blob = encode_headers(headers)
    decoded = decode_headers(blob)
    assert decoded == {
        name: value.encode() if isinstance(value, str) else value for name, value in headers.items()
    }
    assert list(decoded) == list(headers)  # order kept


def test_headers_edge_cases() -> None:
    assert encode_headers(None) == b""
    assert encode_headers({}) == b""
    assert decode_headers(None) == {}
    assert decode_headers(b"") == {}
    assert decode_headers(encode_headers({"a": bytearray(b"x"), "b": memoryview(b"y")})) == {
        "a": b"x",
        "b": b"y",
    }
    big = b"v" * 70_000  # longer than a 2-byte length
    assert decode_headers(encode_headers({"big": big})) == {"big": big}


def test_headers_type_errors() -> None:
    with pytest.raises(TypeError, match="list"):
        encode_headers([("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="header names must be str, not bytes"):
        encode_headers({b"a": "b"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'a'.*int"):
        encode_headers({"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="65535"):
        encode_headers({"n" * 70_000: "x"})


def test_offset_helpers() -> None:
    assert offset_parts("1700000000000-5") == (1700000000000, 5)
    assert offset_parts("42") == (42, 0)
    assert offset_at("1700000000000-5", 0) == "1700000000000-5"
    assert offset_at("1700000000000-5", 3) == "1700000000000-8"
    assert offset_at("1-0", 1000) == "1-1000"
    ids = ["9-10", "10-2", "10-10", "10-9", "100-0"]
    assert sorted(ids, key=offset_parts) == ["9-10", "10-2", "10-9", "10-10", "100-0"]


def test_decode_entry_all_fields() -> None:
    fields = {
        b"k": b"order-42",
        b"v": b"paid",
        b"h": encode_headers({"x": "1"}),
        b"m": b"id-1",
        b"p": b"12",
        b"s": b"7",
    }
    message = decode_entry("orders", 2, b"1700000000123-4", fields)
    assert message.topic == "orders" and message.partition == 2
    assert message.offset == "1700000000123-4"
    assert message.key == b"order-42" and message.value == b"paid"
    assert message.headers == {"x": b"1"}
    assert message.timestamp_ms == 1700000000123
    assert message.timestamp == pytest.approx(1700000000.123)
    assert (message.producer_id, message.sequence, message.message_id) == (12, 7, b"id-1")
    assert message.attempt == 1


def test_decode_entry_minimal_fields() -> None:
    message = decode_entry("t", 0, "5-1", {b"v": b""})
    assert message.offset == "5-1"
    assert message.key is None and message.value == b"" and message.headers == {}
    assert message.producer_id is None and message.sequence is None and message.message_id is None
    assert decode_entry("t", 0, "5-1", {}).value == b""


# -- partitioner ---------------------------------------------------------------------------------


def test_key_partition_is_crc32() -> None:
    assert partition_for_key(b"order-42", 4) == zlib.crc32(b"order-42") % 4
    for n in (1, 3, 7, 16, 4096):
        for key in (b"", b"a", b"order-42", "ключ".encode(), bytes(range(256))):
            assert partition_for_key(key, n) == zlib.crc32(key) % n
    # A fixed value guards against someone swapping the hash (crc32 is a documented contract).
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert redisq.partition_for_key is partition_for_key


def test_sticky_partitioner_rotates_on_batch_sealed() -> None:
    sticky = StickyPartitioner()
    first = sticky.partition("t", 3)
    assert all(sticky.partition("t", 3) == first for _ in range(10))
    sticky.batch_sealed("t", (first + 1) % 3, 3)  # another partition's batch: no move
    assert sticky.partition("t", 3) == first
    seen = [first]
    for _ in range(5):
        sticky.batch_sealed("t", seen[-1], 3)
        seen.append(sticky.partition("t", 3))
    assert seen == [(first + i) % 3 for i in range(6)]
    # Topics are independent.
    other = sticky.partition("u", 3)
    sticky.batch_sealed("u", other, 3)
    assert sticky.partition("t", 3) == seen[-1]
    # Fewer partitions than the remembered one: pick again, in range.
    sticky._current["t"] = 2
    assert 0 <= sticky.partition("t", 2) < 2


# -- errors --------------------------------------------------------------------------------------


def test_from_reply_mapping() -> None:
    out_of_order = errors.from_reply("OUT_OF_ORDER expected=17", "t")
    assert isinstance(out_of_order, OutOfOrderSequence)
    assert out_of_order.expected == 17 and out_of_order.retriable
    assert "17" in str(out_of_order)
    assert errors.from_reply("OUT_OF_ORDER", "t").expected == -1  # type: ignore[union-attr]
    fenced = errors.from_reply("PRODUCER_FENCED stored=3 got=2", "t")
    assert isinstance(fenced, ProducerFenced) and not fenced.retriable
    assert "stored=3 got=2" in str(fenced)
    missing = errors.from_reply("TOPIC_NOT_FOUND", "orders")
    assert isinstance(missing, TopicNotFound) and missing.topic == "orders"
    exists = errors.from_reply("TOPIC_EXISTS", "orders")
    assert isinstance(exists, TopicExists) and exists.topic == "orders"
    assert errors.from_reply("ERR something else") is None
    assert errors.from_reply("NOSCRIPT No matching script") is None


def test_error_hierarchy() -> None:
    for cls in (InvalidName, InvalidConfig, PartitionOutOfRange, MessageTooLarge):
        assert issubclass(cls, ValueError) and issubclass(cls, errors.RedisqError)
    too_large = MessageTooLarge(2000, 1000)
    assert (too_large.size, too_large.limit) == (2000, 1000)
    assert "2000" in str(too_large) and "1000" in str(too_large)
    out_of_range = PartitionOutOfRange("t", 9, 4)
    assert "0..3" in str(out_of_range) and out_of_range.partition == 9


def test_script_error_replies_are_typed(fake: redisq.Broker) -> None:
    """Lua error replies reach the caller as typed errors (fakeredis passes them through)."""
    keys = [fake.keys.log("nope", 0), fake.keys.producer_state("nope", 0, 1)]
    with pytest.raises(TopicNotFound) as caught:
        fake.scripts.call(
            "produce_sequence", keys, [1, 0, 0, 1, 0, 4, 60000, 0, 0, "v", "x", "0"], topic="nope"
        )
    assert caught.value.topic == "nope"
    with pytest.raises(TopicNotFound):
        fake.delete_topic("nope")


# -- urls and reprs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://default:secret@host:6379/0", "redis://default:***@host:6379/0"),
        ("rediss://:s3cr3t@example.com:6380", "rediss://:***@example.com:6380"),
        ("redis://user:p%40ss@10.0.0.1/2", "redis://user:***@10.0.0.1/2"),
        ("redis+cluster://u:pw@h:7000", "redis+cluster://u:***@h:7000"),
        ("redis://secretuser@host:1", "redis://secretuser:***@host:1"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    if ":" in url.split("@")[0].split("//", 1)[1] and "@" in url:
        password = url.split("//", 1)[1].split("@")[0].split(":", 1)[1]
        assert password not in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:Sekr1t@[::1",  # broken IPv6 literal
        "redis://user:Sekr1t@host:notaport/0",
        "redis://u:Sekr1t@more@host:1",  # an unescaped @ in the password
        "redis://:Sekr1t@h:99999",
        "rediss://u:Sekr1t@[::1]:6380/1",
    ],
)
def test_redact_odd_urls_never_show_the_password(url: str) -> None:
    assert "Sekr1t" not in redact_url(url)


def test_connection_error_hides_password() -> None:
    url = f"redis://default:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError) as caught:
        open_client(url, socket_connect_timeout=1, retry_on_timeout=False)
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def test_client_library_retries_are_refused() -> None:
    """redis-py would re-send a script whose reply was lost; redisq owns its retries."""
    for option in ({"retry_on_timeout": True}, {"retry_on_error": [redis.ConnectionError]}):
        with pytest.raises(InvalidConfig, match="retries"):
            open_client(f"redis://127.0.0.1:{free_port()}/0", **option)


def test_broker_repr_hides_password(valkey_server: Any) -> None:
    """Valkey's default user has nopass, so AUTH default <anything> succeeds."""
    url = f"redis://default:topsecret@127.0.0.1:{valkey_server.port}/0"
    broker = redisq.connect(url, namespace="reprtest")
    try:
        assert "topsecret" not in repr(broker)
        assert f"redis://default:***@127.0.0.1:{valkey_server.port}/0" in repr(broker)
        assert "reprtest" in repr(broker)
    finally:
        broker.close()


def test_fake_broker_repr(fake: redisq.Broker) -> None:
    assert repr(fake) == "<redisq.Broker FakeRedis namespace='unit' server='fakeredis'>"


# -- producer configuration ----------------------------------------------------------------------

RANGES = {
    "linger_ms": (0, 60_000),
    "max_batch_messages": (1, 10_000),
    "max_batch_bytes": (1024, 64 << 20),
    "max_in_flight": (1, 100),
    "window": (1, 1000),
    "max_message_bytes": (1, 512 << 20),
    "delivery_timeout_ms": (100, 24 * 3600 * 1000),
    "retry_backoff_ms": (1, 60_000),
    "max_buffered_messages": (1, 100_000_000),
    "min_replicas": (1, 100),
    "ack_timeout_ms": (0, 3_600_000),
}


@pytest.mark.parametrize("name", sorted(RANGES))
def test_producer_rejects_out_of_range(fake: redisq.Broker, name: str) -> None:
    low, high = RANGES[name]
    for bad in (low - 1, high + 1):
        options: dict[str, Any] = {name: bad}
        if name == "max_in_flight":
            options["window"] = 1000
        with pytest.raises(InvalidConfig) as caught:
            fake.producer(**options)
        message = str(caught.value)
        assert f"{name}={bad}" in message
        assert f"{low}..{high}" in message


@pytest.mark.parametrize("name", sorted(RANGES))
def test_producer_rejects_wrong_types(fake: redisq.Broker, name: str) -> None:
    for bad in ("5", True, None, [1]):
        with pytest.raises(TypeError, match=name):
            fake.producer(**{name: bad})


def test_producer_rejects_bad_choices(fake: redisq.Broker) -> None:
    with pytest.raises(InvalidConfig, match="idempotence='exactly'"):
        fake.producer(idempotence="exactly")
    with pytest.raises(InvalidConfig, match="acks='all'"):
        fake.producer(acks="all")
    with pytest.raises(InvalidConfig, match="window=2 must be >= max_in_flight=5"):
        fake.producer(window=2, max_in_flight=5)
    with pytest.raises(TypeError, match="partitioner must be callable, not int"):
        fake.producer(partitioner=3)
    with pytest.raises(InvalidName, match="producer"):
        fake.producer(name="bad name")
    with pytest.raises(errors.UnsupportedServer, match="WAITAOF"):
        fake.producer(acks="fsync")
    # A small window is fine without sequence idempotence.
    fake.producer(idempotence=None, window=1, max_in_flight=5).close()
    # Nothing was left behind by the refused producers.
    assert namespace_keys(fake) == []


# -- generated message ids ----------------------------------------------------------------------


def test_generated_message_ids_are_monotonic_ulids() -> None:
    first, second = MessageIdGenerator(), MessageIdGenerator()
    before = int(time.time() * 1000)
    ids = [first.next_id() for _ in range(20_000)]  # many per millisecond
    after = int(time.time() * 1000)
    assert all(len(i) == 26 for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert before <= ulid_time_ms(ids[0]) <= ulid_time_ms(ids[-1]) <= after + 1
    assert all(decode_ulid(i) >> 128 == 0 for i in (ids[0], ids[-1]))
    other = [second.next_id() for _ in range(20_000)]
    assert not set(other) & set(ids)  # no lease, no counter in Redis: unique by construction


# -- topics --------------------------------------------------------------------------------------


def test_topic_lifecycle(fake: redisq.Broker) -> None:
    config = fake.create_topic("orders", partitions=3, retention_ms=60_000)
    assert config.partitions == 3 and config.dedup_window_ms == 60_000
    assert config.state_ttl_ms >= config.retention_ms
    assert fake.list_topics() == ["orders"]
    with pytest.raises(TopicExists):
        fake.create_topic("orders", partitions=5)
    assert fake.create_topic("orders", partitions=5, exist_ok=True).partitions == 3
    description = fake.describe_topic("orders")
    assert [p.partition for p in description.partitions] == [0, 1, 2]
    assert all(p.length == 0 and p.first_offset is None for p in description.partitions)
    fake.delete_topic("orders")
    assert fake.list_topics() == []
    assert namespace_keys(fake) == []
    with pytest.raises(TopicNotFound):
        fake.describe_topic("orders")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"topic": "bad name"}, InvalidName),
        ({"partitions": 0}, InvalidConfig),
        ({"partitions": 4097}, InvalidConfig),
        ({"partitions": "2"}, TypeError),
        ({"partitions": True}, TypeError),
        ({"retention_ms": -1}, InvalidConfig),
        ({"retention_messages": -5}, InvalidConfig),
        ({"dedup_window_ms": 10}, InvalidConfig),
        ({"producer_state_ttl_ms": 999}, InvalidConfig),
    ],
)
def test_create_topic_bad_input_writes_nothing(
    fake: redisq.Broker, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    arguments = {"topic": "t", "partitions": 2, **kwargs}
    with pytest.raises(error):
        fake.create_topic(arguments.pop("topic"), **arguments)
    assert namespace_keys(fake) == []


def test_partition_checks(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=2)
    assert fake.check_partition("t", 1) == 1
    with pytest.raises(PartitionOutOfRange, match="0..1"):
        fake.check_partition("t", 2)
    with pytest.raises(PartitionOutOfRange):
        fake.check_partition("t", -1)
    with pytest.raises(TypeError, match="bool"):
        fake.check_partition("t", True)
    with pytest.raises(TopicNotFound):
        fake.check_partition("missing", 0)


# -- the produce path ----------------------------------------------------------------------------


def test_send_and_read_sequence_mode(fake: redisq.Broker) -> None:
    fake.create_topic("orders", partitions=4)
    with fake.producer(name="svc") as producer:
        first = producer.send("orders", b"paid", key="order-42", headers={"h": "1", "b": b"\x00"})
        second = producer.send("orders", "shipped ✓", key=b"order-42")
    expected_partition = zlib.crc32(b"order-42") % 4
    assert first.partition == second.partition == expected_partition
    assert not first.duplicate and not second.duplicate
    assert offset_parts(first.offset) < offset_parts(second.offset)  # type: ignore[arg-type]
    messages = list(fake.read("orders", expected_partition))
    assert [m.offset for m in messages] == [first.offset, second.offset]
    assert [m.value for m in messages] == [b"paid", "shipped ✓".encode()]
    assert messages[0].headers == {"h": b"1", "b": b"\x00"}
    assert messages[1].headers == {}
    assert {m.key for m in messages} == {b"order-42"}
    assert [m.sequence for m in messages] == [0, 1]
    assert messages[0].producer_id == producer.producer_id
    assert fake.describe_topic("orders").total_messages == 2


def test_send_async_flush_keeps_key_order(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=3)
    with fake.producer(linger_ms=50, max_batch_messages=7, max_in_flight=3) as producer:
        futures = [
            producer.send_async("t", f"{key}:{i}".encode(), key=f"k{key}")
            for i in range(100)
            for key in range(5)
        ]
        producer.flush()
        assert all(f.done() for f in futures)
        metas = [f.result() for f in futures]
    assert not any(m.duplicate for m in metas)
    assert len({(m.partition, m.offset) for m in metas}) == len(metas)
    for key in range(5):
        partition = partition_for_key(f"k{key}".encode(), 3)
        values = [m.value for m in fake.read("t", partition) if m.key == f"k{key}".encode()]
        assert values == [f"{key}:{i}".encode() for i in range(100)]
    # Offsets reported match what is in the stream.
    for future, meta in zip(futures[:20], metas[:20], strict=True):
        stored = next(fake.read("t", meta.partition, start=meta.offset, count=1))
        assert stored.offset == meta.offset
        assert future.exception() is None
    # Per producer and partition, the sequences are 0, 1, 2, ... in stream order.
    for p in range(3):
        sequences = [m.sequence for m in fake.read("t", p)]
        assert sequences == list(range(len(sequences)))


def test_send_without_key_is_sticky_and_spreads(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=3)
    with fake.producer(max_batch_messages=10, linger_ms=1000) as producer:
        futures = [producer.send_async("t", b"x") for _ in range(60)]
        producer.flush()
    partitions = [f.result().partition for f in futures]
    # Batches of 10 stick to one partition, then move on round-robin.
    for start in range(0, 60, 10):
        assert len(set(partitions[start : start + 10])) == 1
    assert set(partitions) == {0, 1, 2}


def test_custom_partitioner_and_explicit_partition(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=4)
    calls: list[tuple[str, bytes | None, bytes, int]] = []

    def selector(topic: str, key: bytes | None, value: bytes, partitions: int) -> int:
        calls.append((topic, key, value, partitions))
        return 2

    with fake.producer(partitioner=selector) as producer:
        assert producer.send("t", b"v", key="k").partition == 2
        assert producer.send("t", b"v", partition=3).partition == 3
    assert calls == [("t", b"k", b"v", 4)]

    with fake.producer(partitioner=lambda *_: 9) as producer:
        with pytest.raises(PartitionOutOfRange):
            producer.send("t", b"v")


def test_send_bad_input_raises_and_writes_nothing(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=2)
    with fake.producer(max_message_bytes=100) as producer:
        with pytest.raises(TypeError, match="value must be bytes or str, not int"):
            producer.send("t", 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="value must be bytes or str, not NoneType"):
            producer.send("t", None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key must be bytes or str, not float"):
            producer.send("t", b"v", key=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="key must not be empty"):
            producer.send("t", b"v", key="")
        with pytest.raises(TypeError, match="header"):
            producer.send("t", b"v", headers={"a": 1})  # type: ignore[dict-item]
        with pytest.raises(MessageTooLarge) as too_large:
            producer.send("t", b"x" * 90, key=b"k" * 20)
        assert too_large.value.size == 110 and too_large.value.limit == 100
        with pytest.raises(TopicNotFound):
            producer.send("missing", b"v")
        with pytest.raises(InvalidName):
            producer.send("bad topic", b"v")
        with pytest.raises(PartitionOutOfRange):
            producer.send("t", b"v", partition=2)
        with pytest.raises(TypeError):
            producer.send("t", b"v", partition="0")  # type: ignore[arg-type]
        with pytest.raises(redisq.InvalidConfig, match="would not be deduplicated"):
            producer.send("t", b"v", message_id="m-1")  # a sequence producer's: refused
        producer.flush()
    with fake.producer(idempotence="message_id") as by_id:
        with pytest.raises(ValueError, match="message_id must not be empty"):
            by_id.send("t", b"v", message_id="")
    assert fake.describe_topic("t").total_messages == 0


def test_send_after_close(fake: redisq.Broker) -> None:
    fake.create_topic("t")
    producer = fake.producer()
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(errors.ProducerClosed):
        producer.send("t", b"v")


def test_message_id_duplicates(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=4)
    with fake.producer(idempotence="message_id") as producer:
        first = producer.send("t", b"a", message_id="order-1")
        again = producer.send("t", b"a-again", message_id="order-1")
        number = producer.send("t", b"n", message_id=12345)
        number_again = producer.send("t", b"n", message_id="12345")  # same bytes as the int
        generated = [producer.send_async("t", b"g") for _ in range(50)]
        in_batch = [producer.send_async("t", b"b", message_id="dup-in-batch") for _ in range(3)]
        producer.flush()
    # Without a key, the id routes the message: its dedup scope is its partition.
    assert first.partition == zlib.crc32(b"order-1") % 4
    assert not first.duplicate
    assert again.duplicate and again.offset == first.offset and again.partition == first.partition
    assert not number.duplicate and number_again.duplicate
    assert number_again.offset == number.offset
    metas = [f.result() for f in generated]
    assert not any(m.duplicate for m in metas)
    # An offset (stream ID) is unique only within its partition: two partitions can both hold
    # 1700000000000-0. The 50 generated ids are 50 distinct messages, none of them "order-1".
    assert len({(m.partition, m.offset) for m in [*metas, first]}) == 51
    batch_metas = [f.result() for f in in_batch]
    assert [m.duplicate for m in batch_metas] == [False, True, True]
    assert {(m.partition, m.offset) for m in batch_metas} == {
        (batch_metas[0].partition, batch_metas[0].offset)
    }
    # Every message id is in the topic exactly once.
    ids = [m.message_id for p in range(4) for m in fake.read("t", p)]
    assert len(ids) == len(set(ids)) == 2 + 50 + 1
    stored = next(fake.read("t", first.partition, start=first.offset, count=1))
    assert stored.value == b"a" and stored.message_id == b"order-1"


def test_message_id_with_key_routes_by_key(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=4)
    with fake.producer(idempotence="message_id") as producer:
        meta = producer.send("t", b"v", key="order-42", message_id="m")
        dup = producer.send("t", b"v", key="order-42", message_id="m")
    assert meta.partition == dup.partition == zlib.crc32(b"order-42") % 4
    assert dup.duplicate and dup.offset == meta.offset


def test_no_idempotence_writes_every_send(fake: redisq.Broker) -> None:
    fake.create_topic("t")
    with fake.producer(idempotence=None) as producer:
        metas = [producer.send("t", b"same") for _ in range(3)]
    assert len({m.offset for m in metas}) == 3
    messages = list(fake.read("t", 0))
    assert [m.value for m in messages] == [b"same"] * 3
    assert all(m.sequence is None and m.message_id is None for m in messages)


def test_named_producer_fences_older_instance(fake: redisq.Broker) -> None:
    fake.create_topic("t", partitions=2)
    old = fake.producer(name="svc")
    old.send("t", b"1", key="a")
    new = fake.producer(name="svc")
    assert new.producer_id == old.producer_id and new.epoch > old.epoch
    with pytest.raises(ProducerFenced):
        old.send("t", b"2", key="a")
    with pytest.raises(ProducerFenced):  # fenced producers stay fenced
        old.send("t", b"3", key="b")
    old.close()
    new.send("t", b"4", key="a")
    new.close()
    values = [m.value for p in range(2) for m in fake.read("t", p)]
    assert sorted(values) == [b"1", b"4"]


def test_lost_reply_is_answered_from_the_window(
    fake: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection dropped after the script ran: the re-sent batch is a duplicate inside the
    window and comes back with the offsets it was written at; nothing is written twice."""
    from redisq.server.transport import Transport

    fake.create_topic("t")
    real_read = Transport.read
    failures = {"left": 1}

    def flaky_read(
        self: Transport, node: str, count: int, deadline: float | None = None
    ) -> list[Any]:
        replies = real_read(self, node, count, deadline)
        written = any(isinstance(r, list) and r[:1] == [b"OK"] for r in replies)
        if written and failures["left"]:  # the scripts ran; their replies are lost
            failures["left"] -= 1
            raise redis.ConnectionError("injected: connection lost")
        return replies

    monkeypatch.setattr(Transport, "read", flaky_read)
    with fake.producer(retry_backoff_ms=1) as producer:
        futures = [producer.send_async("t", f"m{i}".encode()) for i in range(5)]
        producer.flush()
    assert failures["left"] == 0
    metas = [f.result() for f in futures]
    messages = list(fake.read("t", 0))
    assert [m.value for m in messages] == [f"m{i}".encode() for i in range(5)]
    assert [m.offset for m in metas] == [m.offset for m in messages]
    assert all(m.duplicate for m in metas)  # the answer came from the window


def test_topic_deleted_under_producer(fake: redisq.Broker) -> None:
    fake.create_topic("t")
    with fake.producer() as producer:
        producer.send("t", b"1")
        fake.delete_topic("t")
        with pytest.raises(TopicNotFound):
            producer.send("t", b"2")
    # The script refused before writing anything: no partition key came back.
    assert namespace_keys(fake) == []


def test_retention_by_count(fake: redisq.Broker) -> None:
    """retention_messages=N keeps the newest N messages and trims whole stream nodes only
    (MAXLEN ~): after every batch N <= length <= N + stream-node-max-entries - 1 (a node is
    dropped only if the rest still holds N), and what is kept is the newest, contiguous."""
    node_entries = 4  # small nodes make the bound tight (the default, 100, allows 109 of 200)
    fake.client.config_set("stream-node-max-entries", node_entries)
    fake.create_topic("t", retention_messages=10)
    lengths = []
    with fake.producer(max_batch_messages=5) as producer:
        for i in range(200):
            producer.send_async("t", b"%d" % i)
            if i % 5 == 4:
                producer.flush()
                lengths.append((i + 1, fake.describe_topic("t").partitions[0].length))
    for sent, length in lengths:
        assert min(sent, 10) <= length <= 10 + node_entries - 1, (sent, length)
    values = [int(m.value) for m in fake.read("t", 0)]
    assert values == list(range(200 - len(values), 200))


# -- RESP packing of the consumers' commands ----------------------------------------------------


@pytest.mark.parametrize(
    "commands",
    [
        [("XACK", "rq:{t:0}:log", "g", *[f"1795408158416-{i}" for i in range(1000)])],
        [
            ("GET", "rq:{t:0}:lease"),
            ("XRANGE", "rq:{t:0}:log", "(1-0", "+", "COUNT", 1000),
            ("XREADGROUP", "GROUP", "g", "m", "COUNT", 10, "BLOCK", 0, "STREAMS", "k", ">"),
        ],
        [("SET", "ключ", b"\x00\r\n", bytearray(b"ab"), memoryview(b"mv"), 1.5, -(10**20))],
        [("SET", "k", "v" * 5000, b"b" * 70_000)],
    ],
)
def test_pack_commands_writes_the_bytes_redis_py_would(commands: list[tuple[Any, ...]]) -> None:
    packed = pack_commands(commands)
    assert packed == b"".join(redis.Connection().pack_commands(commands))
    assert packed == b"".join(AsyncConnection().pack_commands(commands))


@pytest.mark.parametrize("bad", [True, None, object(), ["list"]])
def test_pack_commands_refuses_what_redis_py_refuses(bad: object) -> None:
    with pytest.raises(TypeError, match="command argument"):
        pack_commands([("SET", "k", bad)])
    with pytest.raises(redis.DataError):
        redis.Connection().pack_commands([("SET", "k", bad)])


def test_backoff_after_many_attempts_stays_at_its_maximum() -> None:
    """failure_policy="block" retries for ever: the 1,025th attempt's delay was 2**1024 times
    the base, an OverflowError that killed the partition's worker (seen in CI)."""
    from redisq.consume.policies import Backoff

    backoff = Backoff(base_ms=1, max_ms=10)
    for attempt in (1, 2, 64, 65, 1025, 10**6):
        assert 0.0 <= backoff.delay(attempt) <= 0.010
    assert backoff.delay(10**6) >= 0.005  # equal jitter: at least half the maximum


def test_a_fakeredis_topic_holds_message_entries_and_refuses_batch_ones(
    fake: redisq.Broker,
) -> None:
    """fakeredis cannot hold batch entries (no `struct` in its Lua, no XSETID): a topic created
    without a format gets message entries there, and asking for batch entries is refused
    before anything is written."""
    assert fake.create_topic("plain").entry_format == "message"
    with fake.producer() as producer:
        producer.send("plain", b"x")
    assert [m.value for m in fake.read("plain", 0)] == [b"x"]
    before = namespace_keys(fake)
    with pytest.raises(InvalidConfig, match="fakeredis cannot hold batch entries"):
        fake.create_topic("packed", entry_format="batch")
    assert namespace_keys(fake) == before
    assert "packed" not in fake.list_topics()
