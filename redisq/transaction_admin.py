"""Looking at transactions: the open and undone ones in the registry, and sweeping now (the
`redisq transactions` command and the console use these operations)."""

from __future__ import annotations

from dataclasses import dataclass

from redisq.admin import server_ms
from redisq.keys import KeySpace
from redisq.protocol import Command, Operation, text
from redisq.protocol import transactions as tx
from redisq.tx_ops import sweep


@dataclass(frozen=True, slots=True)
class TransactionInfo:
    """A transaction in the registry: open, or decided and not yet carried out."""

    transaction_id: str
    state: str  # "open", "committed", "aborted", "unresolved", or "missing" (nothing staged)
    producer: str  # the producer's name, or its id
    group: str | None  # the transactional group (half messages)
    batches: int  # staged batches
    age_ms: int
    deadline_ms: int | None  # open: when the sweeper aborts it (None: check-back decides)
    checks: int  # check-backs answered UNKNOWN so far


def list_transactions(keys: KeySpace, limit: int = 1000) -> Operation[list[TransactionInfo]]:
    """The registry's transactions, oldest first (at most `limit`)."""
    now = yield Command(("TIME",), server_ms)
    ids = yield Command(
        ("ZRANGE", keys.transactions(), 0, limit - 1), lambda r: [text(x) for x in r]
    )
    infos = []
    for tx_id in ids:
        record, batches = yield [
            tx.read_record(keys, tx_id),
            Command(("LLEN", keys.transaction_messages(tx_id)), int),
        ]
        if record is None:
            infos.append(TransactionInfo(tx_id, "missing", "", None, 0, 0, None, 0))
            continue
        infos.append(
            TransactionInfo(
                transaction_id=tx_id,
                state=record.state,
                producer=record.name or str(record.producer_id or ""),
                group=record.group,
                batches=batches,
                age_ms=max(0, now - record.created_ms) if record.created_ms else 0,
                deadline_ms=record.deadline_ms if record.group is None else None,
                checks=record.checks,
            )
        )
    return infos


def sweep_now(keys: KeySpace) -> Operation[int]:
    """Carry out what is due now (what a transactional producer's sweeper does every second)."""
    total = 0
    for _ in range(1000):  # entries that keep failing stay due: do not loop on them forever
        looked = yield from sweep(keys)
        total += looked
        if looked < 100:
            break
    return total
