# WARNING: generated from producer_async.py by tools/async_to_sync.py; do not edit.
# Change producer_async.py and run `python tools/async_to_sync.py`.
"""The producer: the public API, its identity, and the sender that carries out the core's
decisions (redisq.produce.sender). Both APIs run this code: the thread API's producer is
generated from it (tools/async_to_sync.py).

    async with broker.producer(name="svc") as producer:                # redisq.asyncio
        meta = await producer.send("orders", b"paid", key="order-42")  # acknowledged
        future = producer.send_async("orders", b"shipped", key="order-42")
        await producer.flush()

Batching, sequencing and retry decisions live in the I/O-free core (accumulator.py). The thread
API's producer starts in its constructor (identity, fencing, the sender thread) and its
send_async() reads a topic's metadata on the first send to it, so bad input raises there. The
asyncio producer starts on `async with`, start() or its first send, and its send_async() never
blocks the event loop: a message whose topic's metadata is not loaded yet waits, in order, until
it is, and errors about the topic then come through its future; with max_buffered_messages
waiting it raises at once (send() waits for room, up to max_block_ms, in both APIs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Unpack

from redisq import errors
from redisq.errors import InvalidConfig, ProducerClosed, ProducerFenced, TransactionInProgress
from redisq.model.keys import validate_name
from redisq.model.records import RecordMetadata
from redisq.model.stats import ProducerStats, track
from redisq.model.timeouts import check_timeout, remaining
from redisq.model.topic import TopicConfig
from redisq.model.transactions import TransactionResult
from redisq.produce.accumulator import Batch, CoreSettings, ProducerCore
from redisq.produce.delayed_sender import DelayedSender
from redisq.produce.encoder import MessageEncoder, refuse_timestamp_with_delay
from redisq.produce.futures import BatchFutures, Deferred, SendFuture, Waiter
from redisq.produce.sender import CLOSED_UNACKED, SenderLoop
from redisq.produce.transactional import Transaction, Transactions
from redisq.protocol import identity as identity_ops
from redisq.runtime import (
    Event,
    Guard,
    Task,
    single_flight,
    spawn,
    stop,
)
from redisq.server.transport import Transport
from redisq.settings import ProducerOptions, ProducerSettings

if TYPE_CHECKING:
    from redisq.server.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.producer")


class Producer(SenderLoop):
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
        if settings.transactional and name is None:
            raise InvalidConfig("transactional=True needs a name: instances of a name fence")
        self.broker = broker
        self.name = name
        self.settings = settings
        self.idempotence = settings.idempotence
        self.acks = settings.acks
        self._metadata_max_age_s = settings.metadata_max_age_ms / 1000
        self._max_buffered = settings.max_buffered_messages
        self._encoder = MessageEncoder(settings)
        self._keys = broker.keys
        # The state the callers and the sender share: the core, the caches. (No lock in asyncio,
        # where code between two awaits runs alone; a lock in the thread API.)
        self._guard = Guard()
        self._wake = Event()  # the sender: a batch to send, or to linger for
        self._progress = Event()  # callers: batches finished (flush, room in the buffer)
        # Finished batches' futures; the thread API runs their callbacks from the sender, with
        # no lock held (the core finishes batches under the guard: a callback may send again).
        self._futures = BatchFutures(self._progress.set)
        self._core = ProducerCore(
            CoreSettings(
                mode=settings.idempotence,
                max_batch_messages=settings.max_batch_messages,
                max_batch_bytes=settings.max_batch_bytes,
                max_in_flight=settings.max_in_flight,
                linger_s=settings.linger_ms / 1000,
                delivery_timeout_s=settings.delivery_timeout_ms / 1000,
            ),
            on_finished=self._futures.finished,
            on_sealed=self._encoder.batch_sealed,
        )
        self.identity: identity_ops.ProducerIdentity | None = None
        self._transactions = Transactions(self) if settings.transactions else None
        self._topics: dict[str, tuple[float, TopicConfig]] = {}  # topic -> (read at, metadata)
        self._loading: dict[Any, Any] = {}  # reads under way (asyncio: shared by their callers)
        self._refreshing: set[str] = set()
        self._deferred = Deferred(self._topic_config, self._enqueue_deferred, self._progress.set)
        self._transport: Transport | None = None
        self._sender: Task | None = None
        self._closed = False
        self._halted = False  # close() ran out of time: the sender stops at once
        self._delayed = DelayedSender(  # send(..., delay_ms=...): redisq.produce.delayed
            broker,
            settings,
            self._encoder,
            self._topic_config,
            self._topics,
            self._refresh_if_stale,
            lambda: self.identity,
            self._forget_topic,
            self._core.stats,
        )
        self.start()

    @property
    def stats(self) -> ProducerStats:
        """What this producer counted (redisq.metrics reads it)."""
        return self._core.stats

    @property
    def producer_id(self) -> int | None:
        return self.identity.producer_id if self.identity else None

    @property
    def epoch(self) -> int | None:
        return self.identity.epoch if self.identity else None

    def __repr__(self) -> str:
        api = "redisq"
        return (
            f"<{api}.Producer name={self.name!r} pid={self.producer_id} epoch={self.epoch} "
            f"idempotence={self.idempotence!r} acks={self.acks!r}>"
        )

    def __enter__(self) -> Producer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- start: identity -------------------------------------------------------------------------
    def start(self) -> None:
        """Take the producer's identity (a named one fences its older instances on every
        partition its name wrote to) and start the sender. Idempotent; the thread API's
        constructor calls it, the asyncio API's sends do. ProducerClosed after close(): a closed
        instance must not take a new identity (a named one would fence the live instance)."""
        self._refuse_if_closed("start()")
        if self._sender is None:
            single_flight(self._loading, None, self._start)

    def _start(self) -> None:
        self.broker.run(identity_ops.check_acks(self.acks, server=self.broker.server))
        identity = self.broker.run(
            identity_ops.new_identity(self._keys, self.name, fence=self.idempotence is not None)
        )
        log.info("producer %s: pid %d epoch %d", self.name, identity.producer_id, identity.epoch)
        self.identity = identity
        if self._transactions is not None:
            self._transactions.recover()
        # Its own connections, which close() can halt while the sender waits for replies.
        self._transport = Transport(self.broker.client, self.settings.delivery_timeout_ms)
        self._sender = spawn(self._run, name="redisq-sender")
        if self._transactions is not None:
            self._transactions.start()
        track(self)  # its counters in redisq.metrics.collect(), held weakly

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed or self._core.closing:
            raise ProducerClosed(f"{what} after close()")

    def _refuse_unsendable(self) -> None:
        """A send after close() (ProducerClosed), after a fatal error (that error), or while the
        producer's transaction is open (TransactionInProgress)."""
        self._refuse_if_closed("send")
        if self._core.fatal is not None:
            raise self._core.fatal
        if self._transactions is not None and self._transactions.current is not None:
            raise TransactionInProgress(
                f"transaction {self._transactions.current.transaction_id} is open: send in it "
                "(tx.send), or after commit() or abort()"
            )

    # -- topic metadata --------------------------------------------------------------------------
    def _topic_config(self, topic: str) -> TopicConfig:
        """The topic's metadata, read again after metadata_max_age_ms (added partitions)."""
        cached = self._topics.get(topic)
        if cached is not None and time.monotonic() - cached[0] < self._metadata_max_age_s:
            return cached[1]
        return single_flight(self._loading, topic, lambda: self._read_topic_config(topic))

    def _read_topic_config(self, topic: str) -> TopicConfig:
        self.start()
        assert self.identity is not None
        register = self.name is not None and self.idempotence is not None
        try:
            config: TopicConfig = self.broker.run(
                identity_ops.topic_metadata(self._keys, self.identity, topic, register=register)
            )
        except ProducerFenced as exc:
            with self._guard:
                self._core.fail_all(exc, fatal=True)
            self._wake.set()  # the sender runs the failed batches' callbacks
            raise
        self._topics[topic] = (time.monotonic(), config)
        return config

    def _refresh_if_stale(self, topic: str, read_at: float) -> None:
        """Metadata read before metadata_max_age_ms is read again in the background (added
        partitions, the registration kept alive); the send goes now, by what was read: a silent
        server must not stall send_async()."""
        if time.monotonic() - read_at < self._metadata_max_age_s:
            return
        with self._guard:
            if topic in self._refreshing:
                return
            self._refreshing.add(topic)
        spawn(self._refresh, topic, name="redisq-metadata")

    def _refresh(self, topic: str) -> None:
        try:
            self._topic_config(topic)
        except Exception as exc:  # the next refresh tries again; sends report real errors
            log.debug("metadata refresh of %s failed: %s", topic, exc)
        finally:
            with self._guard:
                self._refreshing.discard(topic)

    def _forget_topic(self, topic: str) -> None:
        self._topics.pop(topic, None)
        self.broker.forget_topic(topic)

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
    ) -> Any:
        """Queue a message; the returned future's result is its RecordMetadata (the thread API:
        a redisq.SendFuture; asyncio: an asyncio.Future).

        Raises at once (and queues nothing) on bad input: TypeError for a value, key or header
        of the wrong type, MessageTooLarge, and in the thread API TopicNotFound and
        PartitionOutOfRange (asyncio: through the future when the topic was not loaded yet).
        delay_ms / deliver_at (tz-aware): stored now, appended when due (the guide on delayed
        messages). timestamp_ms: the message's own time (Kafka's CreateTime;
        Message.timestamp_ms), else its append time.
        """
        # The hot path of the API: one check for all that refuses a send, no call on the way
        # unless something is wrong, stale or full (then _refuse_unsendable, _refresh_if_stale,
        # _enqueue say what).
        core = self._core
        txs = self._transactions
        if (
            self._closed
            or core.closing
            or core.fatal is not None
            or (txs is not None and txs.current is not None)
        ):
            self._refuse_unsendable()
        if message_id is not None and self.idempotence != "message_id":
            raise self._message_id_refused(message_id)
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            return self._delayed.send_async(
                topic, value, key, headers, message_id, partition, delay_ms, deliver_at
            )
        cached = self._topics.get(topic)
        now = time.monotonic()
        if cached is None:
            config = self._topic_config(topic)  # the first send to a topic reads it, here
        else:
            config = cached[1]
            if now - cached[0] >= self._metadata_max_age_s:
                self._refresh_if_stale(topic, cached[0])
        p, layout, parts, size = self._encoder.encode_fast(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        with self._guard:
            if core.buffered < self._max_buffered:
                batch, index, opened = core.append(config, p, layout, parts, size, now)
                if batch.waiter is None:
                    batch.waiter = Waiter()
                future = SendFuture(batch, index)
                if opened or batch.sealed:
                    self._wake.set()  # start the linger clock, or send a full batch
                return future
        return self._enqueue_encoded(config, p, layout, parts, size, None)[1]  # buffer full

    def _enqueue(
        self,
        config: TopicConfig,
        value: Any,
        key: Any,
        headers: Any,
        message_id: Any,
        partition: Any,
        timestamp_ms: int | None,
        future: Any = None,
    ) -> tuple[Batch, Any]:
        """Encode and append a message (send_async: at once, or buffer full; the thread API
        waits for room up to max_block_ms); its batch and future."""
        p, layout, parts, size = self._encoder.encode_fast(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        return self._enqueue_encoded(config, p, layout, parts, size, future)

    def _enqueue_encoded(
        self, config: TopicConfig, p: int, layout: Any, parts: Any, size: int, future: Any
    ) -> tuple[Batch, Any]:
        block_until = None
        while True:
            appended = self._append(config, p, layout, parts, size, future)
            if appended is not None:
                return appended
            if block_until is None:
                block_until = time.monotonic() + self.settings.max_block_ms / 1000
            self._wait_for_room(block_until)

    def _enqueue_deferred(self, config: TopicConfig, args: tuple[Any, ...], future: Any) -> None:
        value, key, headers, message_id, partition, timestamp_ms = args
        self._enqueue(config, value, key, headers, message_id, partition, timestamp_ms, future)

    def _append(
        self, config: TopicConfig, p: int, layout: Any, parts: Any, size: int, future: Any
    ) -> tuple[Batch, Any] | None:
        """The encoded message into its batch, if the buffer has room (None: full)."""
        core = self._core
        with self._guard:
            if core.buffered >= self._max_buffered:
                return None
            batch, index, opened = core.append(config, p, layout, parts, size, time.monotonic())
            if future is None:
                future = self._futures.new(batch, index)
            else:
                self._futures.attach(batch, index, future)
        if opened or batch.sealed:
            self._wake.set()  # start the linger clock, or send a full batch
        return batch, future

    def _wait_for_room(self, until: float) -> None:
        """Wait while max_buffered_messages wait (a fatal error raises, so does `until`)."""
        while True:
            self._progress.clear()
            if self._core.fatal is not None:
                raise self._core.fatal
            if self._core.buffered < self._max_buffered:
                return
            left = until - time.monotonic()
            if left <= 0:
                raise errors.RedisqError(
                    f"buffer full ({self._max_buffered} messages) for "
                    f"max_block_ms={self.settings.max_block_ms}"
                )
            self._progress.wait(min(left, 0.5))

    def _message_id_refused(self, message_id: object) -> InvalidConfig:
        """A message id only this producer's dedup could honour: it would be stored again on
        every repeat while each is answered duplicate=False."""
        return InvalidConfig(
            f"message_id={message_id!r} would not be deduplicated: this producer has "
            f"idempotence={self.idempotence!r}; broker.producer(idempotence='message_id') writes "
            "an id once per dedup window (nothing was sent)"
        )

    def _buffer_full(self) -> errors.RedisqError:
        return errors.RedisqError(
            f"buffer full ({self._max_buffered} messages): send() or flush() to wait for room"
        )

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
        """Send one message and wait until it is acknowledged (no linger). timeout: seconds to
        wait (None: until delivery_timeout_ms decides); a TimeoutError then says nothing about
        the message, which may still be delivered."""
        timeout = check_timeout(timeout)  # before queuing: a bad timeout must not follow a write
        self._refuse_unsendable()  # before _topic_config(), which starts it
        if message_id is not None and self.idempotence != "message_id":
            raise self._message_id_refused(message_id)
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            args = (topic, value, key, headers, message_id, partition, delay_ms, deliver_at)
            return self._delayed.send(*args, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for again in (False, True):  # once more after PartitionGone: routed by stale metadata
            cached = self._topics.get(topic)
            if cached is None:
                config = self._topic_config(topic)  # TopicNotFound, ProducerFenced raise
            else:
                config = cached[1]
                self._refresh_if_stale(topic, cached[0])
            while len(self._deferred):  # after the earlier send_async() calls (asyncio)
                self._progress.wait(0.5)
                self._progress.clear()
            p, layout, parts, size = self._encoder.encode_fast(
                config, value, key, headers, message_id, partition, timestamp_ms
            )
            block_until = time.monotonic() + self.settings.max_block_ms / 1000
            while (appended := self._append(config, p, layout, parts, size, None)) is None:
                self._wait_for_room(block_until)
            batch, future = appended
            with self._guard:
                self._core.seal_batch(batch)
            self._wake.set()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return self._futures.result(future, left)
            except errors.PartitionGone:
                if again:
                    raise
        raise AssertionError("unreachable")

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until all of it is acknowledged or failed.
        After close() there is nothing buffered: it returns at once."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self._core
        with self._guard:
            core.flush_requested = True
        self._wake.set()
        try:
            while True:
                self._progress.clear()
                waiting = core.buffered > 0 or len(self._deferred) or self._futures.pending()
                if not waiting or core.fatal is not None or not self._sender_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"flush: {core.buffered} messages still unacknowledged")
                self._progress.wait(0.5 if left is None else min(left, 0.5))
        finally:
            with self._guard:
                core.flush_requested = False
        self._delayed.flush(None if deadline is None else remaining(deadline))

    # -- transactions ----------------------------------------------------------------------------
    def transaction(self) -> Transaction:
        """Begin a transaction (Kafka style; `transactional=True`): `with producer.transaction()
        as tx` commits on a clean exit and aborts when the block raises (redisq.Transaction)."""
        self._refuse_if_closed("transaction()")
        return self._tx().begin()

    def send_in_transaction(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None,
        partition: int | None = None,
        *,
        local: Callable[..., Any],
    ) -> TransactionResult:
        """A half message (RocketMQ style; `transactional_group=`): staged, then visible only
        if local(tx_id, messages) answers TxState.COMMIT (or check-back does later). In the
        asyncio API local may be a coroutine function."""
        self._refuse_if_closed("send_in_transaction()")
        self.start()
        return self._tx().send_half(topic, value, key, headers, message_id, partition, local)

    def _tx(self) -> Transactions:
        if self._transactions is None:
            raise InvalidConfig(
                "this producer is not transactional (transactional=True or transactional_group=...)"
            )
        return self._transactions

    # -- close -----------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Abort an open transaction, flush, then stop the sender. With a timeout (seconds)
        close() returns within about that time: what is still unacknowledged then fails with
        ProducerClosed (it may or may not be stored) and flush's TimeoutError is raised."""
        timeout = check_timeout(timeout)
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._loading.get(None) is not None:
            # A start() under way ends first: its sender is then stopped below, not left
            # running with the identity it took.
            try:
                self.start()
            except Exception:  # pragma: no cover - its failure is the caller of start()'s
                pass
        if self._transactions is not None:
            self._transactions.close()
        try:
            if self._core.fatal is None and (self._sender is not None or len(self._deferred)):
                self.flush(timeout)
        finally:
            with self._guard:
                self._core.closing = True
            self._wake.set()
            sender = self._sender
            grace = 5.0 if deadline is None else remaining(deadline)
            try:
                if sender is not None and not stop(sender, grace, self._halt):
                    log.warning("the sender did not stop in time at close(): stopped")
            except BaseException:  # close() itself cancelled: nothing left running
                self._delayed.halt()
                raise
            finally:
                # What was sent and not heard back of fails, not left pending: it may or may
                # not be stored.
                with self._guard:
                    self._core.fail_all(ProducerClosed(CLOSED_UNACKED), fatal=True)
                self._futures.run()
            self._delayed.close(None if deadline is None else remaining(deadline))
            self._closed = True

    def _halt(self) -> None:
        self._halted = True
        if self._transport is not None:
            self._transport.halt()


__all__ = ["Producer", "RecordMetadata"]
