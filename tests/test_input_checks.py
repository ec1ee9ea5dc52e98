"""Bad input refused with a typed error before anything is written, through both APIs, on every
backend: topic settings out of range (and such settings stored by another client), integer
producer options given as floats, the idempotent handler's TTLs, message ids counted against
max_message_bytes, Broker.read's arguments, ack() of what is not a Message or was never given
out, and send_async's checks on the first send to a topic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import redisq
from redisq.errors import InvalidConfig, MessageTooLarge
from redisq.model.records import Message
from redisq.model.topic import MAX_TOPIC_SETTING, TopicConfig
from redisq.produce.encoder import MessageEncoder
from redisq.protocol import schedule
from redisq.settings import ProducerSettings
from tests.aio import FAST, Env, aio
from tests.marks import ONE_BACKEND


def namespace_keys(broker: redisq.Broker) -> list[bytes]:
    return list(broker.client.scan_iter(match=broker.keys.pattern(), count=1000))


def length(broker: redisq.Broker, topic: str, partition: int = 0) -> int:
    return int(broker.client.xlen(broker.keys.log(topic, partition)))


TOPIC_SETTINGS = ["retention_ms", "retention_messages", "dedup_window_ms", "producer_state_ttl_ms"]


# -- topic settings --------------------------------------------------------------------------------
def test_create_topic_bounds_its_settings(env: Env) -> None:
    """2**53 - 1 (the largest integer a Lua number holds) is accepted and works; one more is
    refused before any key is written, sync and asyncio."""
    for name in TOPIC_SETTINGS:
        with pytest.raises(InvalidConfig, match=f"{name}="):
            env.sync.create_topic("t", **{name: MAX_TOPIC_SETTING + 1})
    assert namespace_keys(env.sync) == []

    @aio
    async def refused() -> None:
        async with env.connect() as broker:
            for name in TOPIC_SETTINGS:
                with pytest.raises(InvalidConfig, match=f"{name}="):
                    await broker.create_topic("t", **{name: 2**70})

    refused()
    assert namespace_keys(env.sync) == []
    env.sync.create_topic("t", **dict.fromkeys(TOPIC_SETTINGS, MAX_TOPIC_SETTING))
    for idempotence in ("sequence", "message_id", None):
        with env.sync.producer(idempotence=idempotence) as producer:
            assert not producer.send("t", b"v", key="k").duplicate
    assert length(env.sync, "t") == 3
    assert env.sync.trim("t") == 0


# A value another client (or an older version) stored in the metadata hash: the produce scripts
# refuse it before their first XADD (XTRIM / PEXPIRE after the append would fail).
STORED = [
    ("retention_messages", 2**70, (None, "sequence", "message_id")),
    ("retention_ms", 2**63, (None, "sequence", "message_id")),
    ("producer_state_ttl_ms", 2**70, ("sequence", "message_id")),
    ("dedup_window_ms", 0, ("message_id",)),
]


@pytest.mark.parametrize(("field", "value", "modes"), STORED, ids=[s[0] for s in STORED])
def test_an_out_of_range_stored_setting_writes_nothing(
    env: Env, field: str, value: int, modes: tuple[str | None, ...]
) -> None:
    env.sync.create_topic("t")
    env.sync.client.hset(env.sync.keys.topic_meta("t"), field, value)
    state = set(namespace_keys(env.sync))
    for idempotence in modes:
        with env.sync.producer(idempotence=idempotence, delivery_timeout_ms=5000) as producer:
            with pytest.raises(InvalidConfig, match="out of range"):
                producer.send("t", b"v", key="k")
            with pytest.raises(InvalidConfig, match="out of range"):
                producer.send_async("t", b"v").result(timeout=10)

    @aio
    async def through_asyncio() -> None:
        async with env.connect() as broker:
            for idempotence in modes:
                async with broker.producer(idempotence=idempotence) as producer:
                    with pytest.raises(InvalidConfig, match="out of range"):
                        await producer.send("t", b"v", key="k")

    through_asyncio()
    assert length(env.sync, "t") == 0
    assert set(namespace_keys(env.sync)) == state  # no producer state, no dedup bucket either
    if field.startswith("retention"):
        with pytest.raises(InvalidConfig, match=field):
            env.sync.trim("t")
        # Delivering delayed messages checks them too, before it takes the scheduler lease.
        deliver = schedule.deliver_due(
            env.sync.keys, "t", 0, "token", limit=10, lease_ttl_ms=1000,
            retention_messages=2**70 if field == "retention_messages" else 0,
            retention_ms=2**63 if field == "retention_ms" else 0,
        )  # fmt: skip
        with pytest.raises(InvalidConfig, match=field):
            env.sync.scripts.run(deliver)
        assert env.sync.client.exists(env.sync.keys.scheduler_lease("t", 0)) == 0


# -- producer options --------------------------------------------------------------------------
INT_OPTIONS = [
    "min_replicas",
    "ack_timeout_ms",
    "window",
    "max_in_flight",
    "max_batch_messages",
    "max_buffered_messages",
    "max_message_bytes",
    "max_batch_bytes",
    "delivery_timeout_ms",
]


@ONE_BACKEND
@pytest.mark.parametrize("value", [16.5, 16.0, True])
def test_integer_producer_options_refuse_floats_and_bools(env: Env, value: object) -> None:
    env.sync.create_topic("t")
    for name in INT_OPTIONS:
        options: dict[str, Any] = {name: value}
        if name == "max_in_flight":
            options["window"] = 32
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            env.sync.producer(**options)

    @aio
    async def through_asyncio() -> None:
        async with env.connect() as broker:
            for name in INT_OPTIONS:
                with pytest.raises(TypeError, match=f"{name} must be an int"):
                    broker.producer(**{name: value})

    through_asyncio()
    assert length(env.sync, "t") == 0


# -- the idempotent handler ---------------------------------------------------------------------
@ONE_BACKEND
@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"processing_ttl_ms": 1500.5}, TypeError),
        ({"done_ttl_ms": 5000.0}, TypeError),
        ({"done_ttl_ms": True}, TypeError),
        ({"done_ttl_ms": MAX_TOPIC_SETTING + 1}, InvalidConfig),
        ({"processing_ttl_ms": 2**70}, InvalidConfig),
        ({"processing_ttl_ms": 99}, InvalidConfig),
    ],
)
def test_idempotent_handler_checks_its_ttls(
    broker: redisq.Broker, options: dict[str, Any], error: type[Exception]
) -> None:
    broker.create_topic("t")
    consumer = broker.consumer("t", "g")
    try:
        with pytest.raises(error, match=next(iter(options))):
            consumer.idempotent(lambda message: None, **options)
    finally:
        consumer.close()
    assert length(broker, "t") == 0


# -- message ids count -----------------------------------------------------------------------------
def test_a_message_id_counts_against_max_message_bytes(env: Env) -> None:
    env.sync.create_topic("t")
    big_id = b"i" * 10  # with the 6-byte value: 16 bytes, 17 with the key
    with env.sync.producer(idempotence="message_id", max_message_bytes=15) as producer:
        for key in ("k", None):  # the keyed fast path and the general one
            with pytest.raises(MessageTooLarge):
                producer.send("t", b"values", key=key, message_id=big_id)
            with pytest.raises(MessageTooLarge):
                producer.send_async("t", b"values", key=key, message_id=big_id)
        assert producer.send("t", b"v", key="k", message_id=big_id).offset is not None

    @aio
    async def through_asyncio() -> None:
        async with env.connect() as broker:
            async with broker.producer(idempotence="message_id", max_message_bytes=15) as p:
                await p.send("t", b"v", key="k", message_id=b"other")  # the topic is loaded
                for key in ("k", None):
                    with pytest.raises(MessageTooLarge):
                        await p.send("t", b"values", key=key, message_id=big_id)
                    with pytest.raises(MessageTooLarge):
                        p.send_async("t", b"values", key=key, message_id=big_id)

    through_asyncio()
    assert length(env.sync, "t") == 2


def test_a_message_id_fills_the_batch() -> None:
    """Batch byte accounting counts the id: given, or generated in message_id mode."""
    config = TopicConfig(name="t", partitions=1)
    encoder = MessageEncoder(ProducerSettings(idempotence="message_id"))
    for key in (b"k", None):
        _, _, _, size = encoder.encode_fast(config, b"value", key, None, b"i" * 10, None)
        assert size == len(key or b"") + 5 + 10
        _, layout, _, generated = encoder.encode_fast(config, b"value", key, None, None, None)
        assert "m" in layout and generated > len(key or b"") + 5


# -- Broker.read -----------------------------------------------------------------------------------
BAD_READS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"batch": 0}, InvalidConfig, "batch=0"),
    ({"batch": 1.5}, TypeError, "batch must be an int"),
    ({"count": "5"}, TypeError, "count must be an int"),
    ({"count": -1}, InvalidConfig, "count=-1"),
    ({"start": "abc"}, InvalidConfig, "start='abc'"),
    ({"start": "1-2-3"}, InvalidConfig, "start="),
    ({"end": "(0-0"}, InvalidConfig, "end="),
    ({"start": f"({(1 << 64) - 1}-{(1 << 64) - 1}"}, InvalidConfig, "start="),
    ({"end": "x"}, InvalidConfig, "end='x'"),
    ({"start": 5}, TypeError, "start must be a stream ID str"),
    ({"on_malformed": "skip"}, InvalidConfig, "on_malformed="),
]


def test_read_checks_its_arguments(env: Env) -> None:
    env.sync.create_topic("t")
    with env.sync.producer() as producer:
        sent = [producer.send("t", b"m%d" % i, key="k") for i in range(3)]
    for options, error, match in BAD_READS:
        with pytest.raises(error, match=match):
            list(env.sync.read("t", 0, **options))
    good = [
        ({"start": sent[1].offset}, 2),
        ({"start": "(" + sent[1].offset}, 1),
        ({"end": sent[1].offset}, 2),
        ({"start": sent[0].offset.split("-")[0]}, 3),
        ({"start": "(0-0", "end": "+", "count": 0}, 0),
        ({"count": 2, "batch": 1}, 2),
    ]
    for options, expected in good:
        assert len(list(env.sync.read("t", 0, **options))) == expected, options

    @aio
    async def through_asyncio() -> None:
        async with env.connect() as broker:
            for options, error, match in BAD_READS:
                with pytest.raises(error, match=match):
                    [m async for m in broker.read("t", 0, **options)]
            for options, expected in good:
                assert len([m async for m in broker.read("t", 0, **options)]) == expected

    through_asyncio()
    assert length(env.sync, "t") == 3


# -- ack -------------------------------------------------------------------------------------------
def _poll(poll: Callable[[], list[Message]], deadline_s: float = 15.0) -> list[Message]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        messages = poll()
        if messages:
            return messages
    raise AssertionError("nothing polled")


def test_ack_refuses_what_is_not_a_message_and_skips_what_was_not_given(env: Env) -> None:
    """ack() of a Message this consumer never gave out (from broker.read) counts 0 and never
    moves the position over it: the caller that does not ack it gets it again."""
    broker = env.sync
    broker.create_topic("t")
    with broker.producer() as producer:
        for i in range(4):
            producer.send("t", b"m%d" % i, partition=0)
    read = list(broker.read("t", 0))
    manual = {**FAST, "enable_auto_commit": False}  # only what ack() is given is acked
    with broker.consumer("t", "g", **manual) as consumer:
        for bad in ("abc", 5, [read[0], "x"], b"raw"):
            with pytest.raises(TypeError, match="ack takes Messages"):
                consumer.ack(bad)  # type: ignore[arg-type]
        first = _poll(lambda: consumer.poll(timeout=0.2, max_messages=2))
        assert [m.value for m in first] == [b"m0", b"m1"]
        assert consumer.ack(read[3]) == 0  # never given
        assert consumer.ack(first) == 2
        assert consumer.ack(first) == 0  # acked already
        second = _poll(lambda: consumer.poll(timeout=0.2))
        assert [m.value for m in second] == [b"m2", b"m3"]
        assert consumer.ack(second[0]) == 1  # m3 not acked: close() commits up to m2

    @aio
    async def through_asyncio() -> None:
        async with env.connect() as aio_broker:
            async with aio_broker.consumer("t", "g", **manual) as consumer:
                for bad in ("abc", 5, [read[0], "x"]):
                    with pytest.raises(TypeError, match="ack takes Messages"):
                        await consumer.ack(bad)  # type: ignore[arg-type]
                deadline = time.monotonic() + 15
                got: list[Message] = []
                while not got and time.monotonic() < deadline:
                    got = await consumer.poll(timeout=0.2, max_messages=1)
                assert [m.value for m in got] == [b"m3"]  # handed again: it was not acked
                assert await consumer.ack(read[0]) == 0  # never given (and committed before)
                assert await consumer.ack(got) == 1
                await consumer.commit()
                assert await consumer.committed(0) == read[3].offset

    through_asyncio()
    assert length(broker, "t") == 4


# -- send_async on the first send to a topic (asyncio) ------------------------------------------
def test_the_encoder_checks_partition_and_timestamp_without_the_topic() -> None:
    """MessageEncoder.check, what send_async runs before the topic's metadata is in."""
    encoder = MessageEncoder(ProducerSettings())
    encoder.check(b"v", None, None, None, 3, 1_000)
    with pytest.raises(TypeError, match="partition must be an int"):
        encoder.check(b"v", None, None, None, "0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="partition must be an int"):
        encoder.check(b"v", None, None, None, True)
    with pytest.raises(TypeError, match="timestamp_ms must be an int"):
        encoder.check(b"v", None, None, None, None, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timestamp_ms=-1"):
        encoder.check(b"v", None, None, None, None, -1)


@aio
async def test_delayed_send_async_checks_the_partition_type_at_once(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        async with broker.producer() as producer:  # the first send: no metadata yet
            with pytest.raises(TypeError, match="partition must be an int"):
                producer.send_async("t", b"v", partition="0", delay_ms=1000)  # type: ignore[arg-type]
    assert env.sync.describe_topic("t").total_scheduled == 0


@aio
async def test_first_send_async_raises_bad_input_at_once(env: Env) -> None:
    """What is refused without the topic's metadata is refused by the first send_async() too,
    as the sync producer does, and nothing is written."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=2)
        for options, error in [
            ({"partition": "0"}, TypeError),
            ({"timestamp_ms": 1.5}, TypeError),
            ({"timestamp_ms": -1}, ValueError),
            ({"topic": "no such/name"}, redisq.InvalidName),
        ]:
            async with broker.producer() as producer:  # a fresh one: the topic is not loaded
                topic = options.pop("topic", "t")
                with pytest.raises(error):
                    producer.send_async(topic, b"v", **options)
    assert length(env.sync, "t") == 0


@ONE_BACKEND
@pytest.mark.parametrize("headers", [[], (), [("a", "b")], "a=b"], ids=repr)
def test_headers_that_are_not_a_mapping_are_refused(broker: redisq.Broker, headers: Any) -> None:
    """An empty list is a mistake as much as a full one: TypeError, nothing written; {} is no
    headers."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        with pytest.raises(TypeError, match="headers must be a mapping"):
            producer.send("t", b"v", headers=headers)
        producer.send("t", b"v", headers={})
    [stored] = list(broker.read("t", 0))
    assert stored.headers == {}
