"""What a transaction's users see (DESIGN §11): what `local` and `check` answer and receive,
and what a transaction returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from redisq.model.records import RecordMetadata


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
