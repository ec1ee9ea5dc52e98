"""Delayed-message scripts (DESIGN §12): store a partition's delayed messages, deliver the due
ones exactly once under the partition's scheduler lease."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redisq.keys import KeySpace
from redisq.protocol import ScriptCall, text


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One delayed message: its schedule id (sender identity + sequence, zero-padded: ids of
    equal due time sort in send order), when, and the message."""

    schedule_id: str
    delay_ms: int | None
    deliver_at_ms: int | None
    producer_id: int
    layout: str
    body: bytes  # the message's RESP-encoded arguments

    def payload(self) -> bytes:
        return b"%d\n%s\n%s" % (self.producer_id, self.layout.encode(), self.body)


def schedule(
    keys: KeySpace, topic: str, partition: int, messages: list[Scheduled]
) -> ScriptCall[str]:
    """schedule.lua: store delayed messages (acknowledged now, once per schedule id)."""
    args: list[Any] = [len(messages)]
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
        ),
        args,
        text,
        topic,
    )


def _delivered(reply: Any) -> tuple[int, int | None]:
    delivered, next_due = int(reply[0]), int(reply[1])
    return delivered, (None if next_due < 0 else next_due)


def deliver_due(
    keys: KeySpace,
    topic: str,
    partition: int,
    lease_value: str,
    *,
    limit: int,
    retention_messages: int,
    retention_ms: int,
) -> ScriptCall[tuple[int, int | None]]:
    """deliver_due.lua: append what is due, exactly once; (delivered, next due ms or None)."""
    return ScriptCall(
        "deliver_due",
        (
            keys.log(topic, partition),
            keys.scheduled(topic, partition),
            keys.scheduled_messages(topic, partition),
            keys.scheduler_lease(topic, partition),
        ),
        (lease_value, limit, retention_messages, retention_ms),
        _delivered,
        topic,
    )
