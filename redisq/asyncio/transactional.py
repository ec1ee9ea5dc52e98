"""Transactions of the asyncio producer: the operations of redisq.transactions driven by the
event loop (see redisq.transactional for the thread driver and what each step promises).

    async with broker.producer(name="enricher", transactional=True) as p:
        async with p.transaction() as tx:
            await tx.send("orders.enriched", value, key=key)
            await tx.ack(consumer, messages)

`local` and `check` may be plain functions or coroutine functions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from redisq import tx_ops as ops
from redisq.accumulator import ProducerCore
from redisq.asyncio.client import stop_task
from redisq.asyncio.handle import AsyncBrokerHandle
from redisq.asyncio.transport import AsyncTransport
from redisq.errors import InvalidConfig, RedisqError, TransactionDecided
from redisq.protocol import Operation
from redisq.protocol import transactions as tx
from redisq.protocol.produce import BatchResult, ProducerIdentity, replicated
from redisq.records import Message, RecordMetadata
from redisq.sending import MessageEncoder
from redisq.settings import ProducerSettings
from redisq.topic import TopicConfig
from redisq.transactional import as_state, background_lease_ms, background_tick_s
from redisq.transactions import (
    RETRIABLE_ERRORS,
    Confirmation,
    TransactionCore,
    TransactionResult,
    TxConsumer,
    TxState,
    Writer,
    abort_found,
    barrier_failure,
    ends_on_refusal,
    half_message,
    half_result,
    messages_of,
    new_transaction_id,
)


class TxProducer(Protocol):
    """What the transactions need of the asyncio producer (a Protocol: no import cycle)."""

    name: str | None
    settings: ProducerSettings
    identity: ProducerIdentity | None
    broker: AsyncBrokerHandle
    _encoder: MessageEncoder
    _core: ProducerCore

    async def start(self) -> None: ...

    async def _topic_config(self, topic: str) -> TopicConfig: ...


log = logging.getLogger("redisq.transactions")
T = TypeVar("T")

_NETWORK_ERRORS = RETRIABLE_ERRORS  # redisq.transactions: cluster redirections too


async def _answer(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


class Transaction:
    """One transaction of an asyncio transactional producer (see redisq.Transaction)."""

    def __init__(self, transactions: Transactions, tx_id: str) -> None:
        self._tx = transactions
        self._producer = transactions.producer
        self._core = TransactionCore(tx_id, self._producer.settings, self._producer._core.stats)
        self._writer: Writer | None = None  # taken once the producer has its identity

    @property
    def transaction_id(self) -> str:
        return self._core.transaction_id

    @property
    def state(self) -> str:
        """ "open", "committed" or "aborted"."""
        return self._core.state

    @property
    def records(self) -> tuple[RecordMetadata, ...]:
        return self._core.records

    def __repr__(self) -> str:
        return f"<redisq.asyncio.Transaction {self.transaction_id} {self.state}>"

    async def __aenter__(self) -> Transaction:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.state != "open":
            return
        if exc_type is None:
            await self.commit()
            return
        try:
            await self.abort()
        except Exception as abort_error:  # the block's exception is the one to see
            log.warning("transaction %s: abort failed: %s", self.transaction_id, abort_error)

    async def _writer_now(self) -> Writer:
        if self._writer is None:
            await self._producer.start()
            self._writer = self._tx.writer()
        return self._writer

    async def send(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        message_id: bytes | str | int | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Add a message (checked now: TypeError, MessageTooLarge, TopicNotFound...)."""
        core = self._core
        core.check_adding()
        config = core.configs.get(topic) or await self._producer._topic_config(topic)
        encoded = self._producer._encoder.encode(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        if core.add(config, encoded):
            with ends_on_refusal(self):
                await self._stage()

    async def ack(self, consumer: TxConsumer, messages: Message | Iterable[Message]) -> None:
        """Commit these input messages' positions with the transaction (see
        redisq.Transaction.ack)."""
        self._core.check_adding()
        self._core.ack(consumer, messages)

    async def commit(self) -> tuple[RecordMetadata, ...]:
        core = self._core
        if core.state == "committed" and core.unconfirmed is not None:
            return await self._confirmed()  # again after CommitNotConfirmed
        core.check_open()
        core.committing = True
        with ends_on_refusal(self):
            await self._stage(final=True)  # registers even an empty one: the epoch is checked
            keys, tx_id, writer = self._tx.keys, core.transaction_id, await self._writer_now()
            staged, inputs = core.staging.staged, core.inputs()
            results = await self._tx.run(
                lambda: ops.commit(keys, tx_id, writer, staged, inputs, core.configs.get)
            )
        self._ended(True, results)
        core.unconfirmed = tx.barrier_keys(keys, tx_id, staged, [p for _, p in inputs])
        return await self._confirmed()

    async def _confirmed(self) -> tuple[RecordMetadata, ...]:
        core = self._core
        if core.unconfirmed is not None:
            await self._tx.confirm(core.transaction_id, core.unconfirmed)  # CommitNotConfirmed
            core.unconfirmed = None
        return core.records

    async def abort(self) -> None:
        """As redisq.Transaction.abort."""
        core = self._core
        core.check_open()
        keys, writer, positions = self._tx.keys, await self._writer_now(), core.positions()
        staged, configs = core.staging.staged, core.configs.get
        with ends_on_refusal(self):
            state, results = await self._tx.run(
                lambda: ops.abort_or_outcome(
                    keys, core.transaction_id, writer, positions, staged, configs
                )
            )
        try:
            abort_found(self, state, results)
        except TransactionDecided:  # committed first (a commit() that failed after deciding)
            core.unconfirmed = tx.barrier_keys(keys, core.transaction_id, staged, positions)
            await self._confirmed()  # its acks, as commit() would have: CommitNotConfirmed
            raise

    async def _stage(self, final: bool = False) -> None:
        new, first, register = self._core.unstaged()
        if new or (register and final):
            keys, tx_id, writer = self._tx.keys, self.transaction_id, await self._writer_now()
            await self._tx.run(
                lambda: ops.stage(keys, tx_id, writer, new, first, register=register)
            )
            self._core.staged(len(new))

    def _ended(self, committed: bool, results: list[BatchResult] | None = None) -> None:
        self._tx.current = None
        self._core.ended(committed, results)


class Transactions:
    """The transactional side of one asyncio producer."""

    def __init__(self, producer: TxProducer) -> None:
        self.producer = producer
        self.keys = producer.broker.keys
        self.settings = producer.settings
        self.current: Transaction | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._token = secrets.token_hex(8)
        self._confirming = asyncio.Lock()  # confirm(): one at a time on self._transport
        self._transport: AsyncTransport | None = None

    def writer(self) -> Writer:
        identity = self.producer.identity
        assert identity is not None
        return Writer.of(self.settings, identity)

    async def run(self, make: Callable[[], Operation[T]]) -> T:
        """As redisq.transactional.Transactions.run, on the event loop."""
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000
        backoff = self.settings.retry_backoff_ms / 1000
        while True:
            try:
                result: T = await self.producer.broker.run(make())
                return result
            except _NETWORK_ERRORS as exc:
                if time.monotonic() + backoff >= deadline:
                    raise RedisqError(
                        f"transaction step failed for delivery_timeout_ms: {exc}; the sweeper "
                        "or the producer's next instance completes what was decided"
                    ) from exc
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def confirm(self, tx_id: str, anchors: list[str]) -> None:
        """As redisq.transactional.Transactions.confirm, on the event loop."""
        s = self.settings
        if s.acks == "leader":
            return
        steps = replicated(anchors, s.acks, s.min_replicas, s.ack_timeout_ms)
        confirmation = Confirmation(tx_id, s)
        scripts = self.producer.broker.scripts
        async with self._confirming:
            if self._transport is None:
                self._transport = AsyncTransport(self.producer.broker.client, s.delivery_timeout_ms)
            transport = self._transport
            while True:
                try:
                    results = await transport.execute(steps, scripts, confirmation.deadline)
                except _NETWORK_ERRORS as exc:
                    await transport.reset()
                    await asyncio.sleep(confirmation.failed(exc, answered=False))
                    continue
                failure = barrier_failure(results, s)
                if failure is None:
                    return
                await asyncio.sleep(confirmation.failed(failure, answered=True))

    async def recover(self) -> None:
        name = self.producer.name
        if self.settings.transactional and name is not None:
            recovered = await self.run(lambda: ops.recover(self.keys, name))
            if recovered:
                log.info("producer %s: settled its predecessor's transaction %s", name, recovered)

    def begin(self) -> Transaction:
        if not self.settings.transactional:
            raise InvalidConfig("transaction() needs broker.producer(name=..., transactional=True)")
        if self.current is not None:
            raise InvalidConfig(
                f"transaction {self.current.transaction_id} is still open: one at a time"
            )
        self.current = Transaction(self, new_transaction_id())
        return self.current

    async def send_half(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        local: Callable[..., Any],
    ) -> TransactionResult:
        if self.settings.transactional_group is None:
            raise InvalidConfig(
                "send_in_transaction() needs broker.producer(transactional_group=..., check=...)"
            )
        if not callable(local):
            raise TypeError(f"local must be callable, not {type(local).__name__}")
        producer = self.producer
        config = await producer._topic_config(topic)
        encoded = producer._encoder.encode(config, value, key, headers, message_id, partition)
        staging = half_message(topic, encoded)
        tx_id, writer, keys = new_transaction_id(), self.writer(), self.keys

        def half() -> Operation[None]:
            yield from ops.stage(keys, tx_id, writer, staging.staged, 0, register=True)

        await self.run(half)
        try:
            answer = await _answer(local, tx_id, messages_of(staging.staged))
            state = as_state(answer, "local")
        except Exception:
            log.exception("transaction %s: the local transaction raised: UNKNOWN", tx_id)
            state = TxState.UNKNOWN
        if state is TxState.COMMIT or state is TxState.ROLLBACK:
            stored, results = await self.run(
                lambda: ops.settle_half(
                    keys, tx_id, writer, state, staging.staged, {topic: config}.get
                )
            )
            outcome = half_result(tx_id, stored, results, staging, producer._core.stats)
            if stored == "committed":
                await self.confirm(tx_id, tx.barrier_keys(keys, tx_id, staging.staged, []))
            return outcome
        return TransactionResult(tx_id, state)

    # -- the background duties -------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._background())

    async def close(self) -> None:
        """Abort the open transaction (see redisq.transactional.Transactions.close; a producer
        that never started staged nothing, and aborting must not start it), then stop the
        background task: a flag it checks each round, and a cancellation, again until it has
        ended (a check function or a wait_for() may swallow one cancellation)."""
        current = self.current
        if current is not None and current.state == "open" and self.producer.identity is not None:
            try:
                await current.abort()
            except Exception as exc:
                log.warning("close(): transaction %s not aborted: %s", current.transaction_id, exc)
        self._closed = True
        async with self._confirming:
            if self._transport is not None:
                await self._transport.close()
                self._transport = None
        task, self._task = self._task, None
        if task is None:
            return
        await stop_task(task, 0, lambda: None)  # its loop checks _closed
        if not task.cancelled() and task.exception() is not None:
            log.warning("transactions: the background task failed: %r", task.exception())

    async def _background(self) -> None:
        tick = background_tick_s(self.settings.check_interval_ms)
        ttl = background_lease_ms(tick)
        while not self._closed:
            await asyncio.sleep(tick)
            if self._closed or self.producer._core.fatal is not None:
                return
            try:
                await self.background_once(ttl)
            except (RedisqError, *_NETWORK_ERRORS) as exc:
                log.warning("transactions: %s", exc)

    async def background_once(self, ttl_ms: int) -> None:
        keys, token, broker = self.keys, self._token, self.producer.broker
        if await broker.run(ops.take_lease(keys.transaction_sweeper(), token, ttl_ms)):
            await broker.run(ops.sweep(keys))
        group, check = self.settings.transactional_group, self.settings.check
        if group is None or check is None:
            return
        lease = keys.transaction_checker(group)
        if not await broker.run(ops.take_lease(lease, token, ttl_ms)):
            return
        for due in await broker.run(ops.due_checks(keys, group)):
            # Renewed before each check() (see redisq.transactional.Transactions.background_once).
            if not await broker.run(ops.take_lease(lease, token, ttl_ms)):
                return
            try:
                answer = as_state(await _answer(check, due.record.tx_id, due.messages), "check")
            except Exception:
                log.exception("transaction %s: check raised: UNKNOWN", due.record.tx_id)
                answer = TxState.UNKNOWN
            state = await broker.run(
                ops.answer_check(
                    keys, due.record, answer, max_checks=self.settings.max_checks,
                    interval_ms=self.settings.check_interval_ms,
                )
            )  # fmt: skip
            log.info("transaction %s: check-back %s -> %s", due.record.tx_id, answer.value, state)
