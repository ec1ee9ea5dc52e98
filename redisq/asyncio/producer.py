"""The asyncio producer: the same core (accumulator.py), wire codec (sending.py) and identity
operations (identity.py) as the thread producer, driven by one sender task.

    async with broker.producer(name="svc") as producer:
        meta = await producer.send("orders", b"paid", key="order-42")      # acknowledged
        future = producer.send_async("orders", b"shipped", key="order-42")  # an asyncio.Future
        await producer.flush()

send_async() never blocks the event loop: it checks and encodes the message and queues it. A
message for a topic whose metadata is not loaded yet waits (in order) until it is; errors about
the topic (TopicNotFound) then come through its future. With max_buffered_messages waiting,
send_async() raises at once (send() waits for room).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Unpack

import redis

from redisq import errors, metrics
from redisq import identity as identity_ops
from redisq.accumulator import Batch, CoreSettings, ProducerCore
from redisq.asyncio.client import (
    await_expiring,
    settle_futures,
    single_flight,
    stop_task,
    wait_acknowledged,
)
from redisq.asyncio.delayed_sender import DelayedSender
from redisq.asyncio.transactional import Transaction, Transactions
from redisq.asyncio.transport import AsyncTransport
from redisq.errors import InvalidConfig, ProducerClosed, ProducerFenced
from redisq.futures import check_timeout, remaining
from redisq.keys import validate_name, validate_topic
from redisq.protocol.produce import ProducerIdentity
from redisq.records import RecordMetadata
from redisq.sending import MessageEncoder, Round, refuse_timestamp_with_delay, scripts_for
from redisq.settings import ProducerOptions, ProducerSettings
from redisq.stats import ProducerStats
from redisq.topic import TopicConfig
from redisq.transactions import TransactionResult

if TYPE_CHECKING:
    from redisq.asyncio.handle import AsyncBrokerHandle as Broker

log = logging.getLogger("redisq.asyncio.producer")

_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)

_Send = tuple[str, Any, Any, Any, Any, Any, int | None, "asyncio.Future[RecordMetadata]"]


class Producer:
    """An asyncio producer; see redisq.Producer for the options and the guarantees."""

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
        self._core = ProducerCore(
            CoreSettings(
                mode=settings.idempotence,
                max_batch_messages=settings.max_batch_messages,
                max_batch_bytes=settings.max_batch_bytes,
                max_in_flight=settings.max_in_flight,
                linger_s=settings.linger_ms / 1000,
                delivery_timeout_s=settings.delivery_timeout_ms / 1000,
            ),
            on_finished=self._on_finished,
            on_sealed=self._encoder.batch_sealed,
        )
        self.identity: ProducerIdentity | None = None
        if settings.transactional and name is None:
            raise InvalidConfig("transactional=True needs a name: instances of a name fence")
        self._transactions = Transactions(self) if settings.transactions else None
        self._topics: dict[str, tuple[float, TopicConfig]] = {}
        self._loading: dict[str, asyncio.Future[TopicConfig]] = {}  # reads under way
        self._refreshing: set[str] = set()
        self._deferred: deque[_Send] = deque()
        self._drainer: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._closed = False
        self._halted = False  # close(): the sender stops at once (see client.stop_task)
        self._delayed = DelayedSender(  # send(..., delay_ms=...): redisq.delayed
            broker, settings, self._encoder, self._topic_config, self._topics,
            lambda: self.identity, self._core.stats,
        )  # fmt: skip

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
        return (
            f"<redisq.asyncio.Producer name={self.name!r} pid={self.producer_id} "
            f"epoch={self.epoch} idempotence={self.idempotence!r} acks={self.acks!r}>"
        )

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- start: identity -------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the producer's identity (a named one fences its older instances) and start the
        sender task. Idempotent; send() and send_async() start the producer themselves.
        ProducerClosed after close(): a closed instance must not take a new identity (a named
        one would fence the live instance of its name)."""
        self._refuse_if_closed("start()")
        if self._sender is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        await self._check_acks_supported()
        self.identity = await self.broker.run(
            identity_ops.new_identity(
                self._keys, self.name, fence=self.settings.idempotence is not None
            )
        )
        if self._transactions is not None:
            await self._transactions.recover()
            self._transactions.start()
        self._sender = asyncio.ensure_future(self._run())
        metrics.track(self)  # its counters in redisq.metrics.collect(), held weakly

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed or self._core.closing:
            raise ProducerClosed(f"{what} after close()")

    def _refuse_unsendable(self) -> None:
        """A send after close() (ProducerClosed) or after a fatal error (that error)."""
        self._refuse_if_closed("send")
        if self._core.fatal is not None:
            raise self._core.fatal

    async def _check_acks_supported(self) -> None:
        await self.broker.run(identity_ops.check_acks(self.acks, server=self.broker.server))

    # -- topic metadata --------------------------------------------------------------------------
    async def _topic_config(self, topic: str) -> TopicConfig:
        cached = self._topics.get(topic)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._metadata_max_age_s:
            return cached[1]
        # One read per topic at a time, shared by every send waiting for it: 300 gathered
        # first sends made 300 reads at once (past the connection pool's limit).
        return await single_flight(self._loading, topic, lambda: self._read_topic_config(topic))

    async def _read_topic_config(self, topic: str) -> TopicConfig:
        await self.start()
        assert self.identity is not None
        try:
            register = self.name is not None and self.idempotence is not None
            config: TopicConfig = await self.broker.run(
                identity_ops.topic_metadata(self._keys, self.identity, topic, register=register)
            )
        except ProducerFenced as exc:
            self._core.fail_all(exc, fatal=True)
            raise
        self._topics[topic] = (time.monotonic(), config)
        return config

    def _refresh_if_stale(self, topic: str, read_at: float) -> None:
        """Metadata read before metadata_max_age_ms is read again in the background; the send
        goes now, by what was read."""
        if time.monotonic() - read_at >= self._metadata_max_age_s and topic not in self._refreshing:
            self._refreshing.add(topic)
            asyncio.ensure_future(self._refresh(topic))

    async def _refresh(self, topic: str) -> None:
        try:
            await self._topic_config(topic)
        except Exception as exc:  # the next send reports it
            log.debug("metadata refresh of %s failed: %s", topic, exc)
        finally:
            self._refreshing.discard(topic)

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
    ) -> asyncio.Future[RecordMetadata]:
        """Queue a message; the future's result is its RecordMetadata (see the module doc).
        delay_ms / deliver_at (tz-aware): stored now, appended when due (see redisq.delayed).
        timestamp_ms: the message's own time (see redisq.Producer.send_async)."""
        core = self._core
        self._refuse_unsendable()
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            args = (topic, value, key, headers, message_id, partition, delay_ms, deliver_at)
            return self._delayed.send_async(*args)
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        cached = self._topics.get(topic)
        if cached is None or self._deferred or self._sender is None:
            # Type and size checks now, whatever the topic; routing once its metadata is in. The
            # buffer counts the deferred messages: one accepted here is one the buffer has room
            # for when its topic is loaded.
            validate_topic(topic)
            self._encoder.check(value, key, headers, message_id, partition, timestamp_ms)
            if core.buffered + len(self._deferred) >= self.settings.max_buffered_messages:
                raise self._buffer_full()
            self._deferred.append(
                (topic, value, key, headers, message_id, partition, timestamp_ms, future)
            )
            if self._drainer is None or self._drainer.done():
                self._drainer = asyncio.ensure_future(self._drain_deferred())
            return future
        self._refresh_if_stale(topic, cached[0])
        self._enqueue(cached[1], value, key, headers, message_id, partition, future, timestamp_ms)
        return future

    def _buffer_full(self) -> errors.RedisqError:
        return errors.RedisqError(
            f"buffer full ({self.settings.max_buffered_messages} messages): await send() or "
            "flush() to wait for room"
        )

    def _enqueue(
        self,
        config: TopicConfig,
        value: Any,
        key: Any,
        headers: Any,
        message_id: Any,
        partition: Any,
        future: asyncio.Future[RecordMetadata],
        timestamp_ms: int | None = None,
    ) -> Batch:
        core = self._core
        if core.buffered >= self.settings.max_buffered_messages:
            raise self._buffer_full()
        p, layout, parts, size = self._encoder.encode_fast(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        batch, _, opened = core.append(config, p, layout, parts, size, time.monotonic())
        if batch.waiter is None:
            batch.waiter = []
        batch.waiter.append(future)  # at the message's index in the batch
        if opened or batch.sealed:
            self._wake.set()
        return batch

    async def _drain_deferred(self) -> None:
        """Messages queued before their topic's metadata was loaded, in send order."""
        while self._deferred:
            topic, value, key, headers, message_id, partition, stamp, future = self._deferred[0]
            try:
                config = await self._topic_config(topic)
                self._enqueue(config, value, key, headers, message_id, partition, future, stamp)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            self._deferred.popleft()
        self._progress.set()

    async def send(
        self, topic: str, value: bytes | str, key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None, partition: int | None = None,
        timeout: float | None = None, delay_ms: int | None = None,
        deliver_at: datetime | None = None, timestamp_ms: int | None = None,
    ) -> RecordMetadata:  # fmt: skip
        """Send one message and wait until it is acknowledged (no linger). timeout: as
        redisq.Producer.send, seconds to wait (None: until delivery_timeout_ms decides); a
        TimeoutError then says nothing about the message, which may still be delivered."""
        timeout = check_timeout(timeout)  # before queuing: a bad timeout must not follow a write
        core = self._core
        self._refuse_unsendable()  # before _topic_config(), which starts it
        if delay_ms is not None or deliver_at is not None:
            refuse_timestamp_with_delay(timestamp_ms)
            args = (topic, value, key, headers, message_id, partition, delay_ms, deliver_at)
            return await self._delayed.send(*args, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for again in (False, True):  # once more after PartitionGone: routed by stale metadata
            cached = self._topics.get(topic)
            if cached is None:
                config = await self._topic_config(topic)  # TopicNotFound, ProducerFenced raise
            else:
                config = cached[1]
                self._refresh_if_stale(topic, cached[0])
            while self._deferred:  # keep the order of earlier send_async() calls
                await self._wait_progress()
            while self._core.buffered >= self.settings.max_buffered_messages:
                if self._core.fatal is not None:
                    raise self._core.fatal
                await self._wait_progress()
            self._refuse_unsendable()  # closed while this send waited
            future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
            batch = self._enqueue(
                config, value, key, headers, message_id, partition, future, timestamp_ms
            )
            core.seal_batch(batch)
            self._wake.set()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await wait_acknowledged(future, left)
            except errors.PartitionGone:
                if again:
                    raise
        raise AssertionError("unreachable")

    async def _wait_progress(self) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), 0.5)
        except TimeoutError:
            pass

    async def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until all of it is acknowledged or failed.
        After close() there is nothing buffered: it returns at once."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self._core
        core.flush_requested = True
        self._wake.set()
        try:
            while (core.buffered > 0 or self._deferred) and core.fatal is None:
                if self._sender is not None and self._sender.done():
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"flush: {core.buffered} messages still unacknowledged")
                await self._wait_progress()
        finally:
            core.flush_requested = False
        await self._delayed.flush(None if deadline is None else deadline - time.monotonic())

    def transaction(self) -> Transaction:
        """A transaction (Kafka style; `transactional=True`): `async with p.transaction() as
        tx` commits on a clean exit and aborts on an exception (see redisq.Transaction)."""
        self._refuse_if_closed("transaction()")
        return self._tx().begin()

    async def send_in_transaction(
        self, topic: str, value: bytes | str, key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None, partition: int | None = None,
        *, local: Callable[..., Any],
    ) -> TransactionResult:  # fmt: skip
        """A half message (RocketMQ style; see redisq.Producer.send_in_transaction); local may
        be a coroutine function."""
        self._refuse_if_closed("send_in_transaction()")
        await self.start()
        return await self._tx().send_half(topic, value, key, headers, message_id, partition, local)

    def _tx(self) -> Transactions:
        if self._transactions is None:
            raise InvalidConfig("this producer is not transactional (transactional=True or "
                                "transactional_group=...)")  # fmt: skip
        return self._transactions

    async def close(self, timeout: float | None = None) -> None:
        """Abort an open transaction, flush, then stop the sender task."""
        timeout = check_timeout(timeout)
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._starting is not None and not self._starting.done():
            # A start() under way ends first: its sender task is then stopped below, not
            # left running with the identity it took.
            await asyncio.wait({self._starting})
        if self._transactions is not None:
            await self._transactions.close()
        try:
            if self._core.fatal is None and (self._sender is not None or self._deferred):
                await self.flush(timeout)
        finally:
            self._core.closing = True
            self._wake.set()
            try:
                grace = 5.0 if deadline is None else remaining(deadline)
                sender = self._sender
                if sender is not None and not await stop_task(sender, grace, self._halt):
                    log.warning("the sender did not stop in time at close(): stopped")
            except asyncio.CancelledError:  # close() itself cancelled: nothing left running
                self._delayed.halt()
                raise
            finally:  # what was sent and not heard back of fails, not left pending: it may or
                # may not be stored
                self._core.fail_all(
                    ProducerClosed("closed before the batch was acknowledged: it may or may "
                                   "not be stored"), fatal=True,
                )  # fmt: skip
            await self._delayed.close(None if deadline is None else remaining(deadline))
            self._closed = True

    def _halt(self) -> None:
        self._halted = True

    def _on_finished(self, batch: Batch) -> None:
        settle_futures(batch.waiter, batch.error, batch.metadata_all)
        self._progress.set()

    # -- the sender task -------------------------------------------------------------------------
    async def _run(self) -> None:
        core = self._core
        settings = self.settings
        transport = AsyncTransport(self.broker.client, settings.delivery_timeout_ms)
        outstanding: deque[Round] = deque()
        backoff = settings.retry_backoff_ms / 1000
        try:
            while not self._halted:
                if core.fatal is not None:
                    self._progress.set()
                    return
                if not outstanding and (core.needs_new_identity or core.fences_needed):
                    done = await (
                        self._renew_identity() if core.needs_new_identity else self._fence()
                    )
                    if not done and core.fatal is None:
                        self._expire_waiting()
                        await asyncio.sleep(backoff * (0.5 + random.random()))
                        backoff = min(backoff * 2, 1.0)
                    continue
                if core.reload_scripts:
                    await self._reload_scripts()
                next_deadline = core.seal_due(time.monotonic())
                work = core.pick_work() if len(outstanding) < 2 else []
                if not work and not outstanding:
                    if core.closing:
                        return
                    if core.needs_new_identity or core.fences_needed:
                        continue
                    wait = 1.0 if next_deadline is None else next_deadline - time.monotonic()
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.0, wait))
                    except TimeoutError:
                        pass
                    continue
                deadline = core.oldest_deadline()
                try:
                    if work:
                        round_ = Round.build(
                            work,
                            core=core,
                            keys=self._keys,
                            settings=settings,
                            identity=self._identity(),
                            pack=self.broker.scripts.pack,
                            router=transport,
                        )
                        outstanding.append(round_)
                        for node, payload in round_.payloads.items():
                            await transport.send(node, payload)
                    if outstanding and (len(outstanding) >= 2 or not work):
                        first = outstanding[0]
                        replies = {
                            node: await transport.read(node, first.expected_replies(node), deadline)
                            for node in first.payloads
                        }
                        outstanding.popleft()
                        progress, retry = first.settle(
                            replies,
                            core=core,
                            keys=self._keys,
                            settings=settings,
                            router=transport,
                            forget_topic=self._forget_topic,
                        )
                        if retry:
                            core.expire(time.monotonic())
                        self._progress.set()
                        if retry and not progress:
                            await asyncio.sleep(backoff * (0.5 + random.random()))
                            backoff = min(backoff * 2, 1.0)
                        elif progress:
                            backoff = settings.retry_backoff_ms / 1000
                except _NETWORK_ERRORS as exc:
                    log.warning("connection lost (%s); re-sending in-flight batches", exc)
                    await transport.reset()
                    for round_ in outstanding:
                        core.connection_lost(round_.batches(), exc)
                    core.connection_lost(work, exc)
                    outstanding.clear()
                    core.expire(time.monotonic())
                    self._progress.set()
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, 1.0)
                except Exception as exc:  # never let the sender die silently
                    log.exception("sender round failed")
                    await transport.reset()
                    for round_ in outstanding:
                        core.connection_lost(round_.batches(), exc)
                    core.connection_lost(work, exc)
                    outstanding.clear()
                    core.fail_unknown(errors.RedisqError(f"sender failed: {exc!r}"), None)
                    self._progress.set()
        finally:
            await transport.close()

    def _identity(self) -> ProducerIdentity:
        assert self.identity is not None, "the producer is started before anything is sent"
        return self.identity

    def _forget_topic(self, topic: str) -> None:
        self._topics.pop(topic, None)
        self.broker.forget_topic(topic)

    def _expire_waiting(self) -> None:
        self._core.expire_waiting(time.monotonic())
        self._progress.set()

    async def _renew_identity(self) -> bool:
        abandoned = sorted(self._core.abandoned)
        try:
            identity = await await_expiring(
                self.broker.run(
                    identity_ops.renew_identity(
                        self._keys,
                        self._identity(),
                        abandoned,
                        fence=self.settings.idempotence is not None,
                    )
                ),
                self._expire_waiting,
            )
        except Exception as exc:
            return self._identity_failed(exc, "take a new epoch")
        self.identity = identity
        self._core.identity_renewed()
        log.warning(
            "producer %s: new epoch %d after failed batches (fenced %d partitions)",
            self.name or identity.producer_id, identity.epoch, len(abandoned),
        )  # fmt: skip
        return True

    def _identity_failed(self, exc: Exception, what: str) -> bool:
        network = isinstance(exc, _NETWORK_ERRORS)  # else ProducerFenced: a newer instance
        if network:
            log.warning("cannot %s yet: %s", what, type(exc).__name__)
        self._core.identity_failed(exc, network)
        return False

    async def _fence(self) -> bool:
        needed = sorted(self._core.fences_needed)
        try:
            await await_expiring(
                self.broker.run(identity_ops.prove_and_fence(self._keys, self._identity(), needed)),
                self._expire_waiting,
            )
        except Exception as exc:
            return self._identity_failed(exc, "fence")
        for key in needed:
            self._core.partition_fenced(key)
        return True

    async def _reload_scripts(self) -> None:
        try:
            for name in scripts_for(self.settings):
                await await_expiring(self.broker.scripts.load(name), self._expire_waiting)
            self._core.reload_scripts = False
        except _NETWORK_ERRORS as exc:
            log.warning("cannot load scripts yet: %s", type(exc).__name__)
