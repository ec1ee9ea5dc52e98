"""Transactions (DESIGN §11): the types both producers and their users share (what `local`
and `check` answer and receive, what a transaction returns) and the staging of a transaction's
messages into batches. The mechanism, as protocol operations, is in
redisq.protocol.transaction_ops."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import redis
from redis.exceptions import AskError, ClusterError, TryAgainError

from redisq.errors import (
    CommitNotConfirmed,
    InvalidConfig,
    LeaseLost,
    NotEnoughReplicas,
    ProducerFenced,
    TransactionAborted,
    TransactionDecided,
)
from redisq.model.msgid import encode_ulid
from redisq.model.offsets import offset_at
from redisq.model.records import Message, RecordMetadata
from redisq.model.stats import ProducerStats
from redisq.model.topic import TopicConfig
from redisq.model.transactions import TransactionResult, TxState
from redisq.produce.encoder import ack_failure
from redisq.protocol.group import Lease
from redisq.protocol.produce import BatchResult, messages_per_call
from redisq.protocol.transactions import InputPosition, StagedBatch
from redisq.settings import ProducerSettings

# A step may be run again after these (every transaction operation is idempotent as a whole):
# a lost connection or reply, and a slot moving between cluster nodes. redis-py follows ASK and
# MOVED and retries TRYAGAIN (a migrating slot's keys split between the nodes, or a key created
# beside existing ones) for only about 0.4 s before it raises ClusterError("TTL exhausted");
# a redirected or refused command did not run.
RETRIABLE_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    ClusterError,
    TryAgainError,
    AskError,
)


class TxConsumer(Protocol):
    """What tx.ack needs of a consumer (either driver): see dispatch.transaction_inputs."""

    def _transaction_inputs(
        self, messages: Message | Iterable[Message], tx_id: str
    ) -> list[tuple[Lease, InputPosition]]: ...

    def _transaction_ended(self, tx_id: str, position: InputPosition, committed: bool) -> None: ...


def new_transaction_id() -> str:
    """A ULID: unique without asking Redis, and sorted by time in listings."""
    now = time.time_ns() // 1_000_000
    return encode_ulid((now << 80) | secrets.randbits(80)).decode()


def records_of(
    batches: list[StagedBatch], results: list[BatchResult], order: list[tuple[str, int]]
) -> tuple[RecordMetadata, ...]:
    """Where each message landed, in send order (`order`: each message's partition)."""
    landed: dict[tuple[str, int], list[RecordMetadata]] = {}
    for batch, result in zip(batches, results, strict=True):
        into = landed.setdefault((batch.topic, batch.partition), [])
        for i in range(batch.count):
            offset = offset_at(result.first_id, i) if result.first_id else None
            into.append(RecordMetadata(batch.topic, batch.partition, offset, result.duplicate))
    cursor = dict.fromkeys(landed, 0)
    records = []
    for tp in order:
        records.append(landed[tp][cursor[tp]])
        cursor[tp] += 1
    return tuple(records)


class Staging:
    """A transaction's messages grouped into batches (I/O-free): per partition, consecutive
    messages of one layout share a batch of at most max_messages / max_bytes."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.staged: list[StagedBatch] = []  # written to the transaction's list, in order
        self.order: list[tuple[str, int]] = []  # each message's partition, in send order
        self._open: dict[tuple[str, int], tuple[str, list[bytes], int, int]] = {}

    @property
    def empty(self) -> bool:
        return not self.staged and not self._open

    def add(self, topic: str, partition: int, layout: str, parts: list[bytes], size: int) -> None:
        key = (topic, partition)
        self.order.append(key)
        current = self._open.get(key)
        if current is not None and (
            current[0] != layout
            or current[2] >= min(self.max_messages, messages_per_call(len(layout)))
            or current[3] + size > self.max_bytes
        ):
            self._seal(key)
            current = None
        if current is None:
            self._open[key] = (layout, list(parts), 1, size)
        else:
            current[1].extend(parts)
            self._open[key] = (layout, current[1], current[2] + 1, current[3] + size)

    def full(self) -> bool:
        return any(c[2] >= self.max_messages or c[3] >= self.max_bytes for c in self._open.values())

    def _seal(self, key: tuple[str, int]) -> None:
        layout, parts, count, _ = self._open.pop(key)
        self.staged.append(StagedBatch(key[0], key[1], layout, count, b"".join(parts)))

    def seal_all(self) -> None:
        for key in list(self._open):
            self._seal(key)


class TransactionCore:
    """A transaction's state, shared by both drivers' Transaction objects (no I/O): its staged
    and unstaged batches, the inputs it carries, its outcome."""

    def __init__(self, tx_id: str, settings: ProducerSettings, stats: ProducerStats) -> None:
        self.transaction_id = tx_id
        self.state = "open"
        self.records: tuple[RecordMetadata, ...] = ()
        self.staging = Staging(settings.max_batch_messages, settings.max_batch_bytes)
        self.configs: dict[str, TopicConfig] = {}
        self.written = 0  # batches staged in Redis
        self.registered = False
        # when the first message or input joined it (time.monotonic()): its timeout runs from
        # there, as Kafka's from the transaction's first partition, also while nothing is staged
        self.started: float | None = None
        # commit() was called: what it decides is the transaction (a decision stored before
        # an error); only commit() again or abort() may follow
        self.committing = False
        # committed, its acks not confirmed (CommitNotConfirmed): the anchors to confirm again
        self.unconfirmed: list[str] | None = None
        self._inputs: dict[tuple[str, str, int], tuple[TxConsumer, Lease, InputPosition]] = {}
        self._stats = stats

    def check_open(self) -> None:
        if self.state != "open":
            raise TransactionAborted(f"transaction {self.transaction_id} is {self.state}")

    def check_adding(self) -> None:
        """Before send() or ack(): the transaction is open and commit() was not called."""
        self.check_open()
        if self.committing:
            raise InvalidConfig(
                f"transaction {self.transaction_id}: commit() did not finish; call commit() "
                "again to complete it, or abort(): nothing may be added once it was called"
            )

    def add(self, config: TopicConfig, encoded: Any) -> bool:
        """An encoded message (sending.Encoded) joins its partition's batch; True when a batch
        is full and should be staged now."""
        self.configs[config.name] = config
        self.staging.add(
            config.name, encoded.partition, encoded.layout, encoded.parts, encoded.size
        )
        return self.staging.full()

    def ack(self, consumer: TxConsumer, messages: Message | Iterable[Message]) -> None:
        lost = None
        for lease, position in consumer._transaction_inputs(messages, self.transaction_id):
            key = (position.group, position.topic, position.partition)
            acked_before = self._inputs.get(key)
            if acked_before is not None and acked_before[1] != lease:
                # It acked under a lease since lost (the partition moved, maybe came back):
                # that input is kept, so the commit's hold of its lease fails (it aborts).
                lost = position
                continue
            self._inputs[key] = (consumer, lease, position)  # the others: an abort resets them
        if lost is not None:
            raise LeaseLost(
                f"{lost.topic}/{lost.partition}: the transaction acked messages under an "
                "earlier lease of the partition: it cannot commit"
            )

    def start_clock(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def timeout_left_ms(self, timeout_ms: int, now: float) -> int:
        """What is left of the timeout when the transaction registers (the server's clock runs
        it from there): the time since its first message or input is taken off. At most 0:
        TransactionAborted, nothing is registered."""
        spent = 0 if self.started is None else int((now - self.started) * 1000)
        left = timeout_ms - spent
        if left <= 0:
            raise TransactionAborted(
                f"transaction {self.transaction_id} timed out ({timeout_ms} ms since its first "
                "message) before anything of it was staged"
            )
        return left

    def unstaged(self) -> tuple[list[StagedBatch], int, bool]:
        """(batches to stage now, the index of the first, whether to register first)."""
        self.staging.seal_all()
        return self.staging.staged[self.written :], self.written, not self.registered

    def staged(self, count: int) -> None:
        self.registered = True
        self.written += count

    def inputs(self) -> list[tuple[Lease, InputPosition]]:
        return [(lease, position) for _, lease, position in self._inputs.values()]

    def positions(self) -> list[InputPosition]:
        return [position for _, _, position in self._inputs.values()]

    def ended(self, committed: bool, results: list[BatchResult] | None = None) -> None:
        """The outcome: records of a commit, counters, and the consumers told (an abort makes
        them read the inputs again)."""
        self.state = "committed" if committed else "aborted"
        if committed and results is not None:
            self.records = records_of(self.staging.staged, results, self.staging.order)
        if committed:
            self._stats.transactions_committed += 1
        else:
            self._stats.transactions_aborted += 1
        for consumer, _, position in self._inputs.values():
            consumer._transaction_ended(self.transaction_id, position, committed)


def half_result(
    tx_id: str, stored: str, results: list[BatchResult], staging: Staging, stats: ProducerStats
) -> TransactionResult:
    """A half message's outcome as stored (tx_ops.settle_half), counted."""
    if stored == "committed":
        stats.transactions_committed += 1
        return TransactionResult(
            tx_id, TxState.COMMIT, records_of(staging.staged, results, staging.order)
        )
    stats.transactions_aborted += 1
    return TransactionResult(tx_id, TxState.ROLLBACK)


def half_message(topic: str, encoded: Any) -> Staging:
    """A half message (send_in_transaction) staged as one batch."""
    staging = Staging(1, 1 << 62)
    staging.add(topic, encoded.partition, encoded.layout, encoded.parts, encoded.size)
    staging.seal_all()
    return staging


class Ending(Protocol):
    """A driver's Transaction, as ends_on_refusal sees it."""

    @property
    def transaction_id(self) -> str: ...

    @property
    def state(self) -> str: ...

    def _ended(self, committed: bool, results: list[BatchResult] | None = None) -> None: ...


def abort_found(transaction: Ending, state: str, results: list[BatchResult]) -> None:
    """End a transaction as its abort found it (tx_ops.abort_or_outcome), either driver: aborted,
    or committed first, which stands (records from `results`) and raises TransactionDecided."""
    committed = state == "committed"
    transaction._ended(committed, results)
    if committed:
        raise TransactionDecided("committed")


@contextlib.contextmanager
def ends_on_refusal(transaction: Ending) -> Iterator[None]:
    """Around a step of an open transaction (stage, commit, abort), either driver: a step Redis
    refused for good ends the transaction as aborted (TransactionAborted: its timeout passed, an
    input moved; a decision stored first by the sweeper, a check-back or recovery; ProducerFenced:
    a newer instance settles it). A step that could not reach Redis leaves it open: commit() or
    abort() may be called again, and the sweeper aborts it after its timeout otherwise."""
    try:
        yield
    except TransactionDecided as exc:
        if transaction.state == "open":
            transaction._ended(False)
        raise TransactionAborted(
            f"transaction {transaction.transaction_id} is {exc.state}"
        ) from None
    except (TransactionAborted, ProducerFenced):
        if transaction.state == "open":
            transaction._ended(False)
        raise


def barrier_failure(results: list[Any], settings: ProducerSettings) -> BaseException | None:
    """What a round of redisq.protocol.transactions.replicated() says: None once every barrier
    was written and the WAIT / WAITAOF of its node confirmed it."""
    *barriers, acked = results
    failed = next((r for r in barriers if isinstance(r, BaseException)), None)
    if failed is not None:
        return failed
    if isinstance(acked, BaseException):
        return acked
    for i in range(len(barriers)):
        if i not in acked:  # never taken as confirmed
            return NotEnoughReplicas(f"acks={settings.acks}: no answer")
        failure = ack_failure(acked[i], settings)
        if failure is not None:
            return failure
    return None


class Confirmation:
    """The tries of a committed transaction's acks (the drivers' Transactions.confirm): rounds of
    protocol.transactions.replicated() until delivery_timeout_ms, with a growing backoff."""

    def __init__(self, tx_id: str, settings: ProducerSettings) -> None:
        self.tx_id = tx_id
        self.settings = settings
        self.deadline = time.monotonic() + settings.delivery_timeout_ms / 1000
        self._backoff = settings.retry_backoff_ms / 1000
        self._said: BaseException | None = None  # the last answer (a deadline says less)

    def failed(self, failure: BaseException, answered: bool) -> float:
        """A round did not confirm: how long to wait before the next; CommitNotConfirmed once
        the next would pass the deadline. answered: the failure is the servers' answer."""
        if answered:
            self._said = failure
        backoff, self._backoff = self._backoff, min(self._backoff * 2, 1.0)
        if time.monotonic() + backoff < self.deadline:
            return backoff
        last = failure if answered or self._said is None else self._said
        s = self.settings
        raise CommitNotConfirmed(
            f"transaction {self.tx_id} is committed on the primary, but acks={s.acks} was not "
            f"confirmed within delivery_timeout_ms={s.delivery_timeout_ms}: a failover may lose "
            f"it; commit() again tries the confirmation again (last error: {last})",
            self.tx_id,
        ) from last
