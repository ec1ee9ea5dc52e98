"""The options of producers and consumers (and their checks), shared by the thread and the
asyncio API.

`ProducerOptions` / `ConsumerOptions` type the keyword arguments of `broker.producer(...)` and
`broker.consumer(...)` for type checkers and IDEs; `*Settings.from_options` checks every one
eagerly (TypeError for an unknown name or a wrong type, InvalidConfig with the value and the
allowed range) before anything is sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from redisq.errors import InvalidConfig, check_int, check_number
from redisq.model.keys import validate_name
from redisq.model.partitioner import Selector

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
    key_serializer: Callable[[Any], bytes] | str | None  # "json", "str" or a callable
    value_serializer: Callable[[Any], bytes] | str | None
    transactional: bool  # Kafka style: p.transaction() (needs a name; fences older instances)
    transactional_group: str | None  # RocketMQ style: p.send_in_transaction(), check-back
    check: Callable[..., Any] | None  # check(tx_id, messages) -> TxState (check-back)
    transaction_timeout_ms: int  # an open transaction is aborted this long after it began
    check_first_ms: int  # first check-back of an undecided half message (RocketMQ: 6 s)
    check_interval_ms: int  # then every (RocketMQ: 30 s)
    max_checks: int  # then it goes to the group's unresolved topic (RocketMQ: 15)


# run()'s handler: on the thread of the partition it reads (a lane's, with key_concurrency), or
# every call on one thread of the member (for code that is not thread-safe)
HANDLER_THREADS = ("partition", "one")


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
    key_serializer: Callable[[Any], bytes] | str | None = None
    value_serializer: Callable[[Any], bytes] | str | None = None
    transactional: bool = False
    transactional_group: str | None = None
    check: Callable[..., Any] | None = None
    transaction_timeout_ms: int = 60_000
    check_first_ms: int = 6_000
    check_interval_ms: int = 30_000
    max_checks: int = 15

    @property
    def transactions(self) -> bool:
        return self.transactional or self.transactional_group is not None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ProducerSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown producer option(s) {', '.join(unknown)}")
        settings = cls(**options)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.idempotence not in IDEMPOTENCE_MODES:
            raise InvalidConfig(
                f"idempotence={self.idempotence!r}: choose one of {IDEMPOTENCE_MODES}"
            )
        if self.acks not in ACKS:
            raise InvalidConfig(f"acks={self.acks!r}: choose one of {ACKS}")
        check_number("linger_ms", self.linger_ms, 0, 60_000)
        check_int("max_batch_messages", self.max_batch_messages, 1, 10_000)
        check_int("max_batch_bytes", self.max_batch_bytes, 1024, 64 << 20)
        check_int("max_in_flight", self.max_in_flight, 1, 100)
        check_int("window", self.window, 1, 1000)
        check_int("max_message_bytes", self.max_message_bytes, 1, 512 << 20)
        check_int("delivery_timeout_ms", self.delivery_timeout_ms, 100, 24 * 3600 * 1000)
        check_int("retry_backoff_ms", self.retry_backoff_ms, 1, 60_000)
        check_int("max_buffered_messages", self.max_buffered_messages, 1, 100_000_000)
        check_int("max_block_ms", self.max_block_ms, 0, 3_600_000)
        check_int("min_replicas", self.min_replicas, 1, 100)
        check_int("ack_timeout_ms", self.ack_timeout_ms, 0, 3_600_000)
        check_int("metadata_max_age_ms", self.metadata_max_age_ms, 100, 3_600_000)
        if self.idempotence == "sequence" and self.window < self.max_in_flight:
            raise InvalidConfig(
                f"window={self.window} must be >= max_in_flight={self.max_in_flight}: a re-sent "
                "batch must still be in the broker's window"
            )
        if self.partitioner is not None and not callable(self.partitioner):
            raise TypeError(f"partitioner must be callable, not {type(self.partitioner).__name__}")
        for name in ("key_serializer", "value_serializer"):
            value = getattr(self, name)
            if value is not None and value not in ("json", "str") and not callable(value):
                raise TypeError(f"{name} must be 'json', 'str' or a callable, not {value!r}")
        self._check_transactions()

    def _check_transactions(self) -> None:
        if not isinstance(self.transactional, bool):
            kind = type(self.transactional).__name__
            raise TypeError(f"transactional must be a bool, not {kind}")
        if self.transactional_group is not None:
            validate_name("transactional group", self.transactional_group)
            if self.check is None:
                raise InvalidConfig(
                    "transactional_group needs check=: the function check-back asks about an "
                    "undecided half message"
                )
        if self.check is not None:
            if not callable(self.check):
                raise TypeError(f"check must be callable, not {type(self.check).__name__}")
            if self.transactional_group is None:
                raise InvalidConfig("check= needs transactional_group=: the group it answers for")
        check_int("transaction_timeout_ms", self.transaction_timeout_ms, 1_000, 24 * 3600 * 1000)
        check_int("check_first_ms", self.check_first_ms, 10, 24 * 3600 * 1000)
        check_int("check_interval_ms", self.check_interval_ms, 10, 24 * 3600 * 1000)
        check_int("max_checks", self.max_checks, 1, 10_000)


MODES = ("orderly", "concurrent")
STARTS = ("earliest", "latest")
POLICY_NAMES = ("dead_letter", "park_key", "block")


class ConsumerOptions(TypedDict, total=False):
    """Keyword options of a consumer (see redisq.Consumer and the guide on consuming)."""

    mode: str  # "orderly" (default: partition leases, offset order) or "concurrent"
    start: str  # where a new group starts: "earliest" (default) or "latest"
    pattern: str | None  # also subscribe to every topic whose name matches this regex
    lease_ttl_ms: int  # lease time to live; renewed every lease_ttl_ms / 3
    session_timeout_ms: int | None  # a member silent this long is dead (default: lease_ttl_ms)
    heartbeat_interval_ms: int | None  # default min(lease_ttl_ms / 3, 3000)
    batch_size: int  # entries per read
    key_concurrency: int  # orderly: lanes per partition running different keys in parallel
    handler_thread: str  # "partition": run()'s handler on each partition's thread; "one": one
    max_attempts: int  # handler calls per message before the failure policy applies
    retry_backoff_ms: int  # exponential backoff with jitter between attempts
    max_retry_backoff_ms: int
    failure_policy: Any  # "dead_letter", "park_key", "block", or a policies.FailurePolicy
    claim_idle_ms: int | None  # concurrent: reclaim entries pending this long
    block_ms: int  # how long an idle partition waits for new entries per round
    ack_interval_ms: int  # handled messages are committed at least this often
    enable_auto_commit: bool  # poll()/iteration acknowledge what they gave before (Kafka's)
    metadata_max_age_ms: int  # added partitions (and pattern topics) are read within this
    on_assign: Callable[[list[tuple[str, int]]], Any] | None  # in run()/poll(), before a read
    on_revoke: Callable[[list[tuple[str, int]]], Any] | None  # after their last commit
    key_deserializer: Callable[[bytes], Any] | str | None  # "json", "str" or a callable
    value_deserializer: Callable[[bytes], Any] | str | None


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    mode: str = "orderly"
    start: str = "earliest"
    pattern: str | None = None
    lease_ttl_ms: int = 30_000
    session_timeout_ms: int | None = None
    heartbeat_interval_ms: int | None = None
    batch_size: int = 500
    key_concurrency: int = 1
    handler_thread: str = "partition"
    max_attempts: int = 5
    retry_backoff_ms: int = 100
    max_retry_backoff_ms: int = 30_000
    failure_policy: Any = "dead_letter"
    claim_idle_ms: int | None = None
    block_ms: int = 300
    ack_interval_ms: int = 100
    enable_auto_commit: bool = True
    metadata_max_age_ms: int = 5_000
    on_assign: Callable[[list[tuple[str, int]]], Any] | None = None
    on_revoke: Callable[[list[tuple[str, int]]], Any] | None = None
    key_deserializer: Callable[[bytes], Any] | str | None = None
    value_deserializer: Callable[[bytes], Any] | str | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ConsumerSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown consumer option(s) {', '.join(unknown)}")
        settings = cls(**options)
        settings.validate()
        return settings

    @property
    def session_ms(self) -> int:
        return self.session_timeout_ms if self.session_timeout_ms is not None else self.lease_ttl_ms

    @property
    def heartbeat_ms(self) -> int:
        if self.heartbeat_interval_ms is not None:
            return self.heartbeat_interval_ms
        return min(self.lease_ttl_ms // 3, 3000)

    @property
    def claim_idle(self) -> int:
        return self.claim_idle_ms if self.claim_idle_ms is not None else self.lease_ttl_ms

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InvalidConfig(f"mode={self.mode!r}: expected one of {MODES}")
        if self.start not in STARTS:
            raise InvalidConfig(f"start={self.start!r}: expected one of {STARTS}")
        if isinstance(self.failure_policy, str):
            if self.failure_policy not in POLICY_NAMES:
                raise InvalidConfig(
                    f"failure_policy={self.failure_policy!r}: expected one of {POLICY_NAMES} "
                    "or a redisq.policies.FailurePolicy"
                )
            if self.failure_policy == "park_key" and self.mode != "orderly":
                raise InvalidConfig("failure_policy='park_key' needs mode='orderly'")
        elif not callable(getattr(self.failure_policy, "decide", None)):
            raise TypeError(
                "failure_policy must be a policy name or a redisq.policies.FailurePolicy, not "
                f"{type(self.failure_policy).__name__}"
            )
        check_int("lease_ttl_ms", self.lease_ttl_ms, 300, 3_600_000)
        check_int("session_timeout_ms", self.session_ms, 300, 3_600_000)
        check_int("heartbeat_interval_ms", self.heartbeat_ms, 50, self.session_ms // 2)
        check_int("batch_size", self.batch_size, 1, 10_000)
        check_int("key_concurrency", self.key_concurrency, 1, 256)
        if self.key_concurrency > 1 and self.mode != "orderly":
            raise InvalidConfig("key_concurrency needs mode='orderly'")
        if self.handler_thread not in HANDLER_THREADS:
            raise InvalidConfig(
                f"handler_thread={self.handler_thread!r}: expected one of {HANDLER_THREADS}"
            )
        check_int("max_attempts", self.max_attempts, 1)
        check_int("retry_backoff_ms", self.retry_backoff_ms, 0)
        check_int("max_retry_backoff_ms", self.max_retry_backoff_ms, self.retry_backoff_ms)
        check_int("claim_idle_ms", self.claim_idle, 100)
        check_int("block_ms", self.block_ms, 10, 10_000)
        check_int("ack_interval_ms", self.ack_interval_ms, 0)
        if not isinstance(self.enable_auto_commit, bool):
            raise TypeError(
                f"enable_auto_commit must be True or False, not {self.enable_auto_commit!r}"
            )
        check_int("metadata_max_age_ms", self.metadata_max_age_ms, 100, 3_600_000)
        if self.pattern is not None:
            if not isinstance(self.pattern, str):
                raise TypeError(f"pattern must be a str, not {type(self.pattern).__name__}")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise InvalidConfig(f"pattern={self.pattern!r}: {exc}") from None
        for name in ("on_assign", "on_revoke"):
            callback = getattr(self, name)
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be callable, not {type(callback).__name__}")
        for name in ("key_deserializer", "value_deserializer"):
            value = getattr(self, name)
            if value is not None and value not in ("json", "str") and not callable(value):
                raise TypeError(f"{name} must be 'json', 'str' or a callable, not {value!r}")
