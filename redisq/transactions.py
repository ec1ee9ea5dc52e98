"""Transactions (DESIGN §11): the types both producers and their users share (what `local`
and `check` answer and receive, what a transaction returns) and the staging of a transaction's
messages into batches. The mechanism, as protocol operations, is in redisq.tx_ops."""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from redisq.msgid import encode_ulid
from redisq.protocol.group import Lease
from redisq.protocol.produce import BatchResult
from redisq.protocol.transactions import InputPosition, StagedBatch
from redisq.records import Message, RecordMetadata, decode_headers, offset_at


class TxConsumer(Protocol):
    """What tx.ack needs of a consumer (either driver): see dispatch.transaction_inputs."""

    def _transaction_inputs(
        self, messages: Message | Iterable[Message], tx_id: str
    ) -> list[tuple[Lease, InputPosition]]: ...

    def _transaction_ended(self, position: InputPosition, committed: bool) -> None: ...


class TxState(enum.StrEnum):
    """A local transaction's outcome, as `local` and `check` return it (RocketMQ's
    LocalTransactionState: COMMIT_MESSAGE, ROLLBACK_MESSAGE, UNKNOW)."""

    COMMIT = "commit"
    ROLLBACK = "rollback"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class TxMessage:
    """A message of a transaction, as `local` and `check` see it (not yet in a partition)."""

    topic: str
    partition: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    message_id: bytes | None = None


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """What became of a transaction: committed ones carry where each message landed."""

    transaction_id: str
    state: TxState
    records: tuple[RecordMetadata, ...] = ()


def new_transaction_id() -> str:
    """A ULID: unique without asking Redis, and sorted by time in listings."""
    now = time.time_ns() // 1_000_000
    return encode_ulid((now << 80) | secrets.randbits(80)).decode()


def messages_of(batches: Iterable[StagedBatch]) -> list[TxMessage]:
    result = []
    for batch in batches:
        for parts in batch.messages():
            result.append(
                TxMessage(
                    batch.topic,
                    batch.partition,
                    parts.get("k") or None,
                    parts["v"],
                    decode_headers(parts.get("h") or None),
                    parts.get("m") or None,
                )
            )
    return result


def records_of(
    batches: list[StagedBatch], results: list[BatchResult], order: list[tuple[str, int]]
) -> tuple[RecordMetadata, ...]:
    """Where each message landed, in send order (`order`: each message's partition)."""
    landed: dict[tuple[str, int], list[RecordMetadata]] = {}
    for batch, result in zip(batches, results, strict=True):
        into = landed.setdefault((batch.topic, batch.partition), [])
        for i in range(batch.count):
            offset = offset_at(result.first_id, i) if result.first_id else None
            into.append(RecordMetadata(batch.topic, batch.partition, offset, result.duplicate))
    cursor = dict.fromkeys(landed, 0)
    records = []
    for tp in order:
        records.append(landed[tp][cursor[tp]])
        cursor[tp] += 1
    return tuple(records)


class Staging:
    """A transaction's messages grouped into batches (I/O-free): per partition, consecutive
    messages of one layout share a batch of at most max_messages / max_bytes."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.staged: list[StagedBatch] = []  # written to the transaction's list, in order
        self.order: list[tuple[str, int]] = []  # each message's partition, in send order
        self._open: dict[tuple[str, int], tuple[str, list[bytes], int, int]] = {}

    @property
    def empty(self) -> bool:
        return not self.staged and not self._open

    def add(self, topic: str, partition: int, layout: str, parts: list[bytes], size: int) -> None:
        key = (topic, partition)
        self.order.append(key)
        current = self._open.get(key)
        if current is not None and (
            current[0] != layout
            or current[2] >= self.max_messages
            or current[3] + size > self.max_bytes
        ):
            self._seal(key)
            current = None
        if current is None:
            self._open[key] = (layout, list(parts), 1, size)
        else:
            current[1].extend(parts)
            self._open[key] = (layout, current[1], current[2] + 1, current[3] + size)

    def full(self) -> bool:
        return any(c[2] >= self.max_messages or c[3] >= self.max_bytes for c in self._open.values())

    def _seal(self, key: tuple[str, int]) -> None:
        layout, parts, count, _ = self._open.pop(key)
        self.staged.append(StagedBatch(key[0], key[1], layout, count, b"".join(parts)))

    def seal_all(self) -> None:
        for key in list(self._open):
            self._seal(key)


@dataclass(slots=True)
class Writer:
    """Who writes a transaction: the producer's id, name, epoch, and its transaction options."""

    producer_id: int
    name: str | None
    epoch: int
    timeout_ms: int
    group: str | None = None
    first_check_ms: int | None = None
    exclusive: bool = False  # Kafka style: the name's one open transaction
    # when an undecided transaction's keys expire: past its timeout (or its last check-back)
    # with an hour to spare for the sweeper
    expire_ms: int = 3_600_000
