"""The producer's I/O-free core (redisq.produce.accumulator.ProducerCore) without a server:
batches sealed by count, bytes and linger with their sequence numbers, what pick_work() sends and
in which order (max_in_flight, a refused batch and the ones after it, a lost connection), what a
refusal decides (retry, fence, fail, fatal), the delivery timeout (what fails, what is kept and
re-sequenced under the new epoch, which partitions must be fenced first), and the buffer count
that send_async's back-pressure reads. Time is passed in, so nothing here waits; the broker's
answers are the objects the driver (redisq.produce.encoder.Round.settle) hands the core."""

from __future__ import annotations

import redis

from redisq.errors import (
    DeliveryTimeout,
    InvalidConfig,
    OutOfOrderSequence,
    PartitionGone,
    ProducerFenced,
    RedisqError,
    TopicNotFound,
    UnknownProducer,
)
from redisq.model.offsets import MAX_STREAM_ID_PART
from redisq.model.topic import TopicConfig
from redisq.produce.accumulator import Batch, CoreSettings, ProducerCore
from redisq.protocol.produce import BatchResult
from redisq.protocol.rounds import DeadlineReached

ORDERS = TopicConfig("orders", 4)
P0, P1 = ("orders", 0), ("orders", 1)
LINGER_S = 0.005
TIMEOUT_S = 10.0


class Core:
    """A ProducerCore with the callbacks a driver gives it, recorded."""

    def __init__(
        self,
        mode: str | None = "sequence",
        *,
        batch_messages: int = 3,
        batch_bytes: int = 1000,
        in_flight: int = 2,
    ) -> None:
        self.finished: list[Batch] = []
        self.sealed: list[Batch] = []
        settings = CoreSettings(mode, batch_messages, batch_bytes, in_flight, LINGER_S, TIMEOUT_S)
        self.core = ProducerCore(settings, self.finished.append, self.sealed.append)

    def send(
        self,
        count: int = 1,
        partition: int = 0,
        now: float = 0.0,
        *,
        size: int = 10,
        layout: str = "v",
        config: TopicConfig = ORDERS,
    ) -> list[Batch]:
        """Queue `count` messages; the batches they went into, in order, once each."""
        batches: list[Batch] = []
        for _ in range(count):
            batch, _, _ = self.core.append(config, partition, layout, [b"x" * size], size, now)
            if not batches or batches[-1] is not batch:
                batches.append(batch)
        return batches

    def sealed_now(self, now: float = 1.0) -> list[Batch]:
        """Everything queued, sealed (as a flush does)."""
        self.core.flush_requested = True
        self.core.seal_due(now)
        self.core.flush_requested = False
        return self.sealed


def ack(core: ProducerCore, batch: Batch, first_id: str = "1-0", duplicate: bool = False) -> None:
    core.complete(batch, BatchResult(first_id, duplicate))


def seqs(batches: list[Batch]) -> list[tuple[int, int]]:
    return [(b.base_seq, b.span) for b in batches]


# -- batching and sequencing ---------------------------------------------------------------------
def test_sealed_batches_number_their_messages_consecutively_per_partition() -> None:
    c = Core(batch_messages=3)
    c.send(7, partition=0)
    c.send(2, partition=1)
    sealed = c.sealed_now()
    p0 = [b for b in sealed if b.partition == 0]
    p1 = [b for b in sealed if b.partition == 1]
    assert seqs(p0) == [(0, 3), (3, 3), (6, 1)]
    assert seqs(p1) == [(0, 2)]  # each partition counts from 0
    assert all(b.sealed for b in sealed)


def test_message_id_and_plain_modes_number_batches_not_messages() -> None:
    for mode in ("message_id", None):
        c = Core(mode, batch_messages=3)
        c.send(7)
        assert seqs(c.sealed_now()) == [(0, 1), (1, 1), (2, 1)]


def test_a_batch_is_sealed_the_moment_it_holds_max_batch_messages() -> None:
    c = Core(batch_messages=3)
    [first] = c.send(3)
    assert c.sealed == [first] and first.count == 3
    assert c.core.pick_work() == [first]  # goes without waiting for the linger


def test_a_message_that_would_pass_max_batch_bytes_opens_a_new_batch() -> None:
    c = Core(batch_messages=100, batch_bytes=30)
    batches = c.send(4, size=10)
    assert [b.count for b in batches] == [3, 1]  # 30 bytes fit exactly; the 4th does not
    assert c.sealed == batches[:1]
    [alone] = c.send(1, partition=1, size=500)  # larger than the limit: a batch of its own
    assert alone.count == 1 and alone.nbytes == 500


def test_another_layout_or_new_topic_metadata_seals_the_open_batch() -> None:
    c = Core(batch_messages=100)
    [plain] = c.send(2, layout="v")
    [keyed] = c.send(1, layout="kv")
    assert plain is not keyed and c.sealed == [plain]
    reread = TopicConfig("orders", 4)  # the metadata read again: its batches keep their own
    [after] = c.send(1, layout="kv", config=reread)
    assert after is not keyed and c.sealed == [plain, keyed] and after.config is reread


def test_append_reports_the_index_and_when_a_new_batch_starts_its_linger() -> None:
    c = Core(batch_messages=2)
    answers = [c.core.append(ORDERS, 0, "v", [b"x"], 1, 0.0)[1:] for _ in range(3)]
    assert answers == [(0, True), (1, False), (0, True)]


def test_linger_seals_each_batch_once_its_own_time_is_up_and_names_the_next_deadline() -> None:
    c = Core(batch_messages=100)
    c.send(1, partition=0, now=0.0)
    c.send(1, partition=1, now=0.003)
    assert c.core.seal_due(0.004) == 0.0 + LINGER_S  # nothing due yet
    assert c.sealed == [] and c.core.pick_work() == []
    assert c.core.seal_due(LINGER_S) == 0.003 + LINGER_S
    assert [b.partition for b in c.sealed] == [0]
    assert c.core.seal_due(0.003 + LINGER_S) is None
    assert [b.partition for b in c.sealed] == [0, 1]


def test_flush_and_close_seal_open_batches_before_their_linger() -> None:
    for flag in ("flush_requested", "closing"):
        c = Core(batch_messages=100)
        c.send(2, partition=0)
        c.send(1, partition=1)
        setattr(c.core, flag, True)
        assert c.core.seal_due(0.0) is None
        assert len(c.sealed) == 2


def test_send_seals_its_own_batch_only() -> None:
    c = Core(batch_messages=100)
    [mine] = c.send(1, partition=0)
    c.send(1, partition=1)
    c.core.seal_batch(mine)
    assert c.sealed == [mine]
    c.core.seal_batch(mine)  # sealed already: nothing changes
    assert c.sealed == [mine] and mine.base_seq == 0


# -- in flight -----------------------------------------------------------------------------------
def test_pick_work_sends_each_partitions_batches_in_order_up_to_max_in_flight() -> None:
    c = Core(batch_messages=1, in_flight=2)
    a, b, d = c.send(3, partition=0)
    [other] = c.send(1, partition=1)
    assert c.core.pick_work() == [a, b, other]
    assert all(x.in_flight and x.attempts == 1 for x in (a, b, other))
    assert c.core.pick_work() == []  # two on the wire already
    ack(c.core, a)
    assert c.core.pick_work() == [d]
    assert c.core.stats.retries == 0


def test_without_idempotence_one_batch_is_in_flight_per_partition() -> None:
    c = Core(None, batch_messages=1, in_flight=5)
    a, b = c.send(2)
    assert c.core.pick_work() == [a]  # no gap detection: a later batch could overtake
    ack(c.core, a)
    assert c.core.pick_work() == [b]


def test_acknowledged_batches_finish_with_their_offsets_in_order() -> None:
    c = Core(batch_messages=2)
    [batch] = c.send(2)
    c.core.pick_work()
    ack(c.core, batch, first_id="7-3")
    assert c.finished == [batch] and batch.finished and batch.error is None
    assert [m.offset for m in batch.metadata_all()] == ["7-3", "7-4"]
    assert batch.metadata(1).offset == "7-4" and not batch.metadata(1).duplicate
    assert c.core.stats.acknowledged == 2 and c.core.stats.sent == 2


# -- retries -------------------------------------------------------------------------------------
def test_a_retriable_refusal_sends_the_very_same_batch_again() -> None:
    c = Core(batch_messages=2)
    [batch] = c.send(2)
    assert c.core.pick_work() == [batch]
    for reply in ("BUSY script running", "LOADING", "READONLY", "TRYAGAIN", "NOREPLICAS x"):
        c.core.refused(batch, redis.ResponseError(reply))
        assert c.core.pick_work() == [batch], reply
        assert (batch.base_seq, batch.span, batch.count) == (0, 2, 2)  # its sequences kept
    assert batch.attempts == 6 and c.core.stats.retries == 5
    assert not batch.finished and not c.core.needs_new_identity


def test_a_refused_batch_waits_for_those_in_flight_behind_it_then_all_go_in_order() -> None:
    c = Core(batch_messages=1, in_flight=3)
    a, b, d = c.send(3)
    assert c.core.pick_work() == [a, b, d]
    c.core.refused(a, redis.ResponseError("BUSY"))
    assert c.core.pick_work() == []  # b, d are on the wire: they will come back OUT_OF_ORDER
    c.core.refused(b, OutOfOrderSequence(0))
    assert c.core.pick_work() == []
    c.core.refused(d, OutOfOrderSequence(0))
    assert c.core.pick_work() == [a, b, d]  # resent in sequence order, sequences unchanged
    assert seqs([a, b, d]) == [(0, 1), (1, 1), (2, 1)]
    assert not any(x.finished for x in (a, b, d))


def test_a_redirected_batch_goes_again() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1)
    c.core.pick_work()
    c.core.redirected(a)
    assert c.core.pick_work() == [a] and a.attempts == 2


def test_noscript_asks_for_the_scripts_to_be_loaded_and_sends_again() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1)
    c.core.pick_work()
    c.core.refused(a, redis.ResponseError("NOSCRIPT No matching script"))
    assert c.core.reload_scripts
    assert c.core.pick_work() == [a]


def test_a_retry_answered_as_a_duplicate_finishes_with_the_original_offsets() -> None:
    c = Core(batch_messages=2)
    [batch] = c.send(2)
    c.core.pick_work()
    c.core.connection_lost([batch], redis.ConnectionError("reset"))
    assert c.core.pick_work() == [batch]
    ack(c.core, batch, first_id="4-0", duplicate=True)
    assert [(m.offset, m.duplicate) for m in batch.metadata_all()] == [
        ("4-0", True),
        ("4-1", True),
    ]
    assert c.core.stats.duplicates == 2 and c.core.stats.acknowledged == 2


def test_an_old_duplicate_has_no_offsets() -> None:
    c = Core(batch_messages=2)
    [batch] = c.send(2)
    c.core.pick_work()
    ack(c.core, batch, first_id=None, duplicate=True)  # type: ignore[arg-type]
    assert [(m.offset, m.duplicate) for m in batch.metadata_all()] == [(None, True)] * 2


def test_message_id_answers_say_per_message_which_were_written_before() -> None:
    c = Core("message_id", batch_messages=4)
    [batch] = c.send(4)
    c.core.pick_work()
    c.core.complete(batch, BatchResult("9-0", False, "0110", ("2-0", "3-5")))
    assert [(m.offset, m.duplicate) for m in batch.metadata_all()] == [
        ("9-0", False),
        ("2-0", True),
        ("3-5", True),
        ("9-1", False),  # appended ones are consecutive from first_id
    ]
    assert c.core.stats.duplicates == 2


def test_offsets_carry_into_the_milliseconds_past_the_largest_sequence() -> None:
    c = Core(batch_messages=3)
    [batch] = c.send(3)
    c.core.pick_work()
    ack(c.core, batch, first_id=f"5-{MAX_STREAM_ID_PART - 1}")
    assert [m.offset for m in batch.metadata_all()] == [
        f"5-{MAX_STREAM_ID_PART - 1}",
        f"5-{MAX_STREAM_ID_PART}",
        "6-0",
    ]


def test_after_a_lost_connection_one_batch_goes_at_a_time_until_one_is_acknowledged() -> None:
    c = Core(batch_messages=1, in_flight=3)
    a, b, d = c.send(3)
    [other] = c.send(1, partition=1)
    c.core.pick_work()
    c.core.connection_lost([a, b, d, other], redis.ConnectionError("reset"))
    assert a.unknown and b.unknown and d.unknown and not a.in_flight
    assert c.core.pick_work() == [a, other]  # each partition: its first batch only
    ack(c.core, a)
    assert c.core.pick_work() == [b, d]  # an answer came: max_in_flight again
    assert (b.attempts, d.attempts) == (2, 2)


def test_unknown_producer_holds_the_partition_back_until_it_is_fenced() -> None:
    c = Core(batch_messages=1)
    a, b = c.send(2, partition=0)
    [other] = c.send(1, partition=1)
    c.core.pick_work()
    c.core.refused(a, UnknownProducer("no epoch"))
    c.core.refused(b, UnknownProducer("no epoch"))
    assert c.core.fences_needed == {P0}
    [late] = c.send(1, partition=1)
    ack(c.core, other)
    assert c.core.pick_work() == [late]  # the other partition goes on
    c.core.partition_fenced(P0)
    assert c.core.pick_work() == [a, b]  # the same batches, the same sequences
    assert seqs([a, b]) == [(0, 1), (1, 1)] and not a.finished


def test_fenced_by_a_newer_instance_everything_fails_and_nothing_more_is_sent() -> None:
    c = Core(batch_messages=2)
    a, b = c.send(3)  # a sealed and sent, b still open
    c.core.pick_work()
    error = ProducerFenced("epoch 3 < 4")
    c.core.refused(a, error)
    assert c.core.fatal is error
    assert c.finished == [a, b] and a.error is error and b.error is error
    assert c.core.buffered == 0 and c.core.stats.fenced == 3 and c.core.stats.failed == 3
    c.core.flush_requested = True
    c.core.seal_due(1.0)
    assert c.core.pick_work() == []


def test_a_deleted_topic_fails_the_partitions_tail_as_gone_and_hands_its_sequences_out_again() -> (
    None
):
    c = Core(batch_messages=1, in_flight=2)
    a, b, d = c.send(3, partition=0)
    [other] = c.send(1, partition=1)
    assert c.core.pick_work() == [a, b, other]
    ack(c.core, a)
    c.core.connection_lost([b], redis.ConnectionError("reset"))  # b may have been written
    assert c.core.pick_work() == [b]  # one at a time after a lost reply: d waits
    c.core.refused(b, TopicNotFound("orders"))
    assert set(c.finished) == {a, b, d}
    assert type(d.error) is PartitionGone  # never written: send() may route it again
    assert type(b.error) is TopicNotFound  # its earlier write may have landed: not "gone"
    assert not other.finished  # the other partition has its own answer coming
    [again] = c.send(1, partition=0)
    c.sealed_now()
    assert again.base_seq == 1  # after a, the last acknowledged
    assert not c.core.needs_new_identity


def test_invalid_config_fails_the_partitions_tail_with_that_error() -> None:
    c = Core(batch_messages=1)
    a, b = c.send(2)
    c.core.pick_work()
    error = InvalidConfig("partition out of range")
    c.core.refused(a, error)
    assert a.error is error and b.error is error and c.core.buffered == 0


def test_an_unexpected_error_fails_what_may_have_been_written_and_takes_a_new_epoch() -> None:
    c = Core(batch_messages=1, in_flight=1)
    a, b = c.send(2)
    c.core.pick_work()
    c.core.refused(a, redis.ResponseError("ERR something odd"))
    assert a.finished and isinstance(a.error, RedisqError) and "something odd" in str(a.error)
    assert not b.finished and b.base_seq == 0  # never sent: kept, numbered anew
    assert c.core.needs_new_identity and c.core.abandoned == {P0}
    assert c.core.pick_work() == []
    c.core.identity_renewed()
    assert c.core.pick_work() == [b] and b.attempts == 1


def test_an_answer_to_a_batch_that_failed_meanwhile_changes_nothing() -> None:
    c = Core(batch_messages=1, in_flight=2)
    a, b = c.send(2)
    c.core.pick_work()
    c.core.connection_lost([a, b], redis.ConnectionError("reset"))
    c.core.expire(TIMEOUT_S)
    assert a.finished and b.finished and isinstance(a.error, DeliveryTimeout)
    ack(c.core, a, first_id="3-0")  # a late reply of the failed batch
    c.core.refused(b, OutOfOrderSequence(0))
    assert a.error is not None and a.first_id is None and c.core.stats.acknowledged == 0
    c.core.identity_renewed()
    [d] = c.send(1)
    c.sealed_now()
    assert d.base_seq == 0 and c.core.acked_next(d) == 0  # the new epoch counts from 0


# -- delivery timeout ----------------------------------------------------------------------------
def test_the_oldest_unacknowledged_batch_sets_the_delivery_deadline() -> None:
    c = Core(batch_messages=1)
    assert c.core.oldest_deadline() is None
    c.send(1, partition=1, now=3.0)
    c.send(1, partition=0, now=2.0)
    c.send(1, partition=0, now=4.0)
    assert c.core.oldest_deadline() == 2.0 + TIMEOUT_S
    assert not c.core.expire(2.0 + TIMEOUT_S - 0.001)
    assert c.finished == []


def test_past_the_delivery_timeout_unknown_outcomes_fail_and_never_sent_batches_are_kept() -> None:
    c = Core(batch_messages=1, in_flight=1)
    a, b = c.send(2, partition=0, now=0.0)
    [waiting] = c.send(1, partition=0, now=5.0)
    [refused] = c.send(1, partition=1, now=1.0)
    [late] = c.send(1, partition=2, now=6.0)
    assert c.core.pick_work() == [a, refused, late]
    c.core.refused(refused, redis.ResponseError("BUSY"))  # not stored: may go again
    c.core.connection_lost([a], redis.ConnectionError("reset"))
    assert c.core.expire(TIMEOUT_S)
    # a: written, no answer. late: on the wire now. b: past its own timeout, never sent.
    assert set(c.finished) == {a, b, late}
    assert all(isinstance(x.error, DeliveryTimeout) for x in (a, b, late))
    assert "ConnectionError" in str(a.error)  # names why it was not acknowledged
    assert not waiting.finished and not refused.finished
    assert (waiting.base_seq, refused.base_seq) == (0, 0)  # numbered anew for the new epoch
    assert c.core.needs_new_identity
    assert c.core.abandoned == {P0, ("orders", 2)}  # where a failed batch went on the wire
    assert c.core.buffered == 2 and c.core.stats.failed == 3


def test_nothing_is_sent_until_the_new_epoch_is_taken() -> None:
    c = Core(batch_messages=1)
    a, b = c.send(2, partition=0, now=0.0)
    [kept] = c.send(1, partition=1, now=9.0)
    c.core.pick_work()
    c.core.connection_lost([a, b, kept], redis.ConnectionError("reset"))
    c.core.pick_work()  # a, and kept: one per partition after the lost connection
    c.core.expire(TIMEOUT_S)
    assert a.finished and b.finished and kept.finished  # all three on the wire or unknown
    [fresh] = c.send(1, partition=0, now=10.0)
    c.sealed_now(11.0)
    assert c.core.pick_work() == []
    c.core.identity_renewed()
    assert not c.core.needs_new_identity and c.core.abandoned == set()
    assert c.core.pick_work() == [fresh] and fresh.base_seq == 0


def test_a_batch_that_never_went_on_the_wire_fails_at_its_timeout_without_a_fence() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1, now=0.0)
    assert c.core.expire(TIMEOUT_S)
    assert isinstance(a.error, DeliveryTimeout) and c.core.abandoned == set()


def test_sends_made_while_the_epoch_is_pending_fail_at_their_own_timeout() -> None:
    c = Core(batch_messages=100)
    [a] = c.send(1, now=0.0)
    c.sealed_now(0.0)
    c.core.pick_work()
    c.core.refused(a, redis.ResponseError("ERR odd"))
    assert c.core.needs_new_identity
    [waiting] = c.send(1, now=1.0)  # the server is silent: the new epoch cannot be taken
    c.core.identity_failed(redis.ConnectionError("down"), network=True)
    assert c.core.fatal is None and not waiting.finished
    c.core.expire_waiting(1.0 + LINGER_S)  # sealed at its linger, not yet due
    assert not waiting.finished and c.core.oldest_deadline() == 1.0 + TIMEOUT_S
    c.core.expire_waiting(1.0 + TIMEOUT_S)
    assert isinstance(waiting.error, DeliveryTimeout) and "down" in str(waiting.error)


def test_a_fenced_identity_renewal_fails_everything() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1)
    error = ProducerFenced("newer instance")
    c.core.identity_failed(error, network=False)
    assert c.core.fatal is error and a.error is error


def test_the_delivery_timeout_names_the_errors_since_the_last_success_only() -> None:
    c = Core(batch_messages=1, in_flight=1)
    a, b = c.send(2, now=0.0)
    c.core.pick_work()
    c.core.refused(a, redis.ResponseError("BUSY lua"))
    c.core.pick_work()
    ack(c.core, a)
    c.core.pick_work()
    assert c.core.expire(TIMEOUT_S)
    assert "last error" not in str(b.error)  # the BUSY came before a success


def test_a_read_past_the_deadline_keeps_the_error_that_came_before_it() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1)
    c.core.pick_work()
    c.core.refused(a, redis.ResponseError("NOREPLICAS Not enough good replicas"))
    c.core.pick_work()
    c.core.connection_lost([a], DeadlineReached("no reply by the deadline"))
    c.core.expire(TIMEOUT_S)
    assert "NOREPLICAS" in str(a.error)


def test_a_write_not_confirmed_durable_goes_again_and_is_abandoned_at_the_timeout() -> None:
    c = Core(batch_messages=1)
    [a] = c.send(1)
    c.core.pick_work()
    c.core.not_durable(a, RedisqError("WAIT: 0 of 1 replicas"))
    a.unknown = True  # as Round.settle marks it: stored on the primary, maybe not a replica
    assert c.core.pick_work() == [a]
    c.core.connection_lost([a], redis.ConnectionError("reset"))
    c.core.expire(TIMEOUT_S)
    assert isinstance(a.error, DeliveryTimeout) and c.core.abandoned == {P0}


# -- the buffer ----------------------------------------------------------------------------------
def test_the_buffer_counts_each_message_from_append_until_its_batch_finishes() -> None:
    c = Core(batch_messages=3)
    a, b = c.send(5)
    assert c.core.buffered == 5  # send_async blocks at max_buffered_messages
    c.core.pick_work()
    ack(c.core, a)
    assert c.core.buffered == 2
    c.sealed_now()
    c.core.pick_work()
    c.core.refused(b, redis.ResponseError("ERR odd"))  # failed: its room is given back too
    assert c.core.buffered == 0 and c.core.stats.failed == 2 and c.core.stats.acknowledged == 3
    c.core.refused(b, redis.ResponseError("ERR odd"))  # answered again: counted once
    assert c.core.buffered == 0 and c.core.stats.failed == 2
