"""Transaction and schedule scripts (DESIGN §11, §12): stage, decide, finish; input positions
carried by a transaction; delayed messages scheduled and delivered."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redisq.keys import KeySpace
from redisq.protocol import ScriptCall, text
from redisq.protocol.group import Lease

STATES = ("open", "committed", "aborted", "unresolved")


@dataclass(frozen=True, slots=True)
class StagedBatch:
    """One batch of a transaction: where it goes and its RESP-encoded messages."""

    topic: str
    partition: int
    layout: str
    count: int
    body: bytes  # the messages' arguments, RESP bulk strings (protocol.produce.encode_message)

    def serialize(self) -> bytes:
        head = f"{self.topic}\n{self.partition}\n{self.layout}\n{self.count}\n".encode()
        return head + self.body

    @classmethod
    def parse(cls, raw: bytes) -> StagedBatch:
        topic, partition, layout, count, body = raw.split(b"\n", 4)
        return cls(topic.decode(), int(partition), layout.decode(), int(count), body)


@dataclass(frozen=True, slots=True)
class InputPosition:
    """A consumer's position on an input partition, committed with a transaction."""

    group: str
    topic: str
    partition: int
    position: str
    entries_read: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "topic": self.topic,
            "partition": self.partition,
            "position": self.position,
            "entries_read": self.entries_read,
        }


def encode_positions(positions: list[InputPosition]) -> str:
    return json.dumps([p.as_json() for p in positions]) if positions else ""


def decode_positions(raw: Any) -> list[InputPosition]:
    if not raw:
        return []
    return [InputPosition(**item) for item in json.loads(text(raw))]


def register(
    keys: KeySpace,
    tx_id: str,
    *,
    name: str | None,
    epoch: int,
    timeout_ms: int,
    group: str | None,
    first_check_ms: int | None,
) -> ScriptCall[Any]:
    """tx_register.lua: the transaction in the registry (named: proves the epoch)."""
    return ScriptCall(
        "tx_register",
        (
            keys.named_producer(name) if name else keys.transactions(),
            keys.transactions(),
            keys.transaction_group(group) if group else keys.transactions(),
        ),
        (
            tx_id,
            epoch if name else "",
            timeout_ms,
            "" if first_check_ms is None else first_check_ms,
        ),
    )


def stage(
    keys: KeySpace,
    tx_id: str,
    *,
    producer: str,
    epoch: int,
    timeout_ms: int,
    group: str | None,
    batch: StagedBatch,
) -> ScriptCall[int]:
    """tx_stage.lua: one batch, where no consumer reads it."""
    return ScriptCall(
        "tx_stage",
        (keys.transaction(tx_id), keys.transaction_messages(tx_id)),
        (producer, epoch, timeout_ms, group or "", batch.serialize()),
        int,
    )


def decide(
    keys: KeySpace,
    tx_id: str,
    decision: str,
    *,
    epoch: int | None,
    positions: list[InputPosition] | None = None,
    check: bool = False,
) -> ScriptCall[str]:
    """tx_decide.lua: the final decision (epoch None: recovery, which may only finish what is
    open)."""
    return ScriptCall(
        "tx_decide",
        (keys.transaction(tx_id),),
        (
            decision,
            "" if epoch is None else epoch,
            encode_positions(positions or []),
            "1" if check else "0",
        ),
        text,
    )


def finish(keys: KeySpace, tx_id: str, *, name: str | None, group: str | None) -> ScriptCall[Any]:
    """tx_finish.lua: forget a carried-out transaction in the registry."""
    return ScriptCall(
        "tx_finish",
        (
            keys.named_producer(name) if name else keys.transactions(),
            keys.transactions(),
            keys.transaction_group(group) if group else keys.transactions(),
        ),
        (tx_id, "1" if name else "0"),
    )


def hold_input(keys: KeySpace, lease: Lease, tx_id: str) -> ScriptCall[Any]:
    """tx_hold.lua: the input partition waits for this transaction's position (LeaseLost if
    the lease moved: the transaction must abort)."""
    return ScriptCall(
        "tx_hold",
        (
            keys.lease(lease.topic, lease.partition, lease.group),
            keys.group_partition_state(lease.topic, lease.partition, lease.group),
        ),
        (lease.value, tx_id),
        topic=lease.topic,
    )


def apply_position(
    keys: KeySpace, tx_id: str, position: InputPosition, *, committed: bool
) -> ScriptCall[bool]:
    """tx_position.lua: apply a committed transaction's input position (or drop the mark of an
    aborted one), once."""
    return ScriptCall(
        "tx_position",
        (
            keys.log(position.topic, position.partition),
            keys.group_partition_state(position.topic, position.partition, position.group),
        ),
        (
            position.group,
            tx_id,
            position.position if committed else "",
            "" if position.entries_read is None or not committed else position.entries_read,
        ),
        lambda reply: bool(int(reply)),
        position.topic,
    )
