"""The options of producers (and their checks), shared by the thread and the asyncio API.

`ProducerOptions` types the keyword arguments of `broker.producer(...)` for type checkers and
IDEs; `ProducerSettings.from_options` checks every one eagerly (TypeError for an unknown name
or a wrong type, InvalidConfig with the value and the allowed range) before anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from redisq.errors import InvalidConfig, check_number
from redisq.partitioner import Selector

IDEMPOTENCE_MODES = ("sequence", "message_id", None)
ACKS = ("leader", "replicas", "fsync")


class ProducerOptions(TypedDict, total=False):
    """Keyword options of a producer (Kafka's names where they exist)."""

    idempotence: str | None  # "sequence" (default), "message_id" or None
    acks: str  # "leader" (default), "replicas" or "fsync"
    linger_ms: float  # wait this long for a batch to fill (send() does not linger)
    max_batch_messages: int
    max_batch_bytes: int
    max_in_flight: int  # batches per partition on the wire
    window: int  # batches the broker remembers per (producer, partition)
    max_message_bytes: int
    delivery_timeout_ms: int  # a message not acknowledged by then fails: DeliveryTimeout
    retry_backoff_ms: int
    max_buffered_messages: int
    max_block_ms: int  # send_async blocks this long when the buffer is full (thread API)
    min_replicas: int  # acks="replicas": WAIT for this many
    ack_timeout_ms: int  # acks="replicas"/"fsync": how long WAIT/WAITAOF waits
    metadata_max_age_ms: int  # topic metadata is read again this often (added partitions)
    partitioner: Selector | None  # (topic, key, value, partitions) -> partition


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    idempotence: str | None = "sequence"
    acks: str = "leader"
    linger_ms: float = 5.0
    max_batch_messages: int = 500
    max_batch_bytes: int = 1 << 20
    max_in_flight: int = 5
    window: int = 16
    max_message_bytes: int = 1 << 20
    delivery_timeout_ms: int = 120_000
    retry_backoff_ms: int = 50
    max_buffered_messages: int = 100_000
    max_block_ms: int = 60_000
    min_replicas: int = 1
    ack_timeout_ms: int = 1_000
    metadata_max_age_ms: int = 5_000
    partitioner: Callable[[str, bytes | None, bytes, int], int] | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ProducerSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown producer option(s) {', '.join(unknown)}")
        settings = cls(**options)
        settings.check()
        return settings

    def check(self) -> None:
        if self.idempotence not in IDEMPOTENCE_MODES:
            raise InvalidConfig(
                f"idempotence={self.idempotence!r}: choose one of {IDEMPOTENCE_MODES}"
            )
        if self.acks not in ACKS:
            raise InvalidConfig(f"acks={self.acks!r}: choose one of {ACKS}")
        check_number("linger_ms", self.linger_ms, 0, 60_000)
        check_number("max_batch_messages", self.max_batch_messages, 1, 10_000)
        check_number("max_batch_bytes", self.max_batch_bytes, 1024, 64 << 20)
        check_number("max_in_flight", self.max_in_flight, 1, 100)
        check_number("window", self.window, 1, 1000)
        check_number("max_message_bytes", self.max_message_bytes, 1, 512 << 20)
        check_number("delivery_timeout_ms", self.delivery_timeout_ms, 100, 24 * 3600 * 1000)
        check_number("retry_backoff_ms", self.retry_backoff_ms, 1, 60_000)
        check_number("max_buffered_messages", self.max_buffered_messages, 1, 100_000_000)
        check_number("max_block_ms", self.max_block_ms, 0, 3_600_000)
        check_number("min_replicas", self.min_replicas, 1, 100)
        check_number("ack_timeout_ms", self.ack_timeout_ms, 0, 3_600_000)
        check_number("metadata_max_age_ms", self.metadata_max_age_ms, 100, 3_600_000)
        if self.idempotence == "sequence" and self.window < self.max_in_flight:
            raise InvalidConfig(
                f"window={self.window} must be >= max_in_flight={self.max_in_flight}: a re-sent "
                "batch must still be in the broker's window"
            )
        if self.partitioner is not None and not callable(self.partitioner):
            raise TypeError(f"partitioner must be callable, not {type(self.partitioner).__name__}")
