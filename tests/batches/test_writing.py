"""The writers' guarantees on topics of batch entries (DESIGN §14.3, §14.13), every backend, both
APIs: one stream entry per producer batch in every idempotence mode, at the offsets the futures
answered; message_id dedup across and inside batches (the entry is repacked without the
duplicates, at consecutive offsets, headers and timestamps kept); a batch whose answer was lost
is not written twice when the producer retries it (a proxy runs the call and drops the reply);
an older epoch of a named producer is fenced; the largest batches stay under managed servers'
argument limit; retention by count keeps about retention_messages messages in whole batches."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from redis.crc import key_slot

import redisq
from redisq.protocol import produce as protocol
from tests.apis import open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess

MODES = ["sequence", "message_id", None]
LONG_LINGER = 30_000  # batches are sealed by size or flush(), never by the clock
PER_BATCH = 10


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def id_of(offset: str) -> tuple[int, int]:
    ms, seq = offset.split("-")
    return int(ms), int(seq)


def offset_of(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def entries(broker: redisq.Broker, topic: str, partition: int) -> list[tuple[str, dict[str, Any]]]:
    """The partition's raw stream entries: (ID, {field: value})."""
    raw = broker.client.xrange(broker.keys.log(topic, partition))
    return [(text(i), {text(k): v for k, v in fields.items()}) for i, fields in raw]


def spans(broker: redisq.Broker, topic: str, partition: int) -> list[list[str]]:
    """The offsets each batch entry of the partition covers (ms-s .. ms-(s+n-1))."""
    out = []
    for entry_id, fields in entries(broker, topic, partition):
        assert "b" in fields, f"{entry_id} is not a batch entry: {sorted(fields)}"
        ms, seq = id_of(entry_id)
        out.append([offset_of(ms, seq + i) for i in range(int(fields["n"]))])
    return out


def last_generated(broker: redisq.Broker, topic: str, partition: int) -> str:
    return text(broker.client.xinfo_stream(broker.keys.log(topic, partition))["last-generated-id"])


def mid(mode: str | None, name: str) -> dict[str, str]:
    return {"message_id": name} if mode == "message_id" else {}


@dataclass
class Sent:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    message_id: bytes | None
    timestamp_ms: int | None
    meta: Any = None


# -- 1. one entry per batch, in every mode --------------------------------------------------------


def test_a_topic_created_without_a_format_holds_batch_entries(
    api: Any, broker: redisq.Broker
) -> None:
    """The default format of a new topic (DESIGN §14.13): one entry per producer batch."""
    config = api.broker.create_topic("t", 2)
    assert config.entry_format == "batch"
    assert broker.topic_config("t", refresh=True).entry_format == "batch"
    with api.broker.producer(linger_ms=LONG_LINGER) as producer:
        futures = [producer.send_async("t", b"v%d" % i, partition=1) for i in range(PER_BATCH)]
        producer.flush()
    assert broker.client.xlen(broker.keys.log("t", 1)) == 1
    stored = list(broker.read("t", 1))
    assert [m.value for m in stored] == [b"v%d" % i for i in range(PER_BATCH)]
    assert [m.offset for m in stored] == [api.result(f).offset for f in futures]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_writes_one_entry_per_batch_at_the_answered_offsets(
    api: Any, broker: redisq.Broker, mode: str | None
) -> None:
    """120 keyed messages with headers over 3 partitions, batches of 10: each partition holds
    ceil(its messages / 10) entries whose spans are exactly the offsets the futures answered;
    reading gives every message once, in offset order, as sent; each key in send order; the
    stream's last ID is the last offset (XSETID), so nothing can be written inside a span."""
    count, keys = 120, 7
    broker.create_topic("t", 3, entry_format="batch")
    sent: list[Sent] = []
    futures = []
    with api.broker.producer(
        idempotence=mode, linger_ms=LONG_LINGER, max_batch_messages=PER_BATCH
    ) as producer:
        for i in range(count):
            s = Sent(
                b"k%d" % (i % keys),
                b"v%d" % i,
                {"h": b"x%d" % i, "i": b"%d" % i},
                (b"id-%d" % i) if mode == "message_id" else None,
                None,
            )
            sent.append(s)
            futures.append(
                producer.send_async(
                    "t", s.value, key=s.key, headers=s.headers, **mid(mode, f"id-{i}")
                )
            )
        producer.flush()
        for s, future in zip(sent, futures, strict=True):
            s.meta = api.result(future)
    assert not any(s.meta.duplicate for s in sent)
    by_offset = {(s.meta.partition, s.meta.offset): s for s in sent}
    assert len(by_offset) == count, "two messages were answered the same offset"

    read_back: list[redisq.Message] = []
    for p in range(3):
        answered = sorted((s.meta.offset for s in sent if s.meta.partition == p), key=id_of)
        raw = entries(broker, "t", p)
        assert len(raw) == math.ceil(len(answered) / PER_BATCH), "not one entry per batch"
        covered = [o for span in spans(broker, "t", p) for o in span]
        assert covered == answered
        for _, fields in raw:
            assert ("s" in fields) == (mode == "sequence"), sorted(fields)
            if mode is not None:
                assert "p" in fields
        if answered:
            assert last_generated(broker, "t", p) == answered[-1]
        messages = list(api.broker.read("t", p))
        assert [m.offset for m in messages] == answered
        read_back += messages
    for m in read_back:
        s = by_offset[(m.partition, m.offset)]
        assert (m.key, m.value, m.headers, m.message_id) == (
            s.key,
            s.value,
            s.headers,
            s.message_id,
        )
    # Per key, the messages are stored in send order (a key stays on its partition).
    order: dict[bytes | None, list[int]] = defaultdict(list)
    for m in read_back:
        order[m.key].append(int(m.value[1:]))
    assert sum(map(len, order.values())) == count
    for key, values in order.items():
        assert values == sorted(values), f"key {key!r} out of order"


# -- 2. message_id dedup on batch entries --------------------------------------------------------


@pytest.fixture(params=["full", "bare"])
def shape(request: pytest.FixtureRequest) -> str:
    """full: keys, headers and producer timestamps (every column of the blob); bare: values and
    message ids only."""
    return str(request.param)


def message(shape: str, value: str, message_id: str, n: int) -> Sent:
    if shape == "bare":
        return Sent(None, value.encode(), {}, message_id.encode(), None)
    return Sent(
        b"key-%d" % (n % 3),
        value.encode(),
        {"n": b"%d" % n, "tag": b"t" * (n % 4 + 1)},
        message_id.encode(),
        1_700_000_000_000 + n * 1_001,
    )


def send_batch(api: Any, producer: Any, batch: list[Sent]) -> None:
    """One batch (flush() seals it), each message's answer in its meta."""
    futures = []
    for s in batch:
        extra: dict[str, Any] = {}
        if s.key is not None:
            extra["key"] = s.key
        if s.headers:
            extra["headers"] = s.headers
        if s.timestamp_ms is not None:
            extra["timestamp_ms"] = s.timestamp_ms
        futures.append(producer.send_async("t", s.value, message_id=s.message_id, **extra))
    producer.flush()
    for s, future in zip(batch, futures, strict=True):
        s.meta = api.result(future)


def as_stored(m: redisq.Message) -> tuple[Any, ...]:
    return (m.offset, m.key, m.value, m.headers, m.message_id)


def expected(s: Sent) -> tuple[Any, ...]:
    return (s.meta.offset, s.key, s.value, s.headers, s.message_id)


def test_message_id_duplicates_are_answered_and_left_out_of_the_repacked_entry(
    api: Any, broker: redisq.Broker, shape: str
) -> None:
    broker.create_topic("t", 1, entry_format="batch")
    first = [message(shape, f"first-{i}", f"a{i}", i) for i in range(8)]
    mixed = [
        message(shape, "again-a2", "a2", 20),
        message(shape, "new-0", "n0", 21),
        message(shape, "again-a5", "a5", 22),
        message(shape, "new-1", "n1", 23),
        message(shape, "new-1-repeated", "n1", 24),  # an id twice in one batch
        message(shape, "new-2", "n2", 25),
        message(shape, "again-a7", "a7", 26),
    ]
    replay = [message(shape, "again-a0", "a0", 30), message(shape, "again-n2", "n2", 31)]
    with api.broker.producer(
        idempotence="message_id", linger_ms=LONG_LINGER, max_batch_messages=100
    ) as producer:
        send_batch(api, producer, first)
        send_batch(api, producer, mixed)
        send_batch(api, producer, replay)

    # The first batch: one entry, the blob as sent, consecutive offsets from the entry's ID.
    raw = entries(broker, "t", 0)
    assert not any(s.meta.duplicate for s in first)
    ms, seq = id_of(raw[0][0])
    assert [s.meta.offset for s in first] == [offset_of(ms, seq + i) for i in range(8)]

    # The mixed batch: the ids stored before answer the offset they were first written at, the
    # repeated id the offset of its first copy in this batch; the new ones are one entry of 3.
    dup = [s.meta.duplicate for s in mixed]
    assert dup == [True, False, True, False, True, False, True]
    assert mixed[0].meta.offset == first[2].meta.offset
    assert mixed[2].meta.offset == first[5].meta.offset
    assert mixed[6].meta.offset == first[7].meta.offset
    assert mixed[4].meta.offset == mixed[3].meta.offset
    new = [mixed[1], mixed[3], mixed[5]]
    assert len(raw) == 2, f"{len(raw)} entries: the all-duplicate batch wrote one"
    entry_id, fields = raw[1]
    assert int(fields["n"]) == 3
    ms, seq = id_of(entry_id)
    assert [s.meta.offset for s in new] == [offset_of(ms, seq + i) for i in range(3)]
    assert id_of(entry_id) > id_of(first[-1].meta.offset)
    assert last_generated(broker, "t", 0) == new[-1].meta.offset

    # A batch of ids all stored before: every one a duplicate at its first offset, no entry.
    assert [s.meta.duplicate for s in replay] == [True, True]
    assert [s.meta.offset for s in replay] == [first[0].meta.offset, new[2].meta.offset]

    # Read back: the stored messages exactly as sent (keys, headers, producer timestamps, ids).
    stored = list(api.broker.read("t", 0))
    assert [as_stored(m) for m in stored] == [expected(s) for s in first + new]
    if shape == "full":
        assert [m.timestamp_ms for m in stored] == [s.timestamp_ms for s in first + new]
    assert [m.producer_id for m in stored] == [stored[0].producer_id] * len(stored)


def test_message_id_dedup_spans_partitions_and_many_batches(
    api: Any, broker: redisq.Broker
) -> None:
    """Every id sent twice, the second time in other batches and mixed with new ids, over 3
    partitions: each id stored once, at the offset both of its answers give."""
    broker.create_topic("t", 3, entry_format="batch")
    with api.broker.producer(
        idempotence="message_id", linger_ms=LONG_LINGER, max_batch_messages=7
    ) as producer:
        rounds: list[list[tuple[str, str, Any]]] = []
        for r, ids in enumerate([range(0, 60), range(30, 90)]):
            futures = [
                (
                    f"id-{i}",
                    f"r{r}-{i}",
                    producer.send_async("t", f"r{r}-{i}", key=f"k{i % 5}", message_id=f"id-{i}"),
                )
                for i in ids
            ]
            producer.flush()
            rounds.append([(i, v, api.result(f)) for i, v, f in futures])
    answered: dict[str, list[Any]] = defaultdict(list)
    for batch in rounds:
        for message_id, _, meta in batch:
            answered[message_id].append(meta)
    for message_id, metas in answered.items():
        assert len({(m.partition, m.offset) for m in metas}) == 1, message_id
        assert [m.duplicate for m in metas] == [False] + [True] * (len(metas) - 1)
    stored = {}
    for p in range(3):
        for m in api.broker.read("t", p):
            assert text(m.message_id) not in stored, f"{m.message_id!r} stored twice"
            stored[text(m.message_id)] = m
        covered = [o for span in spans(broker, "t", p) for o in span]
        assert covered == [m.offset for m in stored.values() if m.partition == p]
    assert sorted(stored) == sorted(answered)
    for message_id, metas in answered.items():
        m = stored[message_id]
        assert (m.partition, m.offset) == (metas[0].partition, metas[0].offset)
        round_ = 0 if int(message_id[3:]) < 60 else 1
        assert m.value == f"r{round_}-{message_id[3:]}".encode()


# -- 3. a retried batch is written once; fencing -------------------------------------------------


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["sequence", "message_id"])
def test_a_batch_whose_answer_was_lost_is_not_written_twice(
    proxied: tuple[ServerProcess, Proxy], namespace: str, api_name: str, mode: str
) -> None:
    """The batch's script runs on the server, its answer is lost with the connection; the
    producer re-sends it: the batch is stored once, one entry, at the offsets the futures got."""
    server, proxy = proxied
    direct = redisq.connect(server.url, namespace=namespace)
    direct.create_topic("t", 1, entry_format="batch")
    api = open_api(api_name, proxy.url, namespace)
    producer = api.broker.producer(
        idempotence=mode, linger_ms=LONG_LINGER, max_batch_messages=5, retry_backoff_ms=10
    )
    try:
        warm = producer.send("t", b"warm", key="k", **mid(mode, "warm"))
        proxy.trap(b"PAYLOAD-ONCE")
        values = [b"PAYLOAD-ONCE-%d" % i for i in range(5)]
        futures = [  # five: the batch is sealed full and sent at once
            producer.send_async("t", v, key="k", headers={"i": b"%d" % i}, **mid(mode, f"m{i}"))
            for i, v in enumerate(values)
        ]
        wait_until(lambda: proxy.holds_for_server(b"PAYLOAD-ONCE"), 30, "the batch held")
        assert proxy.lose_answers(b"PAYLOAD-ONCE") >= 1  # it runs; its answer is lost
        assert proxy.wait_released(30)
        assert [m.value for m in direct.read("t", 0)] == [b"warm", *values]
        proxy.reset_all()  # the lost answer goes with its connection: the producer re-sends
        proxy.heal()
        metas = [api.result(f) for f in futures]
    finally:
        proxy.heal()
        producer.close(timeout=10)
        api.shutdown()
    try:
        stored = list(direct.read("t", 0))
        assert [m.value for m in stored] == [b"warm", *values], "the retry was written again"
        assert [m.offset for m in stored] == [warm.offset] + [m.offset for m in metas]
        assert [m.headers for m in stored[1:]] == [{"i": b"%d" % i} for i in range(5)]
        assert len(entries(direct, "t", 0)) == 2
        assert last_generated(direct, "t", 0) == metas[-1].offset
    finally:
        direct.close()


@pytest.mark.parametrize("mode", ["sequence", "message_id"])
def test_an_older_epoch_of_a_named_producer_is_fenced(
    api: Any, broker: redisq.Broker, mode: str
) -> None:
    broker.create_topic("t", 2, entry_format="batch")
    old = api.broker.producer(name="svc", idempotence=mode, linger_ms=0)
    try:
        before = old.send("t", b"before", key="k", **mid(mode, "b"))
        with api.broker.producer(name="svc", idempotence=mode, linger_ms=0) as new:
            new.send("t", b"new-1", key="k", **mid(mode, "n1"))
            with pytest.raises(redisq.ProducerFenced):
                old.send("t", b"zombie", key="k", **mid(mode, "z"))
            new.send("t", b"new-2", key="k", **mid(mode, "n2"))
    finally:
        try:
            old.close(timeout=5)
        except redisq.ProducerFenced:
            pass
    stored = list(broker.read("t", before.partition))
    assert [m.value for m in stored] == [b"before", b"new-1", b"new-2"]
    assert len(entries(broker, "t", before.partition)) == 3


def values_in(broker: redisq.Broker, partition: int) -> list[bytes]:
    return [m.value for m in broker.read("t", partition)]


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["sequence", "message_id"])
def test_a_late_copy_of_an_abandoned_batch_is_fenced_by_the_new_epoch(
    proxied: tuple[ServerProcess, Proxy], namespace: str, api_name: str, mode: str
) -> None:
    """An anonymous producer gives up on a batch (DeliveryTimeout) that the network still holds,
    and stores its new epoch on the partition; the held copy then reaches the server: the
    script refuses its older epoch, nothing of it is written (no registration to fall back on:
    the produce script's own fence)."""
    server, proxy = proxied
    direct = redisq.connect(server.url, namespace=namespace)
    direct.create_topic("t", 2, entry_format="batch")
    api = open_api(api_name, proxy.url, namespace)
    producer = api.broker.producer(
        idempotence=mode, delivery_timeout_ms=1500, retry_backoff_ms=20, linger_ms=0
    )
    try:
        first = producer.send("t", b"before", key="k", **mid(mode, "before"))
        old_epoch = producer.epoch
        state = direct.keys.producer_state("t", first.partition, producer.producer_id)
        proxy.blackhole()
        abandoned = [
            producer.send_async("t", b"abandoned-%d" % i, key="k", **mid(mode, f"x{i}"))
            for i in range(3)
        ]
        wait_until(lambda: proxy.holds_for_server(b"abandoned"), 30, "the batch held")
        for future in abandoned:
            with pytest.raises(redisq.DeliveryTimeout):
                api.result(future)
        proxy.heal(keep=proxy.held_connections(b"abandoned"))
        wait_until(
            lambda: int(direct.client.hget(state, "epoch") or 0) > old_epoch,
            30,
            "the new epoch stored",
        )
        assert proxy.release_held() >= 1
        assert proxy.wait_released(30)
        assert values_in(direct, first.partition) == [b"before"]
        producer.send("t", b"after", key="k", **mid(mode, "after"))
        assert values_in(direct, first.partition) == [b"before", b"after"]
        assert len(entries(direct, "t", first.partition)) == 2
    finally:
        proxy.heal()
        producer.close(timeout=10)
        api.shutdown()
        direct.close()


# -- 4. managed servers' argument limit ----------------------------------------------------------

LIMIT = 3_999  # ElastiCache Serverless refuses a command of 4,000 arguments or more


@dataclass
class Built:
    call: Any
    count: int


@pytest.fixture
def built_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Built]]:
    """Every produce call the producers build (redisq.protocol.produce.produce), either API."""
    made: list[Built] = []
    real = protocol.produce

    def recording(*args: Any, **kwargs: Any) -> Any:
        call = real(*args, **kwargs)
        made.append(Built(call, args[4].count))
        return call

    monkeypatch.setattr(protocol, "produce", recording)
    yield made


@pytest.mark.parametrize("mode", MODES)
def test_the_largest_batches_are_calls_under_the_limit_with_every_key_declared(
    api: Any, broker: redisq.Broker, built_calls: list[Built], mode: str | None
) -> None:
    """4,500 messages with a key, headers (and an id) at max_batch_messages=10,000: every call
    has fewer than 3,999 arguments, declares the keys its script writes (one slot, so a Cluster
    takes it: the one-node Cluster refuses undeclared keys), the batches are as large as the
    limit lets them be, and everything is stored once, in order."""
    count = 4_500  # more than one call could carry as one argument each
    broker.create_topic("t", 1, entry_format="batch")
    with api.broker.producer(
        idempotence=mode,
        linger_ms=LONG_LINGER,
        max_batch_messages=10_000,
        max_batch_bytes=64 << 20,
    ) as producer:
        futures = [
            producer.send_async(
                "t", b"v%d" % i, key=b"k", headers={"h": b"x"}, **mid(mode, f"id-{i}")
            )
            for i in range(count)
        ]
        producer.flush()
        metas = [api.result(f) for f in futures]
    assert built_calls, "the producer built no call through redisq.protocol.produce"
    keys = broker.keys
    pid = producer.producer_id
    expected_keys = {
        "sequence": (
            "produce_sequence",
            (keys.log("t", 0), keys.producer_state("t", 0, pid), keys.counts("t", 0)),
        ),
        "message_id": (
            "produce_message_id",
            (
                keys.log("t", 0),
                keys.dedup_bucket("t", 0, 0),
                keys.dedup_bucket("t", 0, 1),
                keys.producer_state("t", 0, pid),
                keys.counts("t", 0),
            ),
        ),
        None: ("produce", (keys.log("t", 0), keys.counts("t", 0))),
    }[mode]
    for built in built_calls:
        call = built.call
        arguments = 3 + len(call.keys) + len(call.args) + call.body_count  # EVALSHA sha numkeys
        assert arguments < LIMIT, f"{arguments} arguments for a batch of {built.count}"
        assert (call.script, tuple(call.keys)) == expected_keys
        assert len({key_slot(k.encode()) for k in call.keys}) == 1
    per_message = 3 + (1 if mode == "sequence" else 0) + (1 if mode == "message_id" else 0)
    largest = max(b.count for b in built_calls)
    # As large as the limit lets them be (a batch topic's call holds one blob, not one argument
    # per key, value and header: only message_id mode's ids still count per message).
    assert largest >= protocol.messages_per_call(per_message)
    batches = {id(b.call.body): b.count for b in built_calls}  # a retry re-sends the same body
    assert sum(batches.values()) == count
    stored = list(api.broker.read("t", 0))
    assert [m.value for m in stored] == [b"v%d" % i for i in range(count)]
    assert [m.offset for m in stored] == [m.offset for m in metas]
    assert len(entries(broker, "t", 0)) == len(batches)


# -- 5. retention by count ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_retention_by_count_keeps_about_retention_messages_in_whole_batches(
    api: Any, broker: redisq.Broker, mode: str | None
) -> None:
    retention, count = 200, 2_000
    broker.create_topic("t", 1, entry_format="batch", retention_messages=retention)
    with api.broker.producer(
        idempotence=mode, linger_ms=LONG_LINGER, max_batch_messages=PER_BATCH
    ) as producer:
        for i in range(count):
            producer.send_async("t", b"v%d" % i, key=b"k", **mid(mode, f"id-{i}"))
        producer.flush()
    raw = entries(broker, "t", 0)
    assert all(int(fields["n"]) == PER_BATCH for _, fields in raw), "a batch was cut"
    kept = [m.value for m in api.broker.read("t", 0)]
    assert len(kept) >= retention - PER_BATCH, f"{len(kept)} kept of {retention}"
    # MAXLEN ~ trims whole stream nodes (at most 100 entries each): about retention, not all.
    assert len(kept) <= retention + 100 * PER_BATCH, f"{len(kept)} kept: not trimmed"
    assert kept == [b"v%d" % i for i in range(count - len(kept), count)]


# (batch size, messages) of the two phases: one 20-message batch after 400 single ones; 200
# single ones after eight 50-message batches (the moment the first stream node can go).
PHASES = {"smaller-first": ((1, 400), (20, 20)), "larger-first": ((50, 400), (1, 200))}


@pytest.mark.parametrize("phases", PHASES.values(), ids=PHASES.keys())
def test_retention_by_count_keeps_retention_messages_when_batch_sizes_change(
    api: Any, broker: redisq.Broker, phases: tuple[tuple[int, int], ...]
) -> None:
    """Retention by count trims whole entries by the partition's messages per entry (the
    counters of DESIGN §14.6, or the newest batch's size when smaller): batches of one size,
    then of another, still leave about retention_messages. Mutants: batch_maxlen dividing by the
    batch being written keeps 120 messages of 200 after the 20-message batch; dividing by the
    partition's average alone keeps 163 single messages after the large batches."""
    retention = 200
    broker.create_topic("t", 1, entry_format="batch", retention_messages=retention)
    sent = []
    for size, count in phases:
        with api.broker.producer(linger_ms=LONG_LINGER, max_batch_messages=size) as producer:
            for i in range(count):
                sent.append(b"%d-%d" % (size, i))
                producer.send_async("t", sent[-1], key=b"k")
            producer.flush()
    largest = max(size for size, _ in phases)
    kept = [m.value for m in api.broker.read("t", 0)]
    newest = phases[-1][0]  # whole entries: at most one of them short of retention
    assert len(kept) >= retention - newest, f"{len(kept)} messages kept of {retention}"
    # MAXLEN ~ trims whole stream nodes (up to 100 entries): about retention, not everything
    assert len(kept) <= retention + 100 * largest, f"{len(kept)} kept: not trimmed"
    assert kept == sent[len(sent) - len(kept) :]  # the newest, in order
    counts = broker.client.hgetall(broker.keys.counts("t", 0))
    assert int(counts[b"m"]) == len(sent)  # every message counted, trimmed or not
    assert api.broker.describe_topic("t").total_messages == len(kept)  # m - c(first entry)
    assert int(counts[b"e"]) == sum(count // size for size, count in phases)
