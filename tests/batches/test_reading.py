"""Batch entries read back (DESIGN §14.7), every backend, both APIs, both entry formats: an
orderly member that stops inside an entry (a commit after part of a batch, a seek into one, a
poll that takes part of one) is followed by a read that starts at the next message: nothing
handled twice, nothing skipped. Broker.read's bounds cut entries the same way."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest

import redisq
from tests.apis import poll_and_ack

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}
TOTAL = 100
PER_BATCH = 25


@pytest.fixture(params=["message", "batch"])
def entry_format(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def numbers(messages: list[Any]) -> list[int]:
    return [json.loads(m.value)["n"] for m in messages]


def filled(broker: redisq.Broker, entry_format: str, topic: str = "t") -> list[redisq.Message]:
    """TOTAL messages in batches of PER_BATCH on one partition; the stream holds TOTAL / PER_BATCH
    entries on a batch topic (else TOTAL): the format is the one asked for."""
    broker.create_topic(topic, 1, entry_format=entry_format)
    with broker.producer(linger_ms=1000, max_batch_messages=PER_BATCH) as producer:
        for n in range(TOTAL):
            producer.send_async(topic, json.dumps({"n": n}), key=f"k{n % 3}")
    entries = broker.client.xlen(broker.keys.log(topic, 0))
    assert entries == (TOTAL // PER_BATCH if entry_format == "batch" else TOTAL)
    written = list(broker.read(topic, 0))
    assert numbers(written) == list(range(TOTAL))
    return written


def test_a_commit_inside_an_entry_is_where_the_next_owner_starts(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    written = filled(broker, entry_format)
    first = api.broker.consumer("t", "g", **FAST)
    try:
        got = poll_and_ack(first, 7)
        first.commit()
        assert numbers(got) == list(range(7))
        assert first.committed(0) == written[6].offset
    finally:
        first.close()
    with api.broker.consumer("t", "g", **FAST) as heir:
        rest = poll_and_ack(heir, TOTAL - 7)
        assert numbers(rest) == list(range(7, TOTAL))
        assert heir.poll(timeout=0.5) == []


def test_poll_takes_part_of_an_entry_and_the_next_poll_the_rest(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    filled(broker, entry_format)
    with api.broker.consumer("t", "g", **FAST) as consumer:
        got: list[Any] = []
        while len(got) < TOTAL:
            polled = consumer.poll(timeout=5, max_messages=10)
            assert polled, f"poll() gave nothing after {len(got)} messages"
            assert len(polled) <= 10
            consumer.ack(polled)
            got += polled
        assert numbers(got) == list(range(TOTAL))
        assert consumer.poll(timeout=0.5) == []


def test_a_seek_into_an_entry_reads_from_that_message(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    written = filled(broker, entry_format)
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert numbers(poll_and_ack(consumer, TOTAL)) == list(range(TOTAL))
        consumer.seek(0, written[30].offset)
        assert numbers(poll_and_ack(consumer, TOTAL - 30)) == list(range(30, TOTAL))
        consumer.seek(0, written[99].offset)
        assert numbers(poll_and_ack(consumer, 1)) == [99]
        assert consumer.poll(timeout=0.5) == []


def test_run_resumes_inside_an_entry_after_a_handover(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    filled(broker, entry_format)
    handled: list[Any] = []
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert consumer.run(handled.append, max_messages=37) == 37
    assert numbers(handled) == list(range(37))
    with api.broker.consumer("t", "g", **FAST) as heir:
        assert heir.run(handled.append, max_messages=TOTAL - 37) == TOTAL - 37
    assert numbers(handled) == list(range(TOTAL))


def test_a_member_gets_what_was_sent_after_it_caught_up(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    """A caught-up member waits for entries (XREAD BLOCK) only at an entry's end."""
    filled(broker, entry_format)
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert numbers(poll_and_ack(consumer, 50)) == list(range(50))
        assert numbers(poll_and_ack(consumer, 50)) == list(range(50, TOTAL))
        with broker.producer(linger_ms=5) as producer:
            for n in range(TOTAL, TOTAL + 10):
                producer.send_async("t", json.dumps({"n": n}), key="k")
        assert numbers(poll_and_ack(consumer, 10)) == list(range(TOTAL, TOTAL + 10))


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        ("-", "+", range(TOTAL)),
        ("@30", "+", range(30, TOTAL)),
        ("(@30", "+", range(31, TOTAL)),
        ("-", "@60", range(61)),
        ("-", "(@60", range(60)),
        ("@30", "@30", range(30, 31)),
        ("@26", "@73", range(26, 74)),
    ],
)
def test_broker_read_cuts_entries_at_its_bounds(
    api: Any, broker: redisq.Broker, entry_format: str, start: str, end: str, expected: range
) -> None:
    written = filled(broker, entry_format)

    def bound(spec: str) -> str:
        if "@" not in spec:
            return spec
        return spec.split("@")[0] + written[int(spec.split("@")[1])].offset

    got = list(api.broker.read("t", 0, start=bound(start), end=bound(end), batch=2))
    assert numbers(got) == list(expected)
    three = api.broker.read("t", 0, start=bound(start), end=bound(end), count=3)
    assert numbers(three) == list(expected)[:3]


def test_a_foreign_entry_after_a_batch_gets_an_id_after_every_offset_of_it(
    broker: redisq.Broker,
) -> None:
    written = filled(broker, "batch")
    foreign = broker.client.xadd(broker.keys.log("t", 0), {"v": b"foreign"})
    foreign_id = foreign.decode() if isinstance(foreign, bytes) else foreign
    last = tuple(map(int, written[-1].offset.split("-")))
    assert tuple(map(int, foreign_id.split("-"))) > last
    values = [m.value for m in broker.read("t", 0)]
    assert values[-1] == b"foreign" and len(values) == TOTAL + 1


def test_run_reads_many_small_entries_in_one_read_without_a_failure(
    api: Any, broker: redisq.Broker, entry_format: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of more entries than two decode chunks (consume.chunks), each entry holding
    several messages: every message once, in order, and no worker failure logged (the chunks
    were once released by their messages' count, which broke the next chunk)."""
    broker.create_topic("many", 1, entry_format=entry_format)
    total = 1200
    with broker.producer(linger_ms=1000, max_batch_messages=4) as producer:
        for n in range(total):
            producer.send_async("many", json.dumps({"n": n}), key="k")
    handled: list[Any] = []
    with api.broker.consumer("many", "g", batch_size=1000, **FAST) as consumer:
        assert consumer.run(handled.append, max_messages=total) == total
    assert numbers(handled) == list(range(total))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_run_commits_as_it_goes_through_one_large_entry(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    """run() commits every ack_interval_ms while it works through a read, also when the read is
    one or two batch entries of 2,000 messages: a crash in the middle would redeliver what was
    handled since the last commit, not the whole entry (it used to commit only after it)."""
    broker.create_topic("t", 1, entry_format=entry_format)
    with broker.producer(linger_ms=30_000, max_batch_messages=2_000) as producer:
        for n in range(2_000):
            producer.send_async("t", b"%d" % n, partition=0)
    if entry_format == "batch":  # one or two entries (the producer's argument limit)
        assert broker.client.xlen(broker.keys.log("t", 0)) <= 2
    lags: list[int | None] = []

    def handle(message: redisq.Message) -> None:
        time.sleep(0.001)  # 1,500 messages take 1.5 s at least: 30 commit intervals
        if message.value == b"1500":
            lags.append(broker.describe_group("t", "g").total_lag)

    options = {**FAST, "ack_interval_ms": 50}
    with api.broker.consumer("t", "g", start="earliest", **options) as consumer:
        assert consumer.run(handle, max_messages=2_000) == 2_000
    assert lags and lags[0] is not None and lags[0] <= 1_000, lags


def test_reset_offsets_counts_messages_and_reads_a_batch_whole(
    api: Any, broker: redisq.Broker, entry_format: str
) -> None:
    """reset_offsets on either format: the lags it reports count messages, and a reset to an
    offset inside a batch entry reads that batch whole, from its first message (nothing of the
    batch lost, nothing before it read again); on message entries, from the offset itself."""
    written = filled(broker, entry_format)
    with api.broker.consumer("t", "g", **FAST) as consumer:
        assert len(poll_and_ack(consumer, TOTAL)) == TOTAL
        consumer.commit()
    dry = broker.reset_offsets("t", "g", to_earliest=True, dry_run=True)
    assert [(r.after, r.lag_before, r.lag_after) for r in dry] == [("0-0", 0, TOTAL)]
    target = written[PER_BATCH + 3]  # inside the second batch
    (moved,) = broker.reset_offsets("t", "g", to_offset=target.offset)
    first = PER_BATCH if entry_format == "batch" else PER_BATCH + 3
    assert moved.lag_after == TOTAL - first
    assert broker.describe_group("t", "g").total_lag == TOTAL - first
    with api.broker.consumer("t", "g", mode="orderly", **FAST) as consumer:
        again = poll_and_ack(consumer, TOTAL - first)
        assert numbers(again) == list(range(first, TOTAL))
        assert consumer.poll(timeout=0.5) == []
