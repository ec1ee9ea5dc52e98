"""Delayed-message scripts (DESIGN §12): store a partition's delayed messages, deliver the due
ones exactly once as the holder of the partition's scheduler lease."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redisq.model.keys import KeySpace
from redisq.protocol import ScriptCall, text
from redisq.protocol.produce import ProducerIdentity


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to make, on the send path
class Scheduled:
    """One delayed message: its schedule id (sender identity + counter, zero-padded, or its
    message id: ids of equal due time sort in send order), when, and the message."""

    schedule_id: bytes
    delay_ms: int | None
    deliver_at_ms: int | None
    producer_id: int
    layout: str
    body: bytes  # the message's RESP-encoded arguments

    def payload(self) -> bytes:
        return b"%d\n%s\n%s" % (self.producer_id, self.layout.encode(), self.body)


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    """schedule.lua's answer: per message "0" (scheduled now), "1" (already scheduled) or "2"
    (already delivered), and its due time in ms (None when already delivered)."""

    flags: str
    due_ms: tuple[int | None, ...]


def _schedule_reply(reply: Any) -> ScheduleResult:
    dues = tuple(None if int(due) < 0 else int(due) for due in reply[1:])
    return ScheduleResult(text(reply[0]), dues)


def schedule(
    keys: KeySpace,
    topic: str,
    partition: int,
    messages: list[Scheduled],
    *,
    identity: ProducerIdentity,
    fenced: bool,
    retry_horizon_ms: int,
    nonce: str,
    given_up: Sequence[str] = (),
) -> ScriptCall[ScheduleResult]:
    """schedule.lua: store delayed messages (acknowledged now, once per schedule id).
    retry_horizon_ms: how long after this call the sender may still re-send one of them;
    fenced: refused (ProducerFenced) once a newer epoch of the identity is stored there;
    nonce: the batch's, in every copy of it; given_up: nonces of the sender's batches to this
    partition it gave up on, refused from now on (marked before this batch is stored)."""
    epoch = identity.epoch if fenced else ""
    # A named sender must find its epoch on the partition (UNKNOWN_PRODUCER: prove it first).
    named = "1" if fenced and identity.named else ""
    args: list[Any] = [len(messages), retry_horizon_ms, epoch, named, nonce, len(given_up)]
    args += given_up
    for m in messages:
        args += [
            m.schedule_id,
            "" if m.delay_ms is None else m.delay_ms,
            "" if m.deliver_at_ms is None else m.deliver_at_ms,
            m.payload(),
        ]
    return ScriptCall(
        "schedule",
        (
            keys.log(topic, partition),
            keys.scheduled(topic, partition),
            keys.scheduled_messages(topic, partition),
            keys.scheduled_delivered(topic, partition),
            keys.producer_state(topic, partition, identity.producer_id),
            keys.schedule_abandoned(topic, partition),
        ),
        args,
        _schedule_reply,
        topic,
    )


@dataclass(frozen=True, slots=True)
class Delivered:
    """deliver_due.lua's answer: messages appended, the next due time (None: nothing
    scheduled) and the server's clock, all in ms."""

    count: int
    next_due_ms: int | None
    server_ms: int


def _delivered(reply: Any) -> Delivered:
    count, next_due, now = int(reply[0]), int(reply[1]), int(reply[2])
    return Delivered(count, None if next_due < 0 else next_due, now)


def deliver_due(
    keys: KeySpace,
    topic: str,
    partition: int,
    lease_token: str,
    *,
    limit: int,
    retention_messages: int,
    retention_ms: int,
    lease_ttl_ms: int,
    counted: bool = False,
) -> ScriptCall[Delivered]:
    """deliver_due.lua: take or renew the partition's scheduler lease for lease_ttl_ms and
    append what is due, exactly once (LeaseLost: another scheduler holds it). lease_ttl_ms=0
    hands the lease back and delivers nothing. counted: a topic of batch entries, whose
    partition counters (DESIGN §14.6) count the delivered messages."""
    return ScriptCall(
        "deliver_due",
        (
            keys.log(topic, partition),
            keys.scheduled(topic, partition),
            keys.scheduled_messages(topic, partition),
            keys.scheduled_delivered(topic, partition),
            keys.scheduler_lease(topic, partition),
            *((keys.counts(topic, partition),) if counted else ()),
        ),
        (lease_token, limit, retention_messages, retention_ms, lease_ttl_ms),
        _delivered,
        topic,
    )
