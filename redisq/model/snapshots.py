"""What the views show (the console's pages, the metrics, describe_group): a namespace's topics
and their partitions, its groups and what each holds on each partition, read at one moment.

Plain values: redisq.protocol.overview and redisq.protocol.group_view read them from Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redisq.model.keys import parse_dead_letter_topic
from redisq.model.topic import TopicConfig

# The default session timeout (ConsumerOptions: the lease ttl, 30 s). A group's own is not
# stored, so a member silent for longer is shown as silent, not removed.
SILENT_MEMBER_MS = 30_000

__all__ = [
    "SILENT_MEMBER_MS",
    "GroupPartition",
    "GroupSnapshot",
    "NamespaceSnapshot",
    "PartitionSnapshot",
    "TopicSnapshot",
]


@dataclass(frozen=True, slots=True)
class PartitionSnapshot:
    """One partition stream (XINFO STREAM). entries_added counts every entry ever appended
    (Redis >= 7.0): the produced-messages counter, which trimming does not lower. scheduled:
    delayed messages waiting in the partition's schedule, the first due at next_due_ms (the
    server's clock)."""

    partition: int
    length: int
    first_offset: str | None
    last_offset: str | None
    entries_added: int
    node: str | None = None
    scheduled: int = 0
    next_due_ms: int | None = None
    # A topic of batch entries (DESIGN §14.6): the messages its counters say were appended
    # (counted) and the messages it holds (messages; None where that cannot be told)
    counted: int | None = None
    messages: int | None = None

    @property
    def appended(self) -> int:
        """The messages ever appended: the counters' on a batch topic, else entries_added."""
        return self.entries_added if self.counted is None else self.counted


@dataclass(frozen=True, slots=True)
class TopicSnapshot:
    config: TopicConfig
    partitions: list[PartitionSnapshot]
    groups: list[str]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def length(self) -> int:
        return sum(p.length for p in self.partitions)

    @property
    def entries_added(self) -> int:
        return sum(p.entries_added for p in self.partitions)

    @property
    def messages(self) -> int | None:
        """The messages the partitions hold (on a batch topic, from their counters: None when
        one of them cannot tell)."""
        held = [p.messages for p in self.partitions]
        return None if None in held else sum(p or 0 for p in held)

    @property
    def held(self) -> int:
        """The messages the partitions hold: on a batch topic what its counters say (a partition
        that cannot tell adds its entries, at least one message each), else its length."""
        return sum(p.length if p.messages is None else p.messages for p in self.partitions)

    @property
    def appended(self) -> int:
        """The messages ever appended (the throughput charts' counter)."""
        return sum(p.appended for p in self.partitions)

    @property
    def scheduled(self) -> int:
        return sum(p.scheduled for p in self.partitions)

    @property
    def next_due_ms(self) -> int | None:
        return min((p.next_due_ms for p in self.partitions if p.next_due_ms), default=None)

    @property
    def dead_letter_of(self) -> tuple[str, str] | None:
        """(topic, group) when this is a group's dead-letter topic."""
        return parse_dead_letter_topic(self.config.name)


@dataclass(frozen=True, slots=True)
class GroupPartition:
    """One partition as a group sees it: position and lag (XINFO GROUPS), the lease (holder,
    fencing token, time left), grants so far (the fencing counter), and the failure state the
    commits record (dead letters, a blocked message, parked keys, held messages)."""

    partition: int
    length: int
    last_delivered: str | None
    entries_read: int | None
    lag: int | None  # messages (on a batch topic too: from its counters, DESIGN §14.6)
    lag_counted: bool  # True: counted by count_range (Redis could not tell it)
    pending: int
    consumers: int
    holder: str | None
    token: int | None
    granted_ms: int | None
    lease_left_ms: int | None
    grants: int
    dead_letters: int
    malformed: int
    parked: int
    held: int
    blocked_offset: str | None
    blocked_error: str | None
    blocked_attempts: int | None
    takeovers: int


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    topic: str
    group: str
    mode: str | None
    start: str | None
    policy: str | None
    created_ms: int | None
    members: list[tuple[str, int]]  # (name, ms since its last heartbeat), sorted by name
    partitions: list[GroupPartition]
    dead_letter_topic: str
    dead_letters_waiting: int  # messages in the dead-letter topic now
    now_ms: int
    start_id: str = "0"  # where the group starts: "0", or "<created_ms>-<max seq>" (start="latest")

    @property
    def lag(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if any(lag is None for lag in lags) else sum(lag or 0 for lag in lags)

    @property
    def live_members(self) -> list[str]:
        return [name for name, age in self.members if age <= SILENT_MEMBER_MS]

    @property
    def blocked(self) -> int:
        return sum(1 for p in self.partitions if p.blocked_offset)

    @property
    def parked(self) -> int:
        return sum(p.parked for p in self.partitions)

    @property
    def held(self) -> int:
        return sum(p.held for p in self.partitions)

    @property
    def pending(self) -> int:
        return sum(p.pending for p in self.partitions)


@dataclass(frozen=True, slots=True)
class NamespaceSnapshot:
    now_ms: int
    topics: dict[str, TopicSnapshot] = field(default_factory=dict)
    groups: dict[tuple[str, str], GroupSnapshot] = field(default_factory=dict)
