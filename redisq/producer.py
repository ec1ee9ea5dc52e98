"""The producer (thread driver): the public API, a sender thread, and the producer's identity.

Batching, sequencing and retry decisions live in the I/O-free core (accumulator.py); this
module feeds it (messages from the caller's thread, replies from the sender thread) and carries
out its decisions with redis: a sender thread writes every partition's first `max_in_flight`
unacknowledged batches in one round per node and keeps two rounds on the wire. Anything not
acknowledged (connection error, timeout, OUT_OF_ORDER after a lost batch, NOSCRIPT after a
restart) is sent again, the very same batch with the same sequences, until it is acknowledged
or delivery_timeout_ms runs out; the broker-side window answers a re-sent batch that had been
written as a duplicate carrying its original offsets.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from redisq import errors
from redisq import identity as identity_ops
from redisq.accumulator import Batch, CoreSettings, ProducerCore
from redisq.errors import (
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
from redisq.msgid import MessageIdGenerator
from redisq.partitioner import Selector, StickyPartitioner, partition_for_key
from redisq.protocol import Operation, run_operation
from redisq.protocol import produce as protocol
from redisq.protocol.produce import LAYOUTS, ProducerIdentity, encode_message
from redisq.protocol.resp import command
from redisq.records import RecordMetadata, encode_headers
from redisq.topic import TopicConfig
from redisq.transport import Redirect, Transport

if TYPE_CHECKING:
    from redisq.broker import Broker

log = logging.getLogger("redisq.producer")
T = TypeVar("T")

IDEMPOTENCE_MODES = protocol.MODES
ACKS = ("leader", "replicas", "fsync")
_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


def _as_bytes(what: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


class _Waiter:
    """The thread driver's completion signal of one batch."""

    __slots__ = ("event", "callbacks")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.callbacks: list[tuple[int, Callable[[SendFuture], None]]] | None = None


def _finished(batch: Batch) -> None:
    waiter: _Waiter = batch.waiter
    waiter.event.set()
    if waiter.callbacks:
        for index, callback in waiter.callbacks:
            try:
                callback(SendFuture(batch, index))
            except Exception:  # a user's callback must not stop the sender
                log.exception("send callback raised")


class SendFuture:
    """The result of send_async(): result() blocks until the message is acknowledged."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: Batch, index: int) -> None:
        self._batch = batch
        self._index = index

    def done(self) -> bool:
        return bool(self._batch.waiter.event.is_set())

    def result(self, timeout: float | None = None) -> RecordMetadata:
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        if self._batch.error is not None:
            raise self._batch.error
        return self._batch.metadata(self._index)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._batch.waiter.event.wait(timeout):
            raise TimeoutError(f"no acknowledgement within {timeout} s")
        return self._batch.error

    def add_done_callback(self, callback: Callable[[SendFuture], None]) -> None:
        waiter: _Waiter = self._batch.waiter
        if waiter.event.is_set():
            callback(self)
            return
        if waiter.callbacks is None:
            waiter.callbacks = []
        waiter.callbacks.append((self._index, callback))


class Producer:
    """Sends messages to topics (DESIGN §3). Create it with `broker.producer(...)`.

    idempotence:
      "sequence"   (default) producer id + per-partition sequence numbers checked by the
                   broker; a re-sent batch is never written twice; named producers fence older
                   instances.
      "message_id" every message carries an id (yours, or a generated one); the broker writes an
                   id once per dedup window; the id routes the message when it has no key.
      None         plain appends: a retry after a lost reply may write a message twice.
    acks: "leader" (the script returned), "replicas" (WAIT min_replicas after the write, on the
      same connection), "fsync" (WAITAOF 1 0: the leader's AOF is fsynced; Redis >= 7.2).
    metadata_max_age_ms: topic metadata (partition count, retention) is read again this often,
      so added partitions are used within it.
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
        metadata_max_age_ms: int = 5_000,
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
        check_number("max_block_ms", max_block_ms, 0, 3_600_000)
        check_number("min_replicas", min_replicas, 1, 100)
        check_number("ack_timeout_ms", ack_timeout_ms, 0, 3_600_000)
        check_number("metadata_max_age_ms", metadata_max_age_ms, 100, 3_600_000)
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
        self.window = window
        self.max_message_bytes = max_message_bytes
        self.delivery_timeout_s = delivery_timeout_ms / 1000
        self.retry_backoff_s = retry_backoff_ms / 1000
        self.max_buffered_messages = max_buffered_messages
        self.max_block_s = max_block_ms / 1000
        self.min_replicas = min_replicas
        self.ack_timeout_ms = ack_timeout_ms
        self._metadata_max_age_s = metadata_max_age_ms / 1000
        self._selector = partitioner
        self._sticky = StickyPartitioner()

        self._keys = broker.keys
        self._scripts = broker.scripts
        self._client = broker.client
        self._cond = threading.Condition(threading.Lock())
        self._core = ProducerCore(
            CoreSettings(
                mode=idempotence,
                max_batch_messages=max_batch_messages,
                max_batch_bytes=max_batch_bytes,
                max_in_flight=max_in_flight,
                linger_s=linger_ms / 1000,
                delivery_timeout_s=self.delivery_timeout_s,
            ),
            on_finished=_finished,
            on_sealed=self._sealed,
        )
        self._topics: dict[str, tuple[float, TopicConfig]] = {}
        self._registered_topics: set[str] = set()
        self._closed = False

        self._check_acks_supported()
        self.identity = self._new_identity()
        self._ids = MessageIdGenerator() if idempotence == "message_id" else None
        self._sender = threading.Thread(target=self._run, name="redisq-sender", daemon=True)
        self._sender.start()

    @property
    def producer_id(self) -> int:
        return self.identity.producer_id

    @property
    def epoch(self) -> int:
        return self.identity.epoch

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
        if self.acks == "fsync" and self.broker.is_cluster:
            raise UnsupportedServer(
                'acks="fsync" is not supported on Redis Cluster yet; use acks="replicas"'
            )
        if self.acks == "fsync":
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

    def _run_operation(self, operation: Operation[T]) -> T:
        return run_operation(operation, self._scripts.execute)

    def _new_identity(self) -> ProducerIdentity:
        """A new anonymous producer's random id, or a named one's new epoch (fencing its older
        instances on every partition its name wrote to)."""
        identity = self._run_operation(
            identity_ops.new_identity(self._keys, self.name, fence=self.idempotence is not None)
        )
        log.info("producer %s: pid %d epoch %d", self.name, identity.producer_id, identity.epoch)
        return identity

    def _renew_identity(self) -> bool:
        """After batches of unknown outcome failed: a new epoch, fenced on every partition where
        a failed batch went on the wire, so none of them can land after what comes next. False
        while the server cannot be reached (the sender keeps trying, sending nothing else)."""
        with self._cond:
            abandoned = sorted(self._core.abandoned)
        try:
            identity = self._run_operation(
                identity_ops.renew_identity(
                    self._keys, self.identity, abandoned, fence=self.idempotence is not None
                )
            )
        except _NETWORK_ERRORS as exc:
            log.warning("cannot take a new epoch yet: %s", type(exc).__name__)
            with self._cond:
                self._core.last_error = exc
            return False
        except Exception as exc:  # ProducerFenced: a newer instance took the name
            with self._cond:
                self._core.fail_all(exc, fatal=True)
                self._cond.notify_all()
            return False
        with self._cond:
            self.identity = identity
            self._core.identity_renewed()
            self._cond.notify_all()
        log.warning(
            "producer %s: new epoch %d after failed batches (fenced %d partitions)",
            self.name or self.producer_id,
            identity.epoch,
            len(abandoned),
        )
        return True

    def _fence_partitions(self) -> bool:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration, then store it on
        the partitions, before anything is sent there again."""
        with self._cond:
            needed = sorted(self._core.fences_needed)
        try:
            self._run_operation(identity_ops.prove_and_fence(self._keys, self.identity, needed))
        except _NETWORK_ERRORS as exc:
            log.warning("cannot fence yet: %s", type(exc).__name__)
            return False
        except Exception as exc:  # ProducerFenced: a newer instance has the name
            with self._cond:
                self._core.fail_all(exc, fatal=True)
                self._cond.notify_all()
            return False
        with self._cond:
            for key in needed:
                self._core.partition_fenced(key)
        return True

    # -- topic metadata --------------------------------------------------------------------------
    def _topic_config(self, topic: str) -> TopicConfig:
        """The topic's metadata, read again after metadata_max_age_ms (added partitions)."""
        cached = self._topics.get(topic)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._metadata_max_age_s:
            return cached[1]
        try:
            config = self._run_operation(
                identity_ops.topic_metadata(
                    self._keys,
                    self.identity,
                    topic,
                    register=self.name is not None and self.idempotence is not None,
                )
            )
        except ProducerFenced as exc:
            with self._cond:
                self._core.fail_all(exc, fatal=True)
            raise
        self._topics[topic] = (now, config)
        return config

    # -- sending ---------------------------------------------------------------------------------
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
        core = self._core
        if core.fatal is not None or core.closing:
            raise core.fatal or ProducerClosed("send after close()")
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
        cached = self._topics.get(topic)
        if cached is None or time.monotonic() - cached[0] >= self._metadata_max_age_s:
            config = self._topic_config(topic)
        else:
            config = cached[1]
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
            mid = self._ids.next_id()

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

        layout = LAYOUTS[key is not None, headers_b is not None, mid is not None]
        parts = encode_message(key, value, headers_b, mid)  # encoded once: the sender joins them

        with self._cond:
            if core.buffered >= self.max_buffered_messages:
                self._wait_for_buffer_space()
            batch, index, opened = core.append(
                config, partition, layout, parts, size, time.monotonic()
            )
            if batch.waiter is None:
                batch.waiter = _Waiter()
            if opened or batch.sealed:
                self._cond.notify()  # start the linger clock, or send a full batch
        return SendFuture(batch, index)

    def _sealed(self, batch: Batch) -> None:
        self._sticky.batch_sealed(batch.topic, batch.partition, batch.config.partitions)

    def _wait_for_buffer_space(self) -> None:
        """Block (lock held) while max_buffered_messages are waiting, up to max_block_ms."""
        core = self._core
        deadline = time.monotonic() + self.max_block_s
        while core.buffered >= self.max_buffered_messages and core.fatal is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.RedisqError(
                    f"buffer full ({self.max_buffered_messages} messages) for "
                    f"max_block_ms={int(self.max_block_s * 1000)}"
                )
            self._cond.wait(remaining)
        if core.fatal is not None:
            raise core.fatal

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
            self._core.seal_batch(future._batch)
            self._cond.notify_all()
        return future.result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until all of it is acknowledged or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self._core
        with self._cond:
            core.flush_requested = True
            self._cond.notify_all()
            try:
                while core.buffered > 0 and self._sender.is_alive():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"flush: {core.buffered} messages still unacknowledged")
                    self._cond.wait(remaining if remaining is not None else 0.5)
            finally:
                core.flush_requested = False

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the sender thread."""
        if self._closed:
            return
        try:
            if self._core.fatal is None:
                self.flush(timeout)
        finally:
            with self._cond:
                self._core.closing = True
                self._cond.notify_all()
            self._sender.join(timeout=5)
            self._closed = True

    # -- the sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        core = self._core
        transport = Transport(self._client, socket_timeout_s=min(30.0, self.delivery_timeout_s))
        outstanding: deque[_Round] = deque()
        backoff = self.retry_backoff_s
        try:
            while True:
                if core.fatal is not None:
                    return  # fenced: every batch has failed with the error
                if not outstanding and (core.needs_new_identity or core.fences_needed):
                    renewed = (
                        self._renew_identity()
                        if core.needs_new_identity
                        else self._fence_partitions()
                    )
                    if not renewed and core.fatal is None:
                        with self._cond:
                            core.expire(time.monotonic())
                            self._cond.notify_all()
                        time.sleep(backoff * (0.5 + random.random()))
                        backoff = min(backoff * 2, 1.0)
                    continue
                if core.reload_scripts:
                    self._reload_scripts()
                with self._cond:
                    while True:
                        next_deadline = core.seal_due(time.monotonic())
                        work = core.pick_work() if len(outstanding) < 2 else []
                        if work or outstanding:
                            break
                        if core.closing or (core.fatal is not None and core.buffered == 0):
                            return
                        if core.needs_new_identity or core.fences_needed:
                            break
                        timeout = 1.0 if next_deadline is None else next_deadline - time.monotonic()
                        self._cond.wait(max(0.0, timeout))
                    deadline = core.oldest_deadline()
                if not work and not outstanding:
                    continue
                try:
                    if work:
                        outstanding.append(self._submit(transport, work))
                    if outstanding and (len(outstanding) >= 2 or not work):
                        # The round leaves `outstanding` only once read: if reading fails,
                        # the handler below puts its batches back.
                        progress, retry = self._collect(transport, outstanding[0], deadline)
                        outstanding.popleft()
                        if retry and not progress:
                            time.sleep(backoff * (0.5 + random.random()))
                            backoff = min(backoff * 2, 1.0)
                        elif progress:
                            backoff = self.retry_backoff_s
                except _NETWORK_ERRORS as exc:
                    # Replies in flight are lost: every batch on the wire goes again (the window
                    # answers the ones that were written as duplicates, with their offsets), or
                    # fails once its delivery timeout has passed.
                    log.warning("connection lost (%s); re-sending in-flight batches", exc)
                    transport.reset()
                    with self._cond:
                        for round_ in outstanding:
                            core.connection_lost(round_.batches(), exc)
                        core.connection_lost(work, exc)  # picked, maybe partly written
                        outstanding.clear()
                        core.expire(time.monotonic())
                        self._cond.notify_all()
                    time.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 1.0)
                except Exception as exc:  # never let the sender die silently
                    log.exception("sender round failed")
                    transport.reset()
                    with self._cond:
                        for round_ in outstanding:
                            core.connection_lost(round_.batches(), exc)
                        core.connection_lost(work, exc)
                        outstanding.clear()
                        core.fail_unknown(errors.RedisqError(f"sender failed: {exc!r}"), None)
                        self._cond.notify_all()
        finally:
            transport.close()

    def _reload_scripts(self) -> None:
        """NOSCRIPT (a restarted or flushed server): load the produce script again."""
        name = {"sequence": "produce_sequence", "message_id": "produce_message_id"}.get(
            self.idempotence or "", "produce"
        )
        try:
            self._scripts.load(name)
            self._scripts.load("fence_producer")
            self._core.reload_scripts = False
        except _NETWORK_ERRORS as exc:
            log.warning("cannot load scripts yet: %s", type(exc).__name__)

    def _submit(self, transport: Transport, work: list[Batch]) -> _Round:
        """Encode and write one round: per node, the batches' EVALSHA commands (behind ASKING
        after an ASK redirection), then WAIT/WAITAOF for acks="replicas"/"fsync"."""
        round_ = _Round()
        payloads: dict[str, list[bytes]] = {}
        core = self._core
        for batch in work:
            call = protocol.produce(
                self._keys,
                self.idempotence,
                self.identity,
                batch.config,
                batch,
                acked_next=core.acked_next(batch),
                window=self.window,
            )
            key = call.keys[0]
            node = transport.node_for(key)
            parts = payloads.setdefault(node, [])
            entries = round_.nodes.setdefault(node, [])
            if transport.asking(key):
                transport.forget_asking(key)
                parts.append(command(b"ASKING", ()))
                entries.append(None)
            parts.append(self._scripts.pack(call))
            entries.append((batch, call.decode))
        for node, parts in payloads.items():
            if self.acks == "replicas":
                parts.append(command(b"WAIT", (self.min_replicas, self.ack_timeout_ms)))
            elif self.acks == "fsync":
                parts.append(command(b"WAITAOF", (1, 0, self.ack_timeout_ms)))
            transport.send(node, b"".join(parts))
            round_.sent.append(node)
        return round_

    def _collect(
        self, transport: Transport, round_: _Round, deadline: float | None
    ) -> tuple[bool, bool]:
        """Read one round's replies (waiting no later than deadline: the oldest batch's delivery
        timeout) and settle its batches; returns (progress, retry)."""
        core = self._core
        replies: dict[str, list[Any]] = {}
        extra = 1 if self.acks != "leader" else 0
        for node in round_.sent:
            replies[node] = transport.read(node, len(round_.nodes[node]) + extra, deadline)
        progress = retry = False
        with self._cond:
            for node, entries in round_.nodes.items():
                node_replies = replies[node]
                durable_error = self._durable_error(node_replies.pop()) if extra else None
                for entry, reply in zip(entries, node_replies, strict=True):
                    if entry is None:  # the reply to ASKING
                        continue
                    batch, decode = entry
                    if isinstance(reply, Redirect):
                        if reply.kind == "ASK":
                            transport.note_ask(
                                self._keys.log(batch.topic, batch.partition), reply.node
                            )
                        core.redirected(batch)
                        retry = True
                    elif isinstance(reply, Exception):
                        mapped = (
                            errors.from_reply(str(reply), batch.topic)
                            if isinstance(reply, redis.ResponseError)
                            else None
                        )
                        if isinstance(mapped, errors.TopicNotFound):
                            # Deleted under us: the next send reads the metadata again.
                            self._topics.pop(batch.topic, None)
                            self.broker.forget_topic(batch.topic)
                        core.refused(batch, mapped or reply)
                        retry = True
                    elif durable_error is not None:
                        core.not_durable(batch, durable_error)
                        batch.unknown = True  # stored on the primary, maybe not on a replica
                        retry = True
                    else:
                        core.complete(batch, decode(reply))
                        progress = True
                if durable_error is not None:
                    log.warning("acks=%s: %s", self.acks, durable_error)
            if retry:
                core.expire(time.monotonic())
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


class _Round:
    """Batches written together, per node, whose replies are still to be read."""

    __slots__ = ("nodes", "sent")

    def __init__(self) -> None:
        self.nodes: dict[str, list[tuple[Batch, Callable[[Any], Any]] | None]] = {}
        self.sent: list[str] = []

    def batches(self) -> list[Batch]:
        return [entry[0] for entries in self.nodes.values() for entry in entries if entry]


__all__ = ["Producer", "SendFuture", "RecordMetadata", "RedisqError"]
