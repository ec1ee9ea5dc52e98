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

import functools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar, Unpack, cast

import redis

from redisq import errors, metrics
from redisq import identity as identity_ops
from redisq.accumulator import Batch, CoreSettings, ProducerCore
from redisq.delayed_sender import DelayedSender
from redisq.errors import (
    InvalidConfig,
    ProducerClosed,
    ProducerFenced,
    RedisqError,
)
from redisq.futures import CallbackQueue, SendFuture, Waiter, check_timeout, remaining
from redisq.keys import validate_name
from redisq.protocol import Operation, run_operation
from redisq.protocol.produce import ProducerIdentity
from redisq.records import RecordMetadata
from redisq.sending import MessageEncoder, Round, refuse_timestamp_with_delay, scripts_for
from redisq.settings import ProducerOptions, ProducerSettings
from redisq.stats import ProducerStats
from redisq.topic import TopicConfig
from redisq.transactional import LocalFn, Transaction, Transactions
from redisq.transactions import TransactionResult
from redisq.transport import Halted, Transport, call_expiring

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.producer")
T = TypeVar("T")

_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_CLOSED_UNACKED = "closed before the batch was acknowledged: it may or may not be stored"


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
        self, broker: Broker, name: str | None = None, **options: Unpack[ProducerOptions]
    ) -> None:
        settings = ProducerSettings.from_options(dict(options))
        if name is not None:
            validate_name("producer", name)
        self.broker = broker
        self.name = name
        self.settings = settings
        self.idempotence = settings.idempotence
        self.acks = settings.acks
        self._metadata_max_age_s = settings.metadata_max_age_ms / 1000
        self._encoder = MessageEncoder(settings)
        self._keys = broker.keys
        self._scripts = broker.scripts
        self._client = broker.client
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._max_buffered = settings.max_buffered_messages
        # Callbacks of finished batches, run by the sender thread with no lock held (the core
        # finishes batches under self._lock: a callback that sends again would deadlock there).
        self._callbacks = CallbackQueue(self._callbacks_ran)
        self._core = ProducerCore(
            CoreSettings(
                mode=settings.idempotence,
                max_batch_messages=settings.max_batch_messages,
                max_batch_bytes=settings.max_batch_bytes,
                max_in_flight=settings.max_in_flight,
                linger_s=settings.linger_ms / 1000,
                delivery_timeout_s=settings.delivery_timeout_ms / 1000,
            ),
            on_finished=self._callbacks.finished,
            on_sealed=self._encoder.batch_sealed,
        )
        self._topics: dict[str, tuple[float, TopicConfig]] = {}
        self._refreshing: set[str] = set()
        self._closed = False
        self._delayed = DelayedSender(  # send(..., delay_ms=...): redisq.delayed
            broker, settings, self._encoder, self._topic_config, lambda: self.identity,
            SendFuture, self._forget_topic, self._core.stats,
        )  # fmt: skip

        self._check_acks_supported()
        if settings.transactional and name is None:
            raise InvalidConfig("transactional=True needs a name: instances of a name fence")
        self.identity = self._new_identity()
        self._transactions = Transactions(self) if settings.transactions else None
        if self._transactions is not None:
            self._transactions.recover()
        # Its own connections, which close() can halt while it waits for replies.
        self._transport = Transport(self._client, settings.delivery_timeout_ms)
        self._sender = threading.Thread(target=self._run, name="redisq-sender", daemon=True)
        self._sender.start()
        if self._transactions is not None:
            self._transactions.start()
        metrics.track(self)  # its counters in redisq.metrics.collect(), held weakly

    @property
    def stats(self) -> ProducerStats:
        """What this producer counted (redisq.metrics reads it)."""
        return self._core.stats

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
        self._run_operation(identity_ops.check_acks(self.acks, server=self.broker.server))

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
        operation = identity_ops.renew_identity(
            self._keys, self.identity, abandoned, fence=self.idempotence is not None
        )
        try:
            identity = self._call(lambda: self._run_operation(operation))
        except Exception as exc:
            return self._identity_failed(exc, "take a new epoch")
        with self._cond:
            self.identity = identity
            self._core.identity_renewed()
            self._cond.notify_all()
        log.warning(
            "producer %s: new epoch %d after failed batches (fenced %d partitions)",
            self.name or self.producer_id, identity.epoch, len(abandoned),
        )  # fmt: skip
        return True

    def _identity_failed(self, exc: Exception, what: str) -> bool:
        if isinstance(exc, Halted):  # close() ran out of time: not the identity's failure
            raise exc
        network = isinstance(exc, _NETWORK_ERRORS)  # else ProducerFenced: a newer instance
        if network:
            log.warning("cannot %s yet: %s", what, type(exc).__name__)
        with self._cond:
            self._core.identity_failed(exc, network)
            self._cond.notify_all()
        return False

    def _call(self, call: Callable[[], T]) -> T:
        """call() from the sender thread, which meanwhile fails batches past their delivery
        timeout (transport.call_expiring)."""
        return call_expiring(call, self._expire_waiting, self._transport)

    def _expire_waiting(self) -> None:
        with self._cond:
            self._core.expire_waiting(time.monotonic())
            self._cond.notify_all()
        self._callbacks.run()

    def _fence_partitions(self) -> bool:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration, then store it on
        the partitions, before anything is sent there again."""
        with self._cond:
            needed = sorted(self._core.fences_needed)
        operation = identity_ops.prove_and_fence(self._keys, self.identity, needed)
        try:
            self._call(lambda: self._run_operation(operation))
        except Exception as exc:
            return self._identity_failed(exc, "fence")
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
                self._cond.notify_all()  # the sender runs the failed batches' callbacks
            raise
        self._topics[topic] = (now, config)
        return config

    def _refresh_in_background(self, topic: str) -> None:
        """Read the metadata again in a thread of its own (added partitions, the registration
        kept alive); sends go on with what is cached meanwhile."""
        with self._cond:
            if topic in self._refreshing:
                return
            self._refreshing.add(topic)

        def refresh() -> None:
            try:
                self._topic_config(topic)
            except Exception as exc:  # the next refresh tries again; sends report real errors
                log.debug("metadata refresh of %s failed: %s", topic, exc)
            finally:
                with self._cond:
                    self._refreshing.discard(topic)

        threading.Thread(target=refresh, name="redisq-metadata", daemon=True).start()

    # -- sending ---------------------------------------------------------------------------------
    def send_async(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None,
        partition: int | None = None,
        delay_ms: int | None = None,
        deliver_at: datetime | None = None,
        timestamp_ms: int | None = None,
    ) -> SendFuture:
        """Queue a message; the returned future's result() is its RecordMetadata.

        Raises at once (and queues nothing) on bad input: TypeError for a value, key or header
        of the wrong type, MessageTooLarge, TopicNotFound, PartitionOutOfRange.
        delay_ms / deliver_at (tz-aware): stored now, appended when due (see redisq.delayed).
        timestamp_ms: the message's own time (Kafka's CreateTime; Message.timestamp_ms), else
        its append time.
        """
        core = self._core
        if core.fatal is not None or core.closing:
            raise core.fatal or ProducerClosed("send after close()")
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            args = (topic, value, key, headers, message_id, partition, delay_ms, deliver_at)
            return self._delayed.send_async(*args)  # type: ignore[no-any-return]
        cached = self._topics.get(topic)
        now = time.monotonic()
        if cached is None:
            config = self._topic_config(topic)  # the first send to a topic reads it, here
        else:
            config = cached[1]
            if now - cached[0] >= self._metadata_max_age_s:
                self._refresh_in_background(topic)  # a silent server must not stall send()
        p, layout, parts, size = self._encoder.encode_fast(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        # The condition's own lock: `with self._cond` costs two Python-level calls per message.
        with self._lock:
            if core.buffered >= self._max_buffered:
                self._wait_for_buffer_space()
            batch, index, opened = core.append(config, p, layout, parts, size, now)
            if batch.waiter is None:
                batch.waiter = Waiter()
            if opened or batch.sealed:
                self._cond.notify()  # start the linger clock, or send a full batch
        return SendFuture(batch, index)

    def _wait_for_buffer_space(self) -> None:
        """Block (lock held) while max_buffered_messages are waiting, up to max_block_ms."""
        core = self._core
        limit = self.settings.max_buffered_messages
        deadline = time.monotonic() + self.settings.max_block_ms / 1000
        while core.buffered >= limit and core.fatal is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.RedisqError(
                    f"buffer full ({limit} messages) for max_block_ms={self.settings.max_block_ms}"
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
        delay_ms: int | None = None,
        deliver_at: datetime | None = None,
        timestamp_ms: int | None = None,
    ) -> RecordMetadata:
        """Send one message and block until it is acknowledged (no linger). timeout: seconds to
        wait (None: until delivery_timeout_ms decides); a TimeoutError then says nothing about
        the message, which may still be delivered."""
        timeout = check_timeout(timeout)  # before queuing: a bad timeout must not follow a write
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            if self._core.fatal is not None or self._core.closing:
                raise self._core.fatal or ProducerClosed("send after close()")
            args = (topic, value, key, headers, message_id, partition, delay_ms, deliver_at)
            return self._delayed.send(*args, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for again in (False, True):  # once more after PartitionGone: routed by stale metadata
            future = self.send_async(
                topic, value, key, headers, message_id, partition, timestamp_ms=timestamp_ms
            )
            with self._cond:
                self._core.seal_batch(cast(Batch, future._batch))
                self._cond.notify_all()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if again or not isinstance(future.exception(left), errors.PartitionGone):
                break
        return future.result(left)

    def transaction(self) -> Transaction:
        """Begin a transaction (Kafka style; `transactional=True`): see redisq.Transaction."""
        self._refuse_if_closed("transaction()")
        return self._tx().begin()

    def send_in_transaction(
        self, topic: str, value: bytes | str, key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None, partition: int | None = None,
        *, local: LocalFn,
    ) -> TransactionResult:  # fmt: skip
        """A half message (RocketMQ style; `transactional_group=`): staged, then visible only
        if local(tx_id, messages) answers TxState.COMMIT (or check-back does later)."""
        self._refuse_if_closed("send_in_transaction()")
        return self._tx().send_half(topic, value, key, headers, message_id, partition, local)

    def _tx(self) -> Transactions:
        if self._transactions is None:
            raise InvalidConfig("this producer is not transactional (transactional=True or "
                                "transactional_group=...)")  # fmt: skip
        return self._transactions

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed or self._core.closing:
            raise ProducerClosed(f"{what} after close()")

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until all of it is acknowledged or failed.
        After close() there is nothing buffered: it returns at once."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self._core
        with self._cond:
            core.flush_requested = True
            self._cond.notify_all()
            try:
                while (core.buffered > 0 or self._callbacks.pending()) and self._sender.is_alive():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"flush: {core.buffered} messages still unacknowledged")
                    self._cond.wait(remaining if remaining is not None else 0.5)
            finally:
                core.flush_requested = False
        self._delayed.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float | None = None) -> None:
        """Abort an open transaction, flush, then stop the sender thread. With a timeout (seconds)
        close() returns within about that time: what is still unacknowledged then fails with
        ProducerClosed (it may or may not be stored) and flush's TimeoutError is raised."""
        timeout = check_timeout(timeout)
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._transactions is not None:
            self._transactions.close()
        try:
            if self._core.fatal is None:
                self.flush(timeout)
        finally:
            with self._cond:
                self._core.closing = True
                self._cond.notify_all()
            self._sender.join(timeout=5 if deadline is None else remaining(deadline))
            if self._sender.is_alive():  # waiting for replies that did not come in time: it
                self._transport.halt()  # stops and fails what it holds with ProducerClosed
                self._sender.join(timeout=1)
            if not self._sender.is_alive():
                with self._cond:
                    self._core.fail_all(ProducerClosed(_CLOSED_UNACKED), fatal=True)
                self._callbacks.run()
            self._delayed.close(None if deadline is None else remaining(deadline))
            self._closed = True

    # -- the sender thread ---------------------------------------------------------------------
    def _callbacks_ran(self) -> None:
        with self._cond:
            self._cond.notify_all()  # flush() waits for the callbacks too

    def _run(self) -> None:
        core = self._core
        settings = self.settings
        transport = self._transport
        outstanding: deque[Round] = deque()
        backoff = settings.retry_backoff_ms / 1000
        try:
            while True:
                self._callbacks.run()
                if core.fatal is not None:
                    return  # fenced: every batch has failed with the error
                if not outstanding and (core.needs_new_identity or core.fences_needed):
                    renewed = (
                        self._renew_identity()
                        if core.needs_new_identity
                        else self._fence_partitions()
                    )
                    if not renewed and core.fatal is None:
                        self._expire_waiting()
                        transport.pause(backoff * (0.5 + random.random()))
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
                        self._callbacks.run()
                        if retry and not progress:
                            transport.pause(backoff * (0.5 + random.random()))
                            backoff = min(backoff * 2, 1.0)
                        elif progress:
                            backoff = settings.retry_backoff_ms / 1000
                except Halted:
                    raise
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
                    transport.pause(backoff * (0.5 + random.random()))
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
        except Halted:  # close() ran out of time: what is unacknowledged fails now
            with self._cond:
                core.fail_all(ProducerClosed(_CLOSED_UNACKED), fatal=True)
                self._cond.notify_all()
        finally:
            transport.close()
            self._callbacks.run()

    def _reload_scripts(self) -> None:
        """NOSCRIPT (a restarted or flushed server): load the produce scripts again."""
        try:
            for name in scripts_for(self.settings):
                self._call(functools.partial(self._scripts.load, name))
            self._core.reload_scripts = False
        except _NETWORK_ERRORS as exc:
            log.warning("cannot load scripts yet: %s", type(exc).__name__)

    def _submit(self, transport: Transport, work: list[Batch]) -> Round:
        """Encode and write one round (sending.Round)."""
        round_ = Round.build(
            work,
            core=self._core,
            keys=self._keys,
            settings=self.settings,
            identity=self.identity,
            pack=self._scripts.pack,
            router=transport,
        )
        for node, payload in round_.payloads.items():
            transport.send(node, payload)
        return round_

    def _collect(
        self, transport: Transport, round_: Round, deadline: float | None
    ) -> tuple[bool, bool]:
        """Read one round's replies (waiting no later than deadline: the oldest batch's delivery
        timeout) and settle its batches; returns (progress, retry)."""
        replies = {
            node: transport.read(node, round_.expected_replies(node), deadline)
            for node in round_.payloads
        }
        with self._cond:
            progress, retry = round_.settle(
                replies,
                core=self._core,
                keys=self._keys,
                settings=self.settings,
                router=transport,
                forget_topic=self._forget_topic,
            )
            if retry:
                self._core.expire(time.monotonic())
            self._cond.notify_all()
        return progress, retry

    def _forget_topic(self, topic: str) -> None:
        self._topics.pop(topic, None)
        self.broker.forget_topic(topic)


__all__ = ["Producer", "SendFuture", "RecordMetadata", "RedisqError"]
