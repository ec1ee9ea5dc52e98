"""The I/O-free cores of delayed messages, without a server: the scheduler's timing and lease
decisions (redisq.schedule.scheduler.SchedulerCore) and the delayed sender's batches, retries and
timeouts (redisq.produce.delayed.DelayedCore). Time is passed in, so nothing here waits."""

from __future__ import annotations

import pytest
import redis

from redisq.errors import DeliveryTimeout, LeaseLost, NotEnoughReplicas, TopicNotFound
from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.produce.delayed import DelayedBatch, DelayedCore, ScheduleIds
from redisq.protocol.produce import ProducerIdentity, ack_barrier, ack_wait
from redisq.protocol.rounds import StepRound
from redisq.protocol.schedule import Delivered, Scheduled, ScheduleResult
from redisq.schedule.core import (
    ACQUIRE_INTERVAL_MS,
    DELIVER_LIMIT,
    LEASE_TTL_MS,
    MAX_BACKOFF_S,
    MIN_TICK_MS,
    TICK_MS,
    SchedulerCore,
)
from redisq.settings import ProducerSettings

KEYS = KeySpace("ns")


# -- the scheduler -------------------------------------------------------------------------------
def scheduler_with(partitions: int = 2) -> SchedulerCore:
    core = SchedulerCore(token="tok")
    core.add_topic("orders")
    core.config_read("orders", TopicConfig("orders", partitions, retention_ms=5000), now=0.0)
    return core


def test_every_partition_is_called_with_the_lease_token_and_ttl() -> None:
    core = scheduler_with(2)
    due = core.calls(KEYS, now=0.0)
    assert [key for key, _ in due] == [("orders", 0), ("orders", 1)]
    call = due[0][1]
    assert call.script == "deliver_due" and call.args[0] == "tok"
    assert call.args[-1] == LEASE_TTL_MS and call.args[3] == 5000  # lease ttl, retention_ms
    assert all(key.startswith("ns:{orders:0}:") for key in call.keys)  # one slot


def test_when_a_partition_is_called_again() -> None:
    core = scheduler_with(4)
    due = core.calls(KEYS, now=10.0)
    results = [
        Delivered(DELIVER_LIMIT, 1, 1000),  # a backlog: straight on
        Delivered(3, 1030, 1000),  # next due in 30 ms: then (+1 ms)
        Delivered(0, 1002, 1000),  # next due in 2 ms: not before MIN_TICK_MS
        Delivered(0, None, 1000),  # nothing scheduled: TICK_MS
    ]
    core.settle(due, results, now=10.0)
    assert [key for key, _ in core.calls(KEYS, now=10.0)] == [("orders", 0)]
    assert [key for key, _ in core.calls(KEYS, now=10.0 + MIN_TICK_MS / 1000)] == [
        ("orders", 0),
        ("orders", 2),
    ]
    assert [key for key, _ in core.calls(KEYS, now=10.031)] == [
        ("orders", 0),
        ("orders", 1),
        ("orders", 2),
    ]
    assert len(core.calls(KEYS, now=10.0 + TICK_MS / 1000)) == 4
    assert core.delivered == DELIVER_LIMIT + 3 and len(core.held()) == 4
    assert core.next_wakeup(10.0) == 0.0


def test_lease_held_elsewhere_missing_topic_and_failures() -> None:
    core = scheduler_with(3)
    due = core.calls(KEYS, now=0.0)
    core.settle(
        due, [LeaseLost("held"), TopicNotFound("orders"), redis.ConnectionError("x")], now=0.0
    )
    assert core.held() == []
    assert core.calls(KEYS, now=0.04) == []  # nothing before the first backoff
    assert [k for k, _ in core.calls(KEYS, now=0.05)] == [("orders", 2)]  # failed: 50 ms
    knock = ACQUIRE_INTERVAL_MS / 1000
    assert [k for k, _ in core.calls(KEYS, now=knock)] == [
        ("orders", 0),
        ("orders", 1),
        ("orders", 2),
    ]
    assert core.stale_topics(now=0.0) == ["orders"]  # TopicNotFound: read the metadata again
    core.config_read("orders", None, now=1.0)  # deleted: its partitions go
    assert core.calls(KEYS, now=2.0) == [] and core.release_calls(KEYS) == []


def test_round_failures_back_off_up_to_a_limit() -> None:
    core = scheduler_with(1)
    waits = []
    for _ in range(8):
        core.round_failed(now=0.0)
        waits.append(core.next_wakeup(0.0))
    assert waits[0] == pytest.approx(0.05)
    assert waits[-1] == pytest.approx(min(MAX_BACKOFF_S, TICK_MS / 1000))  # next_wakeup caps


def test_only_held_leases_are_handed_back_and_topics_follow_the_list() -> None:
    core = scheduler_with(2)
    due = core.calls(KEYS, now=0.0)
    core.settle(due, [Delivered(0, None, 1), LeaseLost("x")], now=0.0)
    [release] = core.release_calls(KEYS)
    assert release.args[-1] == 0 and release.keys[0] == KEYS.log("orders", 0)
    listing = SchedulerCore(all_topics=True)
    assert listing.list_due(0.0)
    listing.topics_listed(["a", "b"], now=0.0)
    listing.topics_listed(["b", "c"], now=1.0)
    assert listing.topics == ["b", "c"] and not listing.list_due(1.0)


# -- the delayed sender --------------------------------------------------------------------------
CONFIG = TopicConfig("orders", 2)
ID = ProducerIdentity(7, 1)


def message(ids: ScheduleIds) -> Scheduled:
    return Scheduled(ids.next_id(None), 100, None, 7, "v", b"$1\r\nx\r\n")


def sender(**options: object) -> tuple[DelayedCore, list[DelayedBatch]]:
    settings = ProducerSettings.from_options(
        {"linger_ms": 5, "max_batch_messages": 3, "delivery_timeout_ms": 1000, **options}
    )
    sealed: list[DelayedBatch] = []
    return DelayedCore(settings, sealed.append), sealed


def test_schedule_ids_sort_in_send_order() -> None:
    ids = ScheduleIds(ID)
    made = [ids.next_id(None) for _ in range(300)]
    assert sorted(made) == made and len(set(made)) == 300
    assert ids.next_id(b"order-1") == b"m:order-1"


def test_batches_fill_linger_and_go_one_at_a_time_per_partition() -> None:
    core, sealed = sender()
    ids = ScheduleIds(ID)
    for _ in range(4):
        core.append(CONFIG, 0, message(ids), now=0.0)
    core.append(CONFIG, 1, message(ids), now=0.0)
    [full] = core.pick(now=0.0)  # the full batch of partition 0; the rest lingers
    assert len(full.messages) == 3 and sealed == [full]
    assert core.pick(now=0.004) == []
    [other] = core.pick(now=0.006)  # partition 1 lingered; partition 0 has one on the wire
    assert other.partition == 1
    core.settle([full], [ScheduleResult("000", (1, 1, 1))], now=0.01)
    [rest] = core.pick(now=0.01)
    assert rest.partition == 0 and len(rest.messages) == 1
    assert core.finished == [full] and core.buffered == 2
    assert full.metadata(0).offset is None and full.metadata(0).deliver_at_ms == 1


def test_a_batch_without_an_answer_goes_again_unchanged_until_its_deadline() -> None:
    core, _ = sender(retry_backoff_ms=10)
    ids = ScheduleIds(ID)
    core.append(CONFIG, 0, message(ids), now=0.0)
    [batch] = core.pick(now=0.01)
    sent_ids = [m.schedule_id for m in batch.messages]
    core.steps(KEYS, [batch], ID)  # on the wire: from now on its outcome may be unknown
    core.settle([batch], [redis.ConnectionError("lost")], now=0.02)
    assert core.pick(now=0.02) == []  # backing off
    [again] = core.pick(now=0.04)
    assert again is batch and [m.schedule_id for m in again.messages] == sent_ids
    core.settle([again], [redis.ConnectionError("lost")], now=1.5)  # past the deadline
    assert isinstance(batch.error, DeliveryTimeout) and "may have been stored" in str(batch.error)
    assert core.buffered == 0


def test_refusals_and_replica_acks() -> None:
    core, _ = sender(
        acks="replicas", min_replicas=1, delivery_timeout_ms=10_000, retry_backoff_ms=100
    )
    ids = ScheduleIds(ID)
    core.append(CONFIG, 0, message(ids), now=0.0)
    core.append(CONFIG, 1, message(ids), now=0.0)
    batches = core.pick(now=0.01)
    steps = core.steps(KEYS, batches, ID)
    scripts = [getattr(s, "script", None) for s in steps]
    assert scripts == ["schedule", "schedule", "ack_barrier", "ack_barrier", None]
    assert steps[2].keys[0] == KEYS.log("orders", 0)  # a barrier in each batch's slot
    assert steps[4].nodes == "written"  # WAIT after each node's own barrier
    # WAIT answered 0 replicas: stored, maybe not on a replica: both go again.
    stored = [ScheduleResult("0", (1,)), ScheduleResult("0", (1,)), 1, 1]
    core.settle(batches, [*stored, {0: 0, 1: 0, 2: 0, 3: 0}], now=0.02)
    assert core.finished == [] and all(isinstance(b.last_error, NotEnoughReplicas) for b in batches)
    # Each batch is judged by the WAIT of its own barrier's node: only the first goes again.
    batches = core.pick(now=1.0 - 0.001)
    core.settle(batches, [*stored, {0: 0, 1: 1, 2: 0, 3: 1}], now=0.99)
    assert [b.partition for b in core.finished] == [1]
    assert isinstance(batches[0].last_error, NotEnoughReplicas)
    # No WAIT answer for its barrier, its barrier refused, or the round's connection failed:
    # never acknowledged.
    batches = core.pick(now=2.0)
    core.settle(batches, [stored[0], 1, {0: 1}], now=2.0)
    assert "no answer" in str(batches[0].last_error)
    batches = core.pick(now=3.0)
    moved = redis.ResponseError("TRYAGAIN")
    core.settle(batches, [stored[0], moved, {0: 1}], now=3.0)
    assert batches[0].last_error is moved
    batches = core.pick(now=5.0)
    lost = redis.ConnectionError("lost")
    core.settle(batches, [lost, lost, lost], now=5.0)
    assert batches[0].last_error is lost and core.finished[1:] == []
    core.append(CONFIG, 1, message(ids), now=5.0)
    batches = core.pick(now=7.0)
    assert [b.partition for b in batches] == [0, 1]
    replies = [TopicNotFound("orders"), ScheduleResult("1", (5,)), 1, 1, {2: 1, 3: 1}]
    core.settle(batches, replies, now=7.0)
    assert isinstance(batches[0].error, TopicNotFound)  # not retriable: ends the batch
    assert batches[1].metadata(0).duplicate
    never_sent, _ = sender()
    never_sent.append(CONFIG, 0, message(ids), now=0.0)
    never_sent.expire(now=2.0)
    [expired] = never_sent.finished
    assert "were not stored" in str(expired.error)


class TwoNodes:
    """A Router that puts partition 1's keys on node "b", every other key on "a"."""

    def node_for(self, key: str) -> str:
        return "b" if ":1}" in key else "a"

    def asking(self, key: str) -> bool:
        return False

    def forget_asking(self, key: str) -> None:
        pass

    def note_ask(self, key: str, node: str) -> None:
        pass


def test_a_written_command_goes_after_each_nodes_writes_and_answers_for_them() -> None:
    core, _ = sender(acks="replicas", min_replicas=1)
    ids = ScheduleIds(ID)
    for p in (0, 1, 2):
        core.append(CONFIG, p, message(ids), now=0.0)
    batches = core.pick(now=0.01)
    steps = core.steps(KEYS, batches, ID)
    round_ = StepRound(steps, lambda call: b"EVALSHA %d\n" % call.keys[0].count(":1}"), TwoNodes())
    # a: two schedules, two barriers, WAIT; b: one schedule, one barrier, WAIT
    assert round_.expected() == {"a": 5, "b": 3}
    assert round_.payloads["a"].endswith(b"$4\r\nWAIT\r\n$1\r\n1\r\n$4\r\n1000\r\n")
    assert round_.payloads["b"].endswith(b"$4\r\nWAIT\r\n$1\r\n1\r\n$4\r\n1000\r\n")
    refused = redis.ResponseError("ERR refused")
    results = round_.results({"a": [refused, refused, 1, 1, 0], "b": [refused, 1, 1]})
    # steps: 0-2 schedules, 3-5 barriers, 6 WAIT; each: the WAIT of its own node
    assert results[6] == {0: 0, 1: 1, 2: 0, 3: 0, 4: 1, 5: 0}


def test_a_second_written_command_goes_to_the_nodes_written_before_it() -> None:
    # Two confirmations in one round: the second follows the writes of every step before it, the
    # first WAIT (which has no node of its own) aside.
    first, second = [ack_barrier(KEYS.log("t", p)) for p in (0, 1)]
    wait = ack_wait("replicas", 1, 1000)
    round_ = StepRound(
        [first, wait, second, wait],
        lambda call: b"EVALSHA %d\n" % call.keys[0].count(":1}"),
        TwoNodes(),
    )
    assert round_.expected() == {"a": 3, "b": 2}  # a: barrier, WAIT, WAIT; b: barrier, WAIT
    results = round_.results({"a": [1, 1, 0], "b": [1, 1]})
    assert results[1] == {0: 1}
    assert results[3] == {0: 0, 2: 1}
