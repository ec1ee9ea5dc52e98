# WARNING: generated from transactional_async.py by tools/async_to_sync.py; do not edit.
# Change transactional_async.py and run `python tools/async_to_sync.py`.
"""Transactions of a producer (the operations are redisq.protocol.transaction_ops; the types
and the staging, redisq.produce.transactions): Kafka's `producer.transaction()` and RocketMQ's
`producer.send_in_transaction(...)`, and a background task (a thread in the thread API, which is
generated from this module) that sweeps the registry and runs the check-back of the producer's
transactional group.

Every operation here is idempotent as a whole (a batch is staged once at its index, a decision
repeated is answered again, a roll-forward repeated writes nothing), so a connection error is
met by running it again, until delivery_timeout_ms. In the asyncio API `local` and `check` may
be coroutine functions.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from redisq.errors import InvalidConfig, ProducerClosed, RedisqError, TransactionDecided
from redisq.model.records import Message, RecordMetadata
from redisq.model.topic import TopicConfig
from redisq.model.transactions import TransactionResult, TxMessage, TxState
from redisq.produce.accumulator import ProducerCore
from redisq.produce.encoder import MessageEncoder
from redisq.produce.transactions import (
    RETRIABLE_ERRORS,
    Confirmation,
    TransactionCore,
    TxConsumer,
    abort_found,
    barrier_failure,
    ends_on_refusal,
    half_message,
    half_result,
    new_transaction_id,
)
from redisq.protocol import Operation
from redisq.protocol import transaction_ops as ops
from redisq.protocol import transactions as tx
from redisq.protocol.produce import BatchResult, ProducerIdentity, replicated
from redisq.protocol.transactions import Writer, messages_of
from redisq.runtime import (
    Event,
    Lock,
    Task,
    maybe_await,
    sleep,
    spawn,
    stop,
)
from redisq.server.handle import BrokerHandle
from redisq.server.transport import Transport
from redisq.settings import ProducerSettings


class TxProducer(Protocol):
    """What the transactions need of the producer (a Protocol: no import cycle)."""

    name: str | None
    settings: ProducerSettings
    identity: ProducerIdentity | None
    broker: BrokerHandle
    _encoder: MessageEncoder
    _core: ProducerCore

    def start(self) -> None: ...

    def _topic_config(self, topic: str) -> TopicConfig: ...


log = logging.getLogger("redisq.transactions")
T = TypeVar("T")

_NETWORK_ERRORS = RETRIABLE_ERRORS  # redisq.produce.transactions: cluster redirections too


LocalFn = Callable[[str, list[TxMessage]], Any]


def as_state(answer: Any, what: str) -> TxState:
    """A `local` / `check` answer as a TxState; anything else is UNKNOWN (and logged)."""
    if isinstance(answer, TxState):
        return answer
    if isinstance(answer, str) and answer in {s.value for s in TxState}:
        return TxState(answer)
    log.warning("%s answered %r, not a redisq.TxState: taken as UNKNOWN", what, answer)
    return TxState.UNKNOWN


def background_tick_s(check_interval_ms: int) -> float:
    """How often the background duties run: a quarter of the check interval, 50 ms to 1 s."""
    return min(1.0, max(0.05, check_interval_ms / 4000))


def background_lease_ms(tick_s: float) -> int:
    """The time to live of the background duties' leases (sweeper, checker): four rounds, 5 s at
    least. The checker renews its lease before each check() call; one slower than this lets
    another member check the same transaction meanwhile (its answer then counts nothing)."""
    return max(5_000, int(tick_s * 4000))


class Transaction:
    """One transaction of a transactional producer (Kafka style). Use it as a context manager:
    it commits on a clean exit and aborts when the block raises.

        with producer.transaction() as tx:           # asyncio: async with, await tx.send(...)
            tx.send("orders.enriched", value, key=key)
            tx.ack(consumer, messages)

    Nothing is visible to consumers before the commit; after it, every message is in its
    partition exactly once, in send order per partition, and the acked input positions are
    committed, or none of that happens. `records` then says where each message landed.
    """

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
        api = "redisq"
        return f"<{api}.Transaction {self.transaction_id} {self.state}>"

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.state != "open":
            return
        if exc_type is None:
            self.commit()
            return
        try:
            self.abort()
        except Exception as abort_error:  # the block's exception is the one to see
            log.warning("transaction %s: abort failed: %s", self.transaction_id, abort_error)

    def _writer_now(self) -> Writer:
        if self._writer is None:
            self._producer.start()
            self._writer = self._tx.writer()
        return self._writer

    def send(
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
        core.start_clock(time.monotonic())
        config = core.configs.get(topic) or self._producer._topic_config(topic)
        encoded = self._producer._encoder.encode(
            config, value, key, headers, message_id, partition, timestamp_ms
        )
        if core.add(config, encoded):
            with ends_on_refusal(self):
                self._stage()

    def ack(self, consumer: TxConsumer, messages: Message | Iterable[Message]) -> None:
        """Commit these input messages' positions with the transaction (consume-transform-
        produce): only if it commits, and only while `consumer` still holds their partitions;
        an aborted transaction makes the consumer read them again."""
        self._core.check_adding()
        self._core.start_clock(time.monotonic())
        self._core.ack(consumer, messages)

    def commit(self) -> tuple[RecordMetadata, ...]:
        """Stage what is left, decide, roll forward; TransactionAborted if it could not commit
        (its timeout passed, a newer instance started, an input partition moved)."""
        core = self._core
        if core.state == "committed" and core.unconfirmed is not None:
            return self._confirmed()  # again after CommitNotConfirmed
        core.check_open()
        core.committing = True
        with ends_on_refusal(self):
            self._stage(final=True)  # registers even an empty one: the epoch is checked
            keys, tx_id, writer = self._tx.keys, core.transaction_id, self._writer_now()
            staged, inputs = core.staging.staged, core.inputs()
            results = self._tx.run(
                lambda: ops.commit(keys, tx_id, writer, staged, inputs, core.configs.get)
            )
        self._ended(True, results)
        core.unconfirmed = tx.barrier_keys(keys, tx_id, staged, [p for _, p in inputs])
        return self._confirmed()

    def _confirmed(self) -> tuple[RecordMetadata, ...]:
        core = self._core
        if core.unconfirmed is not None:
            self._tx.confirm(core.transaction_id, core.unconfirmed)  # CommitNotConfirmed
            core.unconfirmed = None
        return core.records

    def abort(self) -> None:
        """Nothing of the transaction takes effect; the acked inputs are read again.

        TransactionDecided (state "committed") if it had been committed first: a commit() that
        failed after its decision was stored. It then stands, as records shows, and the acked
        inputs are not read again."""
        core = self._core
        core.check_open()
        keys, writer, positions = self._tx.keys, self._writer_now(), core.positions()
        staged, configs = core.staging.staged, core.configs.get
        with ends_on_refusal(self):
            state, results = self._tx.run(
                lambda: ops.abort_or_outcome(
                    keys, core.transaction_id, writer, positions, staged, configs
                )
            )
        try:
            abort_found(self, state, results)
        except TransactionDecided:  # committed first (a commit() that failed after deciding)
            core.unconfirmed = tx.barrier_keys(keys, core.transaction_id, staged, positions)
            self._confirmed()  # its acks, as commit() would have: CommitNotConfirmed
            raise

    def _stage(self, final: bool = False) -> None:
        new, first, register = self._core.unstaged()
        if new or (register and final):
            keys, tx_id, writer = self._tx.keys, self.transaction_id, self._writer_now()
            if register:  # the server's deadline: what is left of the timeout
                left = self._core.timeout_left_ms(writer.timeout_ms, time.monotonic())
                writer = dataclasses.replace(writer, timeout_ms=left)
            self._tx.run(lambda: ops.stage(keys, tx_id, writer, new, first, register=register))
            self._core.staged(len(new))

    def _ended(self, committed: bool, results: list[BatchResult] | None = None) -> None:
        self._tx.current = None
        self._core.ended(committed, results)


class Transactions:
    """The transactional side of one producer."""

    def __init__(self, producer: TxProducer) -> None:
        self.producer = producer
        self.keys = producer.broker.keys
        self.settings = producer.settings
        self.current: Transaction | None = None
        self._task: Task | None = None
        self._stop = Event()
        self._token = secrets.token_hex(8)
        self._confirming = Lock()  # confirm(): one at a time on self._transport
        self._transport: Transport | None = None

    def writer(self) -> Writer:
        identity = self.producer.identity
        assert identity is not None
        return Writer.of(self.settings, identity)

    def run(self, make: Callable[[], Operation[T]]) -> T:
        """Run an (idempotent) operation, again after a connection error, until
        delivery_timeout_ms."""
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000
        backoff = self.settings.retry_backoff_ms / 1000
        while True:
            try:
                result: T = self.producer.broker.run(make())
                return result
            except _NETWORK_ERRORS as exc:
                if time.monotonic() + backoff >= deadline:
                    raise RedisqError(
                        f"transaction step failed for delivery_timeout_ms: {exc}; the sweeper "
                        "or the producer's next instance completes what was decided"
                    ) from exc
                sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def confirm(self, tx_id: str, anchors: list[str]) -> None:
        """acks="replicas" / "fsync": a committed transaction is confirmed as a batch is, on every
        node it wrote to (a barrier, then WAIT / WAITAOF on the same connection), again until
        delivery_timeout_ms; then CommitNotConfirmed (the transaction stays committed). One
        confirmation at a time, on connections of the producer's own."""
        s = self.settings
        if s.acks == "leader":
            return
        steps = replicated(anchors, s.acks, s.min_replicas, s.ack_timeout_ms)
        confirmation = Confirmation(tx_id, s)
        scripts = self.producer.broker.scripts
        with self._confirming:
            if self._transport is None:
                self._transport = Transport(self.producer.broker.client, s.delivery_timeout_ms)
            transport = self._transport
            while True:
                try:
                    results = transport.execute(steps, scripts, confirmation.deadline)
                except _NETWORK_ERRORS as exc:
                    transport.reset()
                    sleep(confirmation.failed(exc, answered=False))
                    continue
                failure = barrier_failure(results, s)
                if failure is None:
                    return
                sleep(confirmation.failed(failure, answered=True))

    # -- Kafka style -----------------------------------------------------------------------------
    def recover(self) -> None:
        """A new instance: complete or abort its predecessor's open transaction."""
        name = self.producer.name
        if self.settings.transactional and name is not None:
            recovered = self.run(lambda: ops.recover(self.keys, name))
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

    # -- RocketMQ style --------------------------------------------------------------------------
    def send_half(
        self,
        topic: str,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        local: LocalFn,
    ) -> TransactionResult:
        if self.settings.transactional_group is None:
            raise InvalidConfig(
                "send_in_transaction() needs broker.producer(transactional_group=..., check=...)"
            )
        if not callable(local):
            raise TypeError(f"local must be callable, not {type(local).__name__}")
        producer = self.producer
        config = producer._topic_config(topic)
        encoded = producer._encoder.encode(config, value, key, headers, message_id, partition)
        staging = half_message(topic, encoded)
        tx_id, writer, keys = new_transaction_id(), self.writer(), self.keys

        def half() -> Operation[None]:
            yield from ops.stage(keys, tx_id, writer, staging.staged, 0, register=True)

        self.run(half)
        try:
            answer = maybe_await(local(tx_id, messages_of(staging.staged)))
            state = as_state(answer, "local")
        except Exception:
            log.exception("transaction %s: the local transaction raised: UNKNOWN", tx_id)
            state = TxState.UNKNOWN
        if state is TxState.COMMIT or state is TxState.ROLLBACK:
            stored, results = self.run(
                lambda: ops.settle_half(
                    keys, tx_id, writer, state, staging.staged, {topic: config}.get
                )
            )
            outcome = half_result(tx_id, stored, results, staging, producer._core.stats)
            if stored == "committed":
                self.confirm(tx_id, tx.barrier_keys(keys, tx_id, staging.staged, []))
            return outcome
        return TransactionResult(tx_id, state)

    # -- the background duties -------------------------------------------------------------------
    def start(self) -> None:
        self._task = spawn(self._background, name="redisq-transactions")

    def close(self) -> None:
        """Abort the open transaction (as Kafka's producer does when closed: none of it may be
        committed by a producer that is gone, and its staged messages go now rather than at its
        timeout; a failure leaves it to the sweeper; a producer that never started staged
        nothing), then stop the background duties."""
        current = self.current
        if current is not None and current.state == "open" and self.producer.identity is not None:
            try:
                current.abort()
            except Exception as exc:
                log.warning("close(): transaction %s not aborted: %s", current.transaction_id, exc)
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            # A round under way (a sweep, a check() and its answer) finishes, up to 5 s: a
            # decision stored is then carried out now rather than left to the next sweeper.
            stop(task, 5.0, lambda: None)  # its loop checks _stop
        with self._confirming:
            if self._transport is not None:
                self._transport.close()
                self._transport = None

    def _background(self) -> None:
        tick = background_tick_s(self.settings.check_interval_ms)
        ttl = background_lease_ms(tick)
        while not self._stop.wait(tick):
            if self.producer._core.fatal is not None:
                return  # fenced: a newer instance does this now
            try:
                self.background_once(ttl)
            except ProducerClosed:
                return
            except (RedisqError, *_NETWORK_ERRORS) as exc:
                log.warning("transactions: %s", exc)

    def background_once(self, ttl_ms: int) -> None:
        """Sweep the registry under the sweeper lease; run the group's check-back under its
        checker lease."""
        keys, token, broker = self.keys, self._token, self.producer.broker
        if broker.run(ops.take_lease(keys.transaction_sweeper(), token, ttl_ms)):
            broker.run(ops.sweep(keys))
        group, check = self.settings.transactional_group, self.settings.check
        if group is None or check is None:
            return
        lease = keys.transaction_checker(group)
        if not broker.run(ops.take_lease(lease, token, ttl_ms)):
            return
        for due in broker.run(ops.due_checks(keys, group)):
            # Renewed before each check() (a round asks about up to 100 transactions); lost
            # meanwhile: another member checks now, and this round ends here.
            if not broker.run(ops.take_lease(lease, token, ttl_ms)):
                return
            try:
                answer = as_state(maybe_await(check(due.record.tx_id, due.messages)), "check")
            except Exception:
                log.exception("transaction %s: check raised: UNKNOWN", due.record.tx_id)
                answer = TxState.UNKNOWN
            answered = ops.answer_check(
                keys,
                due.record,
                answer,
                max_checks=self.settings.max_checks,
                interval_ms=self.settings.check_interval_ms,
            )
            state = broker.run(answered)
            log.info("transaction %s: check-back %s -> %s", due.record.tx_id, answer.value, state)
