"""What a consumer group looks like to its administrator: describe_group's answer (members and,
per partition, position, lag and failure state) and what an offset reset did.

Plain values, as model/topic.py's: the protocol operations that read and reset groups
(redisq.protocol.groups, redisq.protocol.offsets) build them, both brokers return them.

Positions: an orderly group's committed position on a partition is its Redis consumer group's
last-delivered-id (the last entry counted as handled; the next read starts after it), so
XINFO GROUPS shows the truth. A concurrent group has the same position (what was delivered)
and a pending-entries list (delivered, not acknowledged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GroupDescription", "MemberInfo", "OffsetReset", "PartitionLag"]


@dataclass(frozen=True, slots=True)
class MemberInfo:
    name: str
    last_heartbeat_age_ms: int


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition as a group sees it (XINFO GROUPS + lease + dead-letter state).

    lag: the entries the group has still to read (None: more than the count cap, when Redis
    cannot tell it). dead_letters counts every message the group dead-lettered from this
    partition; malformed counts those of them that were malformed entries (not redisq
    messages: records.py). A malformed entry held by policy block shows as blocked_offset, its
    blocked_error starting with "MalformedEntry"."""

    partition: int
    length: int
    last_offset: str | None
    last_delivered: str | None
    entries_read: int | None
    lag: int | None
    pending: int
    owner: str | None
    lease_token: int | None
    lease_age_ms: int | None
    lease_ttl_ms: int | None
    dead_letters: int
    parked_keys: int
    blocked_offset: str | None = None
    blocked_error: str | None = None
    blocked_attempts: int | None = None
    malformed: int = 0
    held: int = 0  # messages held back behind parked keys (orderly groups)


@dataclass(frozen=True, slots=True)
class GroupDescription:
    topic: str
    group: str
    mode: str | None
    start: str | None
    policy: str | None
    created_ms: int | None
    members: list[MemberInfo] = field(default_factory=list)
    partitions: list[PartitionLag] = field(default_factory=list)
    dead_letter_topic: str = ""
    dead_letter_messages: int = 0

    @property
    def total_lag(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if any(lag is None for lag in lags) else sum(lag or 0 for lag in lags)

    @property
    def total_pending(self) -> int:
        return sum(p.pending for p in self.partitions)

    @property
    def total_malformed(self) -> int:
        return sum(p.malformed for p in self.partitions)

    @property
    def total_held(self) -> int:
        return sum(p.held for p in self.partitions)


@dataclass(frozen=True, slots=True)
class OffsetReset:
    """What a reset did (or, dry run, would do) on one partition.

    before / after: the committed position, the last entry counted as handled ("0-0": none);
    the next read starts after it. before is None when the group had not read the partition
    yet. lag_before / lag_after: entries after each (None: more than the count cap, or
    unknown). pending_dropped: a concurrent group's entries delivered but not acknowledged,
    dropped by the reset."""

    partition: int
    before: str | None
    after: str
    lag_before: int | None
    lag_after: int | None
    pending_dropped: int
