"""Looking at transactions: the open and unfinished ones in the registry, and sweeping now (the
`redisq transactions` command, `Broker.list_transactions`, the console)."""

from __future__ import annotations

from redisq.model.keys import KeySpace
from redisq.protocol import Operation
from redisq.protocol.transaction_ops import sweep
from redisq.protocol.waiting import TransactionInfo, transactions_snapshot

__all__ = ["TransactionInfo", "list_transactions", "sweep_now"]


def list_transactions(keys: KeySpace, limit: int = 1000) -> Operation[list[TransactionInfo]]:
    """The registry's transactions (the first `limit` the sweeper looks at), oldest first, in a
    fixed number of round trips (redisq.protocol.waiting)."""
    snapshot = yield from transactions_snapshot(keys, limit)
    return [pending.info for pending in snapshot.transactions]


def sweep_now(keys: KeySpace) -> Operation[int]:
    """Carry out what is due now (what a transactional producer's sweeper does every second)."""
    total = 0
    for _ in range(1000):  # entries that keep failing stay due: do not loop on them forever
        looked = yield from sweep(keys)
        total += looked
        if looked < 100:
            break
    return total
