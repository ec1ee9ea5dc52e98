"""What producers and consumers count (the library's own numbers; redisq.metrics reads them)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any


@dataclass
class ConsumerStats:
    """Counted by the consumer (both drivers) for this member."""

    consumed: int = 0  # messages given to the application: returned by poll, or to run's handler
    handled: int = 0
    failures: int = 0
    retries: int = 0
    dead_letters: int = 0
    malformed: int = 0
    leases_acquired: int = 0
    leases_lost: int = 0
    fenced_commits: int = 0
    commits: int = 0
    rebalances: int = 0

    @property
    def fenced_acks(self) -> int:  # the name before commits replaced acks in orderly mode
        return self.fenced_commits


@dataclass
class ProducerStats:
    """Counted by the producer's core (both drivers) and its transactions."""

    sent: int = 0  # messages accepted by send / send_async
    acknowledged: int = 0  # messages the broker answered as stored (duplicates included)
    duplicates: int = 0  # of which answered as written before (nothing written now)
    retries: int = 0  # batches sent again (lost replies, gaps, redirects)
    fenced: int = 0  # messages failed by ProducerFenced
    failed: int = 0  # messages failed (delivery timeout, fencing, refused)
    transactions_committed: int = 0
    transactions_aborted: int = 0


# -- the live clients of this process (redisq.metrics reads their counters) ---------------------
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_tracked_lock = threading.Lock()


def track(client: Any) -> None:
    """Include a Consumer's (or Producer's) own counters in every redisq.metrics.collect() of
    this process (producers and consumers track themselves when they start). Held weakly: a
    dropped client disappears from the metrics."""
    with _tracked_lock:
        _tracked.add(client)


def untrack(client: Any) -> None:
    with _tracked_lock:
        _tracked.discard(client)


def tracked() -> list[Any]:
    with _tracked_lock:
        return list(_tracked)
