"""Topic administration on real servers: create, describe, list, delete, and typed errors for bad
input that write nothing. Every test runs on each backend (valkey, valkey-cluster, redis)."""

from __future__ import annotations

from typing import Any

import pytest

import redisq
from tests.marks import ONE_BACKEND


def snapshot(broker: redisq.Broker) -> dict[bytes, Any]:
    """Every key of the broker's namespace with its type and content: equal snapshots mean
    nothing was written in between."""
    client = broker.client
    state: dict[bytes, Any] = {}
    for key in client.scan_iter(match=broker.keys.pattern(), count=1000):
        kind = client.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "stream":
            content: Any = client.xrange(key)
        elif kind == "hash":
            content = client.hgetall(key)
        elif kind == "set":
            content = sorted(client.smembers(key))
        elif kind == "string":
            content = client.get(key)
        else:
            content = None
        state[key] = (kind, content)
    return state


def partition_keys(broker: redisq.Broker, topic: str, partitions: int) -> list[bytes]:
    keys: list[bytes] = []
    for p in range(partitions):
        keys += broker.client.scan_iter(match=broker.keys.partition_pattern(topic, p), count=1000)
    return keys


# -- create / describe / list ------------------------------------------------------------------


def test_create_returns_config_and_describe_shows_empty_partitions(broker: redisq.Broker) -> None:
    config = broker.create_topic("orders", partitions=3)
    assert config.name == "orders"
    assert config.partitions == 3
    assert config.topic_id
    description = broker.describe_topic("orders")
    assert description.name == "orders"
    assert description.config.partitions == 3
    assert description.config.topic_id == config.topic_id
    assert [p.partition for p in description.partitions] == [0, 1, 2]
    for info in description.partitions:
        assert info.length == 0
        assert info.first_offset is None
        assert info.last_offset is None
    assert description.total_messages == 0
    assert broker.list_topics() == ["orders"]


def test_describe_reports_lengths_and_first_last_offsets(broker: redisq.Broker) -> None:
    broker.create_topic("events", partitions=2)
    sent: dict[int, list[str]] = {0: [], 1: []}
    with broker.producer() as producer:
        for i in range(7):
            meta = producer.send("events", f"v{i}", partition=i % 2)
            sent[meta.partition].append(meta.offset)
    description = broker.describe_topic("events")
    for info in description.partitions:
        offsets = sent[info.partition]
        assert info.length == len(offsets)
        assert info.first_offset == offsets[0]
        assert info.last_offset == offsets[-1]
        read = [m.offset for m in broker.read("events", info.partition)]
        assert read == offsets
    assert description.total_messages == 7


def test_list_topics_is_sorted_and_follows_create_and_delete(broker: redisq.Broker) -> None:
    assert broker.list_topics() == []
    for name in ("zeta", "alpha", "mid.dle", "under_score-1"):
        broker.create_topic(name)
    assert broker.list_topics() == ["alpha", "mid.dle", "under_score-1", "zeta"]
    broker.delete_topic("mid.dle")
    assert broker.list_topics() == ["alpha", "under_score-1", "zeta"]


def test_retention_and_dedup_settings_are_stored(broker: redisq.Broker) -> None:
    broker.create_topic("a", partitions=1, retention_ms=60_000, retention_messages=5_000)
    broker.create_topic("b", partitions=1, retention_ms=90_000, dedup_window_ms=7_000)
    broker.create_topic("c", partitions=1)
    a = broker.describe_topic("a").config
    assert (a.retention_ms, a.retention_messages) == (60_000, 5_000)
    assert a.dedup_window_ms == 60_000  # by default the retention age
    b = broker.describe_topic("b").config
    assert (b.retention_ms, b.retention_messages, b.dedup_window_ms) == (90_000, 0, 7_000)
    c = broker.describe_topic("c").config
    assert (c.retention_ms, c.retention_messages) == (0, 0)
    assert c.dedup_window_ms >= 1000


def test_create_existing_topic_raises_topic_exists_and_changes_nothing(
    broker: redisq.Broker,
) -> None:
    broker.create_topic("orders", partitions=2, retention_messages=100)
    before = snapshot(broker)
    with pytest.raises(redisq.TopicExists) as info:
        broker.create_topic("orders", partitions=5)
    assert info.value.topic == "orders"
    assert snapshot(broker) == before


def test_exist_ok_returns_the_existing_topic_unchanged(broker: redisq.Broker) -> None:
    first = broker.create_topic("orders", partitions=2, retention_messages=100)
    before = snapshot(broker)
    again = broker.create_topic("orders", partitions=8, retention_ms=5_000, exist_ok=True)
    assert again.partitions == 2
    assert again.retention_messages == 100
    assert again.retention_ms == 0
    assert again.topic_id == first.topic_id
    assert snapshot(broker) == before
    assert len(broker.describe_topic("orders").partitions) == 2


def test_longest_valid_name_is_accepted(broker: redisq.Broker) -> None:
    name = "A-z_0." + "x" * 194
    assert len(name) == 200
    broker.create_topic(name, partitions=2)
    assert broker.list_topics() == [name]
    with broker.producer() as producer:
        meta = producer.send(name, b"v", key="k")
    assert [m.value for m in broker.read(name, meta.partition)] == [b"v"]


# -- bad input: typed errors, nothing written ---------------------------------------------------

BAD_NAMES = ["", "has space", "colon:x", "{tag}", "star*", "x" * 201, "naïve", "new\nline", None, 7]


@ONE_BACKEND
@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_invalid_topic_name_raises_invalid_name_and_writes_nothing(
    broker: redisq.Broker, name: object
) -> None:
    broker.create_topic("good")
    before = snapshot(broker)
    with pytest.raises(redisq.InvalidName):
        broker.create_topic(name, partitions=2)  # type: ignore[arg-type]
    with pytest.raises(redisq.InvalidName):
        broker.describe_topic(name)  # type: ignore[arg-type]
    with pytest.raises(redisq.InvalidName):
        broker.delete_topic(name)  # type: ignore[arg-type]
    assert snapshot(broker) == before
    assert broker.list_topics() == ["good"]


@ONE_BACKEND
@pytest.mark.parametrize("partitions", ["4", 4.0, None, True, [1]], ids=repr)
def test_non_int_partitions_raise_type_error_and_write_nothing(
    broker: redisq.Broker, partitions: object
) -> None:
    before = snapshot(broker)
    with pytest.raises(TypeError):
        broker.create_topic("orders", partitions=partitions)  # type: ignore[arg-type]
    assert snapshot(broker) == before
    assert broker.list_topics() == []
    with pytest.raises(redisq.TopicNotFound):
        broker.describe_topic("orders")


@ONE_BACKEND
@pytest.mark.parametrize("partitions", [0, -1, 4097, 10**9])
def test_out_of_range_partitions_raise_invalid_config_and_write_nothing(
    broker: redisq.Broker, partitions: int
) -> None:
    before = snapshot(broker)
    with pytest.raises(redisq.InvalidConfig):
        broker.create_topic("orders", partitions=partitions)
    assert snapshot(broker) == before
    assert broker.list_topics() == []


@ONE_BACKEND
@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"retention_ms": -1}, redisq.InvalidConfig),
        ({"retention_messages": -5}, redisq.InvalidConfig),
        ({"retention_ms": "1000"}, TypeError),
        ({"retention_messages": 1.5}, TypeError),
        ({"dedup_window_ms": 10}, redisq.InvalidConfig),
        ({"dedup_window_ms": "x"}, TypeError),
        ({"producer_state_ttl_ms": 0}, redisq.InvalidConfig),
    ],
    ids=repr,
)
def test_bad_retention_arguments_raise_and_write_nothing(
    broker: redisq.Broker, options: dict[str, object], error: type[Exception]
) -> None:
    before = snapshot(broker)
    with pytest.raises(error):
        broker.create_topic("orders", partitions=2, **options)  # type: ignore[arg-type]
    assert snapshot(broker) == before
    assert broker.list_topics() == []


def test_missing_topic_raises_topic_not_found_and_writes_nothing(broker: redisq.Broker) -> None:
    broker.create_topic("other")
    with broker.producer(name="svc") as producer:
        before = snapshot(broker)
        with pytest.raises(redisq.TopicNotFound) as info:
            broker.describe_topic("missing")
        assert info.value.topic == "missing"
        with pytest.raises(redisq.TopicNotFound):
            broker.delete_topic("missing")
        with pytest.raises(redisq.TopicNotFound):
            producer.send("missing", b"v", key="k")
        with pytest.raises(redisq.TopicNotFound):
            producer.send_async("missing", b"v")
        with pytest.raises(redisq.TopicNotFound):
            list(broker.read("missing", 0))
        assert snapshot(broker) == before
    assert broker.list_topics() == ["other"]


@ONE_BACKEND
@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
@pytest.mark.parametrize("partition", [99, 2, -1])
def test_send_to_partition_out_of_range_writes_nothing(
    broker: redisq.Broker, idempotence: str | None, partition: int
) -> None:
    broker.create_topic("orders", partitions=2)
    with broker.producer(idempotence=idempotence) as producer:
        producer.send("orders", b"first", partition=0)
        before = snapshot(broker)
        with pytest.raises(redisq.PartitionOutOfRange) as info:
            producer.send("orders", b"v", partition=partition)
        assert info.value.partition == partition
        assert info.value.partitions == 2
        with pytest.raises(redisq.PartitionOutOfRange):
            producer.send_async("orders", b"v", key="k", partition=partition)
        with pytest.raises(TypeError):
            producer.send("orders", b"v", partition="1")  # type: ignore[arg-type]
        producer.flush()
        assert snapshot(broker) == before
    assert broker.describe_topic("orders").total_messages == 1


def test_read_partition_out_of_range(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    with pytest.raises(redisq.PartitionOutOfRange):
        list(broker.read("orders", 2))


# -- delete -------------------------------------------------------------------------------------


def test_delete_removes_every_partition_key_and_nothing_else(broker: redisq.Broker) -> None:
    broker.create_topic("doomed", partitions=3)
    broker.create_topic("kept", partitions=2)
    with broker.producer(name="seq") as seq, broker.producer(idempotence="message_id") as mid:
        for i in range(30):
            seq.send_async("doomed", f"s{i}", key=f"k{i}")
            mid.send_async("doomed", f"m{i}", key=f"k{i}")
            seq.send_async("kept", f"s{i}", key=f"k{i}")
        seq.flush()
        mid.flush()
    doomed_keys = partition_keys(broker, "doomed", 3)
    kinds = {key.decode().rsplit("}:", 1)[1].split(":")[0] for key in doomed_keys}
    assert {"log", "pid", "dedup"} <= kinds  # streams, producer state, dedup buckets
    kept_before = {k: v for k, v in snapshot(broker).items() if b"{kept:" in k}

    broker.delete_topic("doomed")

    assert partition_keys(broker, "doomed", 3) == []
    assert not any(b"{doomed:" in key or key.endswith(b":doomed") for key in snapshot(broker))
    assert broker.list_topics() == ["kept"]
    with pytest.raises(redisq.TopicNotFound):
        broker.describe_topic("doomed")
    kept_after = {k: v for k, v in snapshot(broker).items() if b"{kept:" in k}
    assert kept_after == kept_before
    assert broker.describe_topic("kept").total_messages == 30


@pytest.mark.parametrize("idempotence", ["sequence", "message_id", None])
def test_producer_with_cached_topic_gets_topic_not_found_after_delete(
    broker: redisq.Broker, idempotence: str | None
) -> None:
    broker.create_topic("orders", partitions=2)
    name = "svc" if idempotence == "sequence" else None
    with broker.producer(name=name, idempotence=idempotence) as producer:
        for i in range(10):
            producer.send("orders", f"before-{i}", key=f"k{i}")
        broker.delete_topic("orders")
        before = snapshot(broker)
        # The producer still has the topic cached: the broker refuses the batches.
        futures = [producer.send_async("orders", f"a{i}", key=f"k{i}") for i in range(6)]
        producer.flush()
        for future in futures:
            assert isinstance(future.exception(timeout=10), redisq.TopicNotFound)
            with pytest.raises(redisq.TopicNotFound):
                future.result(timeout=10)
        # Now the producer knows: a new send is refused at once.
        with pytest.raises(redisq.TopicNotFound):
            producer.send("orders", b"after", key="k1")
        with pytest.raises(redisq.TopicNotFound):
            producer.send_async("orders", b"again", key="k1")
        assert snapshot(broker) == before
        assert partition_keys(broker, "orders", 2) == []
        assert broker.list_topics() == []

        # The topic comes back under the same name: the same producer can write to it again.
        broker.create_topic("orders", partitions=2)
        meta = producer.send("orders", b"reborn", key="k1")
        assert not meta.duplicate
    assert [m.value for m in broker.read("orders", meta.partition)] == [b"reborn"]
    assert broker.describe_topic("orders").total_messages == 1
