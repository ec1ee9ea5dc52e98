"""What a consumer counts (the library's own numbers; redisq's metrics read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConsumerStats:
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
