"""The producer: batching, ordering and idempotence on top of the produce_* Lua scripts.

Messages are collected per partition into batches. A batch is sealed (given its base sequence
and frozen) when it is full, when its linger time has passed, or on flush/send. A background
sender thread sends every partition's first `max_in_flight` unacknowledged batches in one
pipeline per round, so several batches per partition are in flight at once, in order on one
connection. Anything not acknowledged (connection error, timeout, OUT_OF_ORDER after a lost
batch, NOSCRIPT after a restart) is sent again, the very same batch with the same sequences,
until it is acknowledged or delivery_timeout_ms runs out. The broker-side window turns a
re-sent batch that had been written into a duplicate answer carrying its original offsets.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from redisq import errors
from redisq.errors import (
    DeliveryTimeout,
    InvalidConfig,
    MessageTooLarge,
    NotEnoughReplicas,
    ProducerClosed,
    ProducerFenced,
    RedisqError,
    UnsupportedServer,
    check_number,
)
from redisq.keys import validate_name
from redisq.partitioner import Selector, StickyPartitioner, partition_for_key
from redisq.records import RecordMetadata, encode_headers, offset_at
from redisq.transport import Redirect, Transport, bulk, command

if TYPE_CHECKING:
    from redisq.broker import Broker, TopicConfig
    from redisq.snowflake import SnowflakeGenerator

log = logging.getLogger("redisq.producer")

IDEMPOTENCE_MODES = ("sequence", "message_id", None)
ACKS = ("leader", "replicas", "fsync")
REGISTRY_TTL_MS = 7 * 24 * 3600 * 1000

# Error replies after which the script did not run (or ran with no effect): send again.
_RETRIABLE_REPLIES = (
    "NOSCRIPT",
    "OOM",
    "BUSY",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "MOVED",
    "ASK",
)


def _as_bytes(what: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


class _Batch:
    """Messages for one partition. Frozen once sealed: a retry re-sends exactly these."""

    __slots__ = (
        "config",
        "topic",
        "partition",
        "layout",
        "args",
        "count",
        "nbytes",
        "base_seq",
        "created",
        "sealed",
        "done",
        "first_id",
        "ids",
        "dup_flags",
        "duplicate",
        "error",
        "callbacks",
        "in_flight",
        "body",
        "body_count",
        "span",
    )

    def __init__(self, config: TopicConfig, partition: int, layout: str) -> None:
        self.config = config  # the metadata it was routed with: retention, partition count
        self.topic = config.name
        self.partition = partition
        self.layout = layout
        self.args: list[bytes] = []
        self.count = 0
        self.nbytes = 0
        self.base_seq = -1
        self.created = time.monotonic()
        self.sealed = False
        self.done = threading.Event()
        self.first_id: str | None = None
        self.ids: list[str] | None = None
        self.dup_flags: str | None = None
        self.duplicate = False
        self.error: BaseException | None = None
        self.callbacks: list[tuple[int, Callable[[SendFuture], None]]] | None = None
        self.in_flight = False
        self.body: bytes | None = None
        self.body_count = 0
        self.span = 0

    def metadata(self, index: int) -> RecordMetadata:
        flags = self.dup_flags
        if flags is not None:  # message_id mode: appended ones are consecutive from first_id
            if flags[index] == "1":
                original = self.ids[flags.count("1", 0, index)] if self.ids else None
                return RecordMetadata(self.topic, self.partition, original, True)
            appended_before = index - flags.count("1", 0, index)
            offset = offset_at(self.first_id, appended_before) if self.first_id else None
            return RecordMetadata(self.topic, self.partition, offset, False)
        offset = offset_at(self.first_id, index) if self.first_id else None
        return RecordMetadata(self.topic, self.partition, offset, self.duplicate)

    def finish(self) -> None:
        self.done.set()
        if self.callbacks:
            for index, callback in self.callbacks:
                try:
                    callback(SendFuture(self, index))
                except Exception:  # a user's callback must not stop the sender
                    log.exception("send callback raised")


class SendFuture:
    """The result of send_async(): result() blocks until the message is acknowledged."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self._batch = batch
        self._index = index

    def done(self) -> bool:
        return self._batch.done.is_set()

    def result(self, timeout: float | None = None) -> RecordMetadata:
        if not self._batch.done.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        if self._batch.error is not None:
            raise self._batch.error
        return self._batch.metadata(self._index)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._batch.done.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        return self._batch.error

    def add_done_callback(self, callback: Callable[[SendFuture], None]) -> None:
        batch = self._batch
        if batch.done.is_set():
            callback(self)
            return
        if batch.callbacks is None:
            batch.callbacks = []
        batch.callbacks.append((self._index, callback))


@dataclass
class _PartitionState:
    """Producer-side sequence bookkeeping of one partition."""

    next_seq: int = 0  # base sequence of the next sealed batch
    acked_next: int = 0  # the sequence after the last acknowledged batch
    open: _Batch | None = None
    unacked: deque[_Batch] = field(default_factory=deque)


class Producer:
    """Sends messages to topics; see DESIGN §3.

    idempotence:
      "sequence"   (default) PID + per-partition sequence numbers checked by the broker; a re-sent
                   batch is never written twice; named producers fence older instances.
      "message_id" every message carries an id (yours, or a generated Snowflake id); the broker
                   writes an id once per dedup window; the id routes the message when it has no key.
      None         plain appends: a retry after a lost reply may write a message twice.
    acks: "leader" (the script returned), "replicas" (WAIT min_replicas after the write, on the
      same connection), "fsync" (WAITAOF 1 0: the leader's AOF is fsynced; Redis >= 7.2).
    """

    def __init__(
        self,
        broker: Broker,
        name: str | None = None,
        *,
        idempotence: str | None = "sequence",
        acks: str = "leader",
        linger_ms: float = 5.0,
        max_batch_messages: int = 500,
        max_batch_bytes: int = 1 << 20,
        max_in_flight: int = 5,
        window: int = 16,
        max_message_bytes: int = 1 << 20,
        delivery_timeout_ms: int = 120_000,
        retry_backoff_ms: int = 50,
        max_buffered_messages: int = 100_000,
        max_block_ms: int = 60_000,
        min_replicas: int = 1,
        ack_timeout_ms: int = 1_000,
        partitioner: Selector | None = None,
    ) -> None:
        if idempotence not in IDEMPOTENCE_MODES:
            raise InvalidConfig(f"idempotence={idempotence!r}: choose one of {IDEMPOTENCE_MODES}")
        if acks not in ACKS:
            raise InvalidConfig(f"acks={acks!r}: choose one of {ACKS}")
        if name is not None:
            validate_name("producer", name)
        check_number("linger_ms", linger_ms, 0, 60_000)
        check_number("max_batch_messages", max_batch_messages, 1, 10_000)
        check_number("max_batch_bytes", max_batch_bytes, 1024, 64 << 20)
        check_number("max_in_flight", max_in_flight, 1, 100)
        check_number("window", window, 1, 1000)
        check_number("max_message_bytes", max_message_bytes, 1, 512 << 20)
        check_number("delivery_timeout_ms", delivery_timeout_ms, 100, 24 * 3600 * 1000)
        check_number("retry_backoff_ms", retry_backoff_ms, 1, 60_000)
        check_number("max_buffered_messages", max_buffered_messages, 1, 100_000_000)
        check_number("min_replicas", min_replicas, 1, 100)
        check_number("ack_timeout_ms", ack_timeout_ms, 0, 3_600_000)
        if idempotence == "sequence" and window < max_in_flight:
            raise InvalidConfig(
                f"window={window} must be >= max_in_flight={max_in_flight}: a re-sent batch must "
                "still be in the broker's window"
            )
        if partitioner is not None and not callable(partitioner):
            raise TypeError(f"partitioner must be callable, not {type(partitioner).__name__}")

        self.broker = broker
        self.name = name
        self.idempotence = idempotence
        self.acks = acks
        self.linger_s = linger_ms / 1000
        self.max_batch_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        # Without idempotence the broker detects no gap: one batch in flight per partition keeps
        # the order when a batch fails and a later one would have succeeded.
        self.max_in_flight = max_in_flight if idempotence else 1
        # After a lost connection, one batch in flight per partition until one is acknowledged:
        # rounds that cannot complete between two disconnections would otherwise be re-sent in
        # vain until the delivery timeout (message_id re-sends cost as much as the first send).
        self._cautious = False
        # Sequence numbers count messages; in message_id mode they count batches.
        self._per_message_seq = idempotence == "sequence"
        self.window = window
        self.max_message_bytes = max_message_bytes
        self.delivery_timeout_s = delivery_timeout_ms / 1000
        self.retry_backoff_s = retry_backoff_ms / 1000
        self.max_buffered_messages = max_buffered_messages
        self.max_block_s = max_block_ms / 1000
        self.min_replicas = min_replicas
        self.ack_timeout_ms = ack_timeout_ms
        self._selector = partitioner
        self._sticky = StickyPartitioner()

        self._keys = broker.keys
        self._scripts = broker.scripts
        self._client = broker.client
        self._cond = threading.Condition(threading.Lock())
        self._partitions: dict[tuple[str, int], _PartitionState] = {}
        self._topics: dict[str, TopicConfig] = {}
        self._registered_topics: set[str] = set()
        self._buffered = 0
        self._flush_requested = False
        self._closing = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._needs_new_identity = False

        self._check_acks_supported()
        self.producer_id = 0
        self.epoch = 0
        self._init_identity()
        self._ids: SnowflakeGenerator | None = None
        if idempotence == "message_id":
            from redisq.snowflake import SnowflakeGenerator

            self._ids = SnowflakeGenerator(self._client, self._keys, self._scripts)
        self._sender = threading.Thread(target=self._run, name="redisq-sender", daemon=True)
        self._sender.start()

    def __repr__(self) -> str:
        return (
            f"<redisq.Producer name={self.name!r} pid={self.producer_id} epoch={self.epoch} "
            f"idempotence={self.idempotence!r} acks={self.acks!r}>"
        )

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()

    # -- identity and fencing ------------------------------------------------------------------
    def _check_acks_supported(self) -> None:
        if self.acks == "fsync" and not self.broker.is_cluster:
            try:  # returns at once (nothing to wait for); an unknown command on Redis < 7.2
                self._client.execute_command("WAITAOF", 0, 0, 0)
            except redis.ResponseError as exc:
                raise UnsupportedServer(
                    f'acks="fsync" needs WAITAOF (Redis >= 7.2, Valkey >= 8); {self.broker.server} '
                    "does not have it"
                ) from exc
            if not int(self._client.info("persistence").get("aof_enabled", 0)):
                # WAITAOF 1 would fail on every batch until the delivery timeout.
                raise UnsupportedServer('acks="fsync" needs the server to run with appendonly yes')
        if self.acks == "fsync" and self.broker.is_cluster:
            raise UnsupportedServer(
                'acks="fsync" is not supported on Redis Cluster yet; use acks="replicas"'
            )

    def _init_identity(self) -> None:
        """PID (and epoch) from Redis; a named producer fences its older instances now."""
        if self.name is None:
            self.producer_id = int(self._client.incr(self._keys.producer_id_counter()))
            self.epoch = 0
            return
        reply = self._scripts.call(
            "init_producer",
            [
                self._keys.named_producer(self.name),
                self._keys.producer_id_counter(),
                self._keys.named_producer_topics(self.name),
            ],
            [REGISTRY_TTL_MS],
        )
        self.producer_id, self.epoch = int(reply[0]), int(reply[1])
        topics = [t.decode() for t in reply[2:]]
        if self.idempotence == "sequence":
            self._fence_topics(topics)
        log.info("producer %s: pid %d epoch %d", self.name, self.producer_id, self.epoch)

    def _fence_topics(self, topics: list[str]) -> None:
        """Raise the stored epoch on every partition of topics an older instance wrote to."""
        for topic in topics:
            try:
                config = self.broker.topic_config(topic, refresh=True)
            except errors.TopicNotFound:
                continue
            for p in range(config.partitions):
                self._scripts.call(
                    "fence_producer",
                    [self._keys.producer_state(topic, p, self.producer_id)],
                    [self.epoch, config.state_ttl_ms],
                    topic=topic,
                )

    def _topic(self, topic: str) -> TopicConfig:
        config = self._topics.get(topic)
        if config is None:
            config = self.broker.topic_config(topic)
            if self.name is not None and self.idempotence == "sequence":
                self._register_topic(topic)
            self._topics[topic] = config
        return config

    def _register_topic(self, topic: str) -> None:
        if topic in self._registered_topics:
            return
        name = self.name or ""
        try:
            self._scripts.call(
                "register_producer_topic",
                [self._keys.named_producer(name), self._keys.named_producer_topics(name)],
                [self.epoch, topic, REGISTRY_TTL_MS],
                topic=topic,
            )
        except ProducerFenced as exc:
            self._fatal = exc
            raise
        self._registered_topics.add(topic)

    # -- sending -------------------------------------------------------------------------------
    def send_async(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None,
        partition: int | None = None,
    ) -> SendFuture:
        """Queue a message; the returned future's result() is its RecordMetadata.

        Raises at once (and queues nothing) on bad input: TypeError for a value, key or header
        of the wrong type, MessageTooLarge, TopicNotFound, PartitionOutOfRange.
        """
        # This is the hot path: the common case (bytes value and key, no headers) is kept to a
        # handful of type checks, one CRC-32 and one locked append.
        if self._fatal is not None or self._closing:
            raise self._fatal or ProducerClosed("send after close()")
        if type(value) is not bytes:
            value = _as_bytes("value", value)
        size = len(value)
        if key is not None:
            if type(key) is not bytes:
                key = _as_bytes("key", key)
            if not key:
                raise ValueError("key must not be empty; use key=None for a message without a key")
            size += len(key)
        headers_b = encode_headers(headers) if headers else None
        if headers_b:
            size += len(headers_b)
        if size > self.max_message_bytes:
            raise MessageTooLarge(size, self.max_message_bytes)
        config = self._topics.get(topic) or self._topic(topic)
        partitions = config.partitions

        mid: bytes | None = None
        if message_id is not None:
            if isinstance(message_id, int) and not isinstance(message_id, bool):
                mid = b"%d" % message_id
            else:
                mid = _as_bytes("message_id", message_id)
            if not mid:
                raise ValueError("message_id must not be empty")
        elif self._ids is not None:
            mid = b"%d" % self._ids.next_id()

        if partition is not None:
            partition = self.broker.check_partition(topic, partition)
        elif self._selector is not None:
            partition = self._selector(topic, key, value, partitions)
            if type(partition) is not int or not 0 <= partition < partitions:
                raise errors.PartitionOutOfRange(topic, partition, partitions)
        elif key is not None:
            partition = partition_for_key(key, partitions)
        elif mid is not None and self._ids is not None:
            partition = partition_for_key(mid, partitions)  # an id's dedup scope is its partition
        else:
            partition = self._sticky.partition(topic, partitions)

        layout = _LAYOUTS[key is not None, headers_b is not None, mid is not None]

        with self._cond:
            if self._buffered >= self.max_buffered_messages:
                self._wait_for_buffer_space()
            state = self._partitions.get((topic, partition))
            if state is None:
                state = self._partitions[(topic, partition)] = _PartitionState()
            batch = state.open
            if batch is not None and (
                batch.layout != layout
                or batch.count >= self.max_batch_messages
                or batch.nbytes + size > self.max_batch_bytes
            ):
                self._seal(state)
                batch = None
            if batch is None:
                batch = state.open = _Batch(config, partition, layout)
                self._cond.notify()  # start the linger clock
            # Encoded once, here, as RESP bulk strings: the sender only joins them.
            args = batch.args
            if key is not None:
                args += (_bulk_header(len(key)), key, b"\r\n")
            args += (_bulk_header(len(value)), value, b"\r\n")
            if headers_b:
                args += (_bulk_header(len(headers_b)), headers_b, b"\r\n")
            if mid is not None:
                args += (_bulk_header(len(mid)), mid, b"\r\n")
            index = batch.count
            batch.count = index + 1
            batch.nbytes += size
            self._buffered += 1
            if index + 1 >= self.max_batch_messages:
                self._seal(state)
        return SendFuture(batch, index)

    def _wait_for_buffer_space(self) -> None:
        """Block (lock held) while max_buffered_messages are waiting, up to max_block_ms."""
        deadline = time.monotonic() + self.max_block_s
        while self._buffered >= self.max_buffered_messages and self._fatal is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.RedisqError(
                    f"buffer full ({self.max_buffered_messages} messages) for "
                    f"max_block_ms={int(self.max_block_s * 1000)}"
                )
            self._cond.wait(remaining)
        if self._fatal is not None:
            raise self._fatal

    def send(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None,
        partition: int | None = None,
        timeout: float | None = None,
    ) -> RecordMetadata:
        """Send one message and block until it is acknowledged (no linger)."""
        future = self.send_async(topic, value, key, headers, message_id, partition)
        with self._cond:
            state = self._partitions[(topic, future._batch.partition)]
            if state.open is future._batch:
                self._seal(state)
        return future.result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until all of it is acknowledged or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._buffered > 0 and self._sender.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"flush: {self._buffered} messages still unacknowledged")
                self._cond.wait(remaining if remaining is not None else 0.5)
            self._flush_requested = False

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the sender thread and release the Snowflake worker id."""
        if self._closed:
            return
        try:
            if self._fatal is None:
                self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._sender.join(timeout=5)
            if self._ids is not None:
                self._ids.close()
            self._closed = True

    # -- the sender thread ---------------------------------------------------------------------
    def _seal(self, state: _PartitionState) -> None:
        """Freeze the open batch and give it its base sequence (lock held)."""
        batch = state.open
        if batch is None:
            return
        state.open = None
        batch.sealed = True
        batch.base_seq = state.next_seq
        batch.span = batch.count if self._per_message_seq else 1
        state.next_seq += batch.span
        state.unacked.append(batch)
        self._sticky.batch_sealed(batch.topic, batch.partition, batch.config.partitions)
        self._cond.notify_all()

    def _seal_due(self, now: float) -> float | None:
        """Seal open batches whose linger ran out (or all, on flush); return the next deadline."""
        next_deadline = None
        for state in self._partitions.values():
            batch = state.open
            if batch is None:
                continue
            due = batch.created + self.linger_s
            if self._flush_requested or self._closing or due <= now:
                self._seal(state)
            elif next_deadline is None or due < next_deadline:
                next_deadline = due
        return next_deadline

    def _pick_work(self) -> list[_Batch]:
        """The batches to write now (lock held): per partition, the unacknowledged batches after
        the ones already in flight, up to max_in_flight. A partition whose in-flight batches
        follow one that must be re-sent waits until they come back (they will be refused as
        OUT_OF_ORDER and re-sent after it, in order)."""
        work: list[_Batch] = []
        if self._needs_new_identity:
            return work
        for state in self._partitions.values():
            in_flight = 0
            seen_idle = False
            pending: list[_Batch] = []
            for batch in state.unacked:
                if batch.in_flight:
                    if seen_idle:
                        pending = []
                        break
                    in_flight += 1
                else:
                    seen_idle = True
                    if in_flight + len(pending) < (1 if self._cautious else self.max_in_flight):
                        pending.append(batch)
                    elif not in_flight:
                        break
            for batch in pending:
                batch.in_flight = True
            work += pending
        return work

    def _run(self) -> None:
        transport = Transport(self._client)
        outstanding: deque[_Round] = deque()
        backoff = self.retry_backoff_s
        try:
            while True:
                if self._needs_new_identity and not outstanding and not self._renew_identity():
                    time.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 1.0)
                    continue
                with self._cond:
                    while True:
                        next_deadline = self._seal_due(time.monotonic())
                        work = self._pick_work() if len(outstanding) < 2 else []
                        if work or outstanding:
                            break
                        if self._closing:
                            return
                        timeout = 1.0 if next_deadline is None else next_deadline - time.monotonic()
                        self._cond.wait(max(0.0, timeout))
                try:
                    if work:
                        outstanding.append(self._submit(transport, work))
                    if outstanding and (len(outstanding) >= 2 or not work):
                        # The round leaves `outstanding` only once read: if reading fails,
                        # the handler below puts its batches back.
                        progress, retry = self._collect(transport, outstanding[0])
                        outstanding.popleft()
                        if retry and not progress:
                            time.sleep(backoff * (0.5 + random.random()))
                            backoff = min(backoff * 2, 1.0)
                        elif progress:
                            backoff = self.retry_backoff_s
                            self._cautious = False
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    # Replies in flight are lost: every batch on the wire goes again (the window
                    # answers the ones that were written as duplicates, with their offsets).
                    log.warning(
                        "connection lost (%s); re-sending in-flight batches", type(exc).__name__
                    )
                    transport.reset()
                    with self._cond:
                        self._cautious = True
                        for round_ in outstanding:
                            round_.release()
                        for batch in work:
                            batch.in_flight = False
                        outstanding.clear()
                        self._expire_or_fail(exc)
                        self._cond.notify_all()
                    time.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 1.0)
                except Exception as exc:  # never let the sender die silently
                    log.exception("sender round failed")
                    transport.reset()
                    with self._cond:
                        for round_ in outstanding:
                            round_.release()
                        for batch in work:
                            batch.in_flight = False
                        outstanding.clear()
                        self._fail_all(errors.RedisqError(f"sender failed: {exc!r}"))
                        self._cond.notify_all()
        finally:
            transport.close()

    def _renew_identity(self) -> bool:
        """After failed batches of unknown outcome: a new PID (or epoch), so that no later batch
        can be taken for one of them. False if the server could not be reached."""
        try:
            self._init_identity()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("cannot take a new producer id yet: %s", type(exc).__name__)
            with self._cond:
                self._expire_or_fail(exc)
            return False
        except Exception as exc:
            with self._cond:
                self._fail_all(exc, fatal=True)
                self._cond.notify_all()
            return False
        self._needs_new_identity = False
        log.warning("producer reset: now pid %d epoch %d", self.producer_id, self.epoch)
        return True

    def _submit(self, transport: Transport, work: list[_Batch]) -> _Round:
        """Encode and write one round: per node, the batches' EVALSHA commands (behind ASKING
        after an ASK redirection), then WAIT/WAITAOF for acks="replicas"/"fsync"."""
        round_ = _Round()
        payloads: dict[str, list[bytes]] = {}
        for batch in work:
            key = self._keys.log(batch.topic, batch.partition)
            node = transport.node_for(key)
            parts = payloads.setdefault(node, [])
            entries = round_.nodes.setdefault(node, [])
            if transport.asking(key):
                transport.forget_asking(key)
                parts.append(command(b"ASKING", ()))
                entries.append(None)
            parts.append(self._batch_command(batch, key))
            entries.append(batch)
        for node, parts in payloads.items():
            if self.acks == "replicas":
                parts.append(command(b"WAIT", (self.min_replicas, self.ack_timeout_ms)))
            elif self.acks == "fsync":
                parts.append(command(b"WAITAOF", (1, 0, self.ack_timeout_ms)))
            transport.send(node, b"".join(parts))
            round_.sent.append(node)
        return round_

    def _batch_command(self, batch: _Batch, log_key: str) -> bytes:
        topic, p = batch.topic, batch.partition
        config = batch.config
        if batch.body is None:  # encoded once: a retry writes exactly the same messages
            body = batch.args
            batch.body_count = batch.count * len(batch.layout)
            if self.idempotence == "sequence":
                body = body + [
                    bulk(b"%d" % s) for s in range(batch.base_seq, batch.base_seq + batch.count)
                ]
                batch.body_count += batch.count
            batch.body = b"".join(body)
        if self.idempotence == "sequence":
            state = self._partitions[(topic, p)]
            script = self._scripts["produce_sequence"]
            keys: list[Any] = [log_key, self._keys.producer_state(topic, p, self.producer_id)]
            head: list[Any] = [
                self.producer_id,
                self.epoch,
                batch.base_seq,
                batch.count,
                state.acked_next,
                self.window,
                config.state_ttl_ms,
                config.retention_messages,
                config.retention_ms,
                batch.layout,
            ]
        elif self.idempotence == "message_id":
            window = config.dedup_window_ms
            now_ms = int(time.time() * 1000)
            bucket = now_ms // window
            script = self._scripts["produce_message_id"]
            keys = [
                log_key,
                self._keys.dedup_bucket(topic, p, bucket),
                self._keys.dedup_bucket(topic, p, bucket - 1),
                self._keys.producer_state(topic, p, self.producer_id),
            ]
            head = [
                self.producer_id,
                (bucket + 2) * window - now_ms + 1000,  # expiry of the current bucket
                config.retention_messages,
                config.retention_ms,
                batch.layout,
                batch.count,
                batch.base_seq,  # the batch number, in this mode
                self._partitions[(topic, p)].acked_next,
                config.state_ttl_ms,
            ]
        else:
            script = self._scripts["produce"]
            keys = [log_key]
            head = [
                self.producer_id,
                config.retention_messages,
                config.retention_ms,
                batch.layout,
                batch.count,
            ]
        return command(
            b"EVALSHA", [script.sha, len(keys), *keys, *head], [batch.body], batch.body_count
        )

    def _collect(self, transport: Transport, round_: _Round) -> tuple[bool, bool]:
        """Read one round's replies and settle its batches; returns (progress, retry)."""
        replies: dict[str, list[Any]] = {}
        for node in round_.sent:
            extra = 1 if self.acks != "leader" else 0
            replies[node] = transport.read(node, len(round_.nodes[node]) + extra)
        progress = retry = False
        last_error: BaseException | None = None  # named in a DeliveryTimeout
        with self._cond:
            for node, entries in round_.nodes.items():
                node_replies = replies[node]
                durable_error = (
                    self._durable_error(node_replies.pop()) if self.acks != "leader" else None
                )
                for batch, reply in zip(entries, node_replies, strict=True):
                    if batch is None:  # the reply to ASKING
                        continue
                    batch.in_flight = False
                    if batch.done.is_set():  # failed meanwhile (delivery timeout, fencing)
                        continue
                    if isinstance(reply, Redirect):
                        if reply.kind == "ASK":
                            transport.note_ask(
                                self._keys.log(batch.topic, batch.partition), reply.node
                            )
                        retry = True
                    elif isinstance(reply, Exception):
                        retry |= self._handle_error(batch, reply)
                        last_error = reply
                    elif durable_error is not None:
                        retry = True  # written, not yet durable: the retry is answered as DUP
                    else:
                        self._complete(batch, reply)
                        progress = True
                if durable_error is not None:
                    log.warning("acks=%s: %s", self.acks, durable_error)
                    last_error = durable_error
            if retry:
                self._expire_or_fail(last_error or errors.RedisqError("batches not acknowledged"))
            self._cond.notify_all()
        return progress, retry

    def _durable_error(self, reply: Any) -> BaseException | None:
        """Check the WAIT / WAITAOF reply of a node's round."""
        if isinstance(reply, Exception):
            return reply
        count = int(reply[0] if isinstance(reply, list) else reply)
        needed = self.min_replicas if self.acks == "replicas" else 1
        if count < needed:
            return NotEnoughReplicas(
                f"acks={self.acks}: {count} of {needed} acknowledged "
                f"within {self.ack_timeout_ms} ms"
            )
        return None

    def _complete(self, batch: _Batch, reply: Any) -> None:
        """Record the broker's answer for a batch (lock held)."""
        state = self._partitions[(batch.topic, batch.partition)]
        if self.idempotence == "message_id":
            batch.dup_flags = reply[0].decode()
            batch.first_id = reply[1].decode() or None
            batch.ids = [r.decode() for r in reply[2:]]  # original IDs of the duplicates
        else:
            batch.duplicate = reply[0] == b"DUP"
            batch.first_id = reply[1].decode() if len(reply) > 1 else None
        self._retire(state, batch)

    def _retire(self, state: _PartitionState, batch: _Batch) -> None:
        try:
            state.unacked.remove(batch)
        except ValueError:  # already failed by a reset
            return
        if batch.error is None and batch.base_seq + batch.span > state.acked_next:
            state.acked_next = batch.base_seq + batch.span
        self._buffered -= batch.count
        batch.finish()

    def _handle_error(self, batch: _Batch, exc: Exception) -> bool:
        """Decide about a batch whose script call failed (lock held); True means retry."""
        text = str(exc)
        if isinstance(exc, redis.exceptions.NoScriptError) or text.startswith("NOSCRIPT"):
            self._scripts.load(
                {"sequence": "produce_sequence", "message_id": "produce_message_id"}.get(
                    self.idempotence or "", "produce"
                )
            )
            return True
        mapped = (
            errors.from_reply(text, batch.topic) if isinstance(exc, redis.ResponseError) else None
        )
        if isinstance(mapped, errors.OutOfOrderSequence):
            return True  # a batch before it is missing: the whole tail goes again, in order
        if isinstance(mapped, ProducerFenced):
            self._fail_all(mapped, fatal=True)
            return False
        if isinstance(mapped, errors.TopicNotFound):
            # Checked before any write: nothing of this partition's tail was written, so its
            # sequences can be handed out again.
            self._topics.pop(batch.topic, None)
            self.broker._topic_cache.pop(batch.topic, None)
            state = self._partitions[(batch.topic, batch.partition)]
            for failed in list(state.unacked):
                failed.error = mapped
                self._retire(state, failed)
            state.next_seq = state.acked_next
            return False
        if text.startswith(_RETRIABLE_REPLIES):
            return True
        # Anything else leaves the outcome unknown: fail what is unacknowledged and start a new
        # producer identity, so no later batch can be mistaken for one of these.
        log.error("batch to %s[%d] failed: %s", batch.topic, batch.partition, text)
        self._fail_all(
            errors.RedisqError(f"write to {batch.topic}[{batch.partition}] failed: {text}")
        )
        return False

    def _expire_or_fail(self, exc: BaseException) -> None:
        """(Lock held.) Batches older than delivery_timeout_ms fail, and with them every
        unacknowledged batch: their outcome is unknown, so the producer takes a new identity."""
        now = time.monotonic()
        for state in self._partitions.values():
            if state.unacked and now - state.unacked[0].created > self.delivery_timeout_s:
                self._fail_all(
                    DeliveryTimeout(
                        f"not acknowledged within {self.delivery_timeout_s:.0f} s "
                        f"(last error: {type(exc).__name__}: {exc})"
                    )
                )
                return

    def _fail_all(self, exc: BaseException, fatal: bool = False) -> None:
        """Fail every unacknowledged batch (lock held). Unless fatal, take a new identity."""
        for state in self._partitions.values():
            for batch in list(state.unacked):
                batch.error = exc
                self._retire(state, batch)
            state.next_seq = 0
            state.acked_next = 0
        if fatal:
            self._fatal = exc
            for state in self._partitions.values():
                if state.open is not None:
                    state.open.error = exc
                    self._buffered -= state.open.count
                    state.open.finish()
                    state.open = None
            return
        # The sender takes the new identity before it writes anything else (and keeps trying
        # while the server is unreachable).
        self._needs_new_identity = True


class _Round:
    """Batches written together, per node, whose replies are still to be read."""

    __slots__ = ("nodes", "sent")

    def __init__(self) -> None:
        self.nodes: dict[str, list[_Batch | None]] = {}
        self.sent: list[str] = []

    def release(self) -> None:
        for entries in self.nodes.values():
            for batch in entries:
                if batch is not None:
                    batch.in_flight = False


# The per-message argument layout of a batch (see lua/includes/append.lua), by
# (has key, has headers, has message id).
_LAYOUTS = {
    (k, h, m): ("k" if k else "") + "v" + ("h" if h else "") + ("m" if m else "")
    for k in (False, True)
    for h in (False, True)
    for m in (False, True)
}

_BULK_HEADERS = [b"$%d\r\n" % n for n in range(4096)]


def _bulk_header(length: int) -> bytes:
    """The RESP bulk-string header for a value of this length."""
    return _BULK_HEADERS[length] if length < 4096 else b"$%d\r\n" % length


__all__ = ["Producer", "SendFuture", "RecordMetadata", "RedisqError"]
