"""What a topic is: its configuration (the metadata hash) and what describing it shows.

These are plain values shared by the broker, the producer, the consumer, the protocol layer and
the Spark connector; they import nothing else of redisq, so no module needs the broker to know
what a topic looks like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DEDUP_WINDOW_MS = 24 * 3600 * 1000
DEFAULT_PRODUCER_STATE_TTL_MS = 24 * 3600 * 1000
# The largest retention, dedup window or producer state TTL (ms or messages): 2**53 - 1, the
# largest integer a Lua number (a double) holds exactly. The scripts use these in XTRIM and
# PEXPIRE, which refuse anything larger (and produce.lua refuses it before it appends).
MAX_TOPIC_SETTING = (1 << 53) - 1
# How a topic's partitions hold messages (DESIGN §14): "message", one stream entry per message
# (every topic created before batch entries), or "batch", one entry per producer batch.
ENTRY_FORMATS = ("message", "batch")
# What a new topic holds when create_topic is not told (DESIGN §14.13): batch entries, except on
# fakeredis (no XSETID, no `struct` in its Lua), where it holds message entries.
DEFAULT_ENTRY_FORMAT = "batch"
# What a topic whose metadata names no format holds: one created before batch entries.
STORED_ENTRY_FORMAT = "message"


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """A topic's metadata as stored in its hash."""

    name: str
    partitions: int
    retention_ms: int = 0
    retention_messages: int = 0
    dedup_window_ms: int = DEFAULT_DEDUP_WINDOW_MS
    producer_state_ttl_ms: int = DEFAULT_PRODUCER_STATE_TTL_MS
    created_ms: int = 0
    topic_id: str = ""
    entry_format: str = STORED_ENTRY_FORMAT

    @property
    def state_ttl_ms(self) -> int:
        """Producer state never expires before the messages it protects (DESIGN §2)."""
        return max(self.producer_state_ttl_ms, self.retention_ms)

    @classmethod
    def from_hash(cls, name: str, raw: dict[bytes, bytes]) -> TopicConfig:
        def number(field_name: str, default: int) -> int:
            value = raw.get(field_name.encode())
            return int(value) if value is not None else default

        return cls(
            name=name,
            partitions=number("partitions", 0),
            retention_ms=number("retention_ms", 0),
            retention_messages=number("retention_messages", 0),
            dedup_window_ms=number("dedup_window_ms", DEFAULT_DEDUP_WINDOW_MS),
            producer_state_ttl_ms=number("producer_state_ttl_ms", DEFAULT_PRODUCER_STATE_TTL_MS),
            created_ms=number("created_ms", 0),
            topic_id=raw.get(b"topic_id", b"").decode(),
            # A topic created before batch entries has no field: its entries are messages.
            entry_format=raw.get(b"entry_format", STORED_ENTRY_FORMAT.encode()).decode(),
        )


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition as describe_topic reads it: its length, its first and last offsets (None
    when empty), the cluster node serving it, and its delayed messages not yet due."""

    partition: int
    length: int
    first_offset: str | None
    last_offset: str | None
    node: str | None = None
    scheduled: int = 0  # delayed messages waiting in the partition's schedule
    next_due_ms: int | None = None  # when the next of them is due (server clock, ms)
    # The messages it holds: its length on a topic of message entries; on a topic of batch
    # entries (length counts entries) what its counters tell (DESIGN §14.6), None if they cannot
    messages: int | None = None
    # A topic of batch entries: the messages ever appended (its counters), None if they cannot
    # be told; with messages, how many were trimmed away
    counted: int | None = None

    @property
    def trimmed(self) -> int | None:
        """The messages appended and no longer held (a batch topic; None elsewhere)."""
        if self.counted is None or self.messages is None:
            return None
        return self.counted - self.messages


@dataclass(frozen=True, slots=True)
class TopicDescription:
    """What describe_topic answers: the topic's configuration and each partition's state."""

    config: TopicConfig
    partitions: list[PartitionInfo] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def total_messages(self) -> int:
        """The messages the partitions hold (on a batch topic, a partition whose count cannot
        be told adds its entries: at least one message each)."""
        return sum(p.length if p.messages is None else p.messages for p in self.partitions)

    @property
    def total_entries(self) -> int:
        """The stream entries the partitions hold (XLEN): the messages on a topic of message
        entries, the producer batches (and other entries) on a topic of batch entries."""
        return sum(p.length for p in self.partitions)

    @property
    def total_scheduled(self) -> int:
        """Delayed messages not yet due (or not yet delivered)."""
        return sum(p.scheduled for p in self.partitions)
