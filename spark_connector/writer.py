"""Writing DataFrames to topics, exactly once per row, batch and streaming (DESIGN §5).

    (df.write.format("redisq").option("url", url).option("topic", "orders").mode("append").save())

Columns and routing: spark_connector.write_rows.

idempotence="transaction" (the default) follows Spark's commit protocol, whatever the plan above
the write (shuffles, non-deterministic repartitions, joins) and whatever Spark retries: each task
attempt stages its rows as one redisq transaction, invisible to consumers, and returns the
transaction's id; the driver's commit applies exactly the winning attempts, one per Spark
partition, and aborts every other (spark_connector.commit). A streaming epoch (micro-batch)
records which attempts it committed, first writer wins, so an epoch replayed after a restart
commits those same transactions (a repeat writes nothing) and aborts its own new ones. Rows of
one task keep their order per key. The rows become visible when the driver commits, as in
Spark's file sinks.

idempotence="message_id" appends at once, deduplicated by a message_id column (your
idempotency key) for the topic's dedup window: a re-run of a whole job writes nothing twice
either. "none" appends at once: a retried task writes its rows again.

Options: url, namespace, topic, idempotence, batchSize (rows per staged or appended batch,
1000), maxInFlight (batches per round trip, 8), transactionTimeoutMs (how long an attempt may
wait for the driver's commit before the sweeper may abort it: 24 h).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import redis
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

import redisq
from redisq.errors import RedisqError, TopicNotFound
from redisq.produce.transactions import Staging, new_transaction_id
from redisq.protocol import Command, Operation, run_operation
from redisq.protocol import produce as protocol
from redisq.protocol import transaction_ops as tx_ops
from redisq.protocol.produce import BatchResult, ProducerIdentity
from redisq.protocol.topics import server_ms
from redisq.protocol.transactions import StagedBatch, Writer
from spark_connector import commit
from spark_connector.write_rows import RowEncoder, WriteOptions

log = logging.getLogger("redisq.spark.writer")

T = TypeVar("T")
MAX_BATCH_BYTES = 1 << 20
WINDOW = 16
SEND_ATTEMPTS = 5
_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError)

__all__ = ["RedisqBatchWriter", "RedisqStreamWriter", "WriteCommit", "WriteOptions"]


@dataclass
class WriteCommit(WriterCommitMessage):
    """One task attempt's outcome, sent back to the driver."""

    write_id: str
    spark_partition: int
    attempt: int
    tx_id: str | None  # the staged transaction (None: nothing staged, or a direct mode)
    rows: int = 0
    batches: int = 0
    duplicates: int = 0


@dataclass
class _Batch:
    """A staged batch as protocol.produce takes it (SealedBatch), for the direct modes."""

    topic: str
    partition: int
    layout: str
    count: int
    base_seq: int
    args: list[bytes]
    body: bytes | None
    body_count: int


class _TaskWriter:
    """Writes one Spark task attempt's rows: staged into its transaction, or appended."""

    def __init__(self, opts: WriteOptions, write_id: str, streaming: bool = False) -> None:
        from pyspark import TaskContext

        self.opts = opts
        context = TaskContext.get()
        self.spark_partition = context.partitionId() if context else 0
        self.attempt = context.attemptNumber() if context else 0
        # A streaming epoch is named by the query's id (which survives its restarts) and the
        # batch id. Only the stream writer's: a batch write inside foreachBatch sees the same
        # local properties, and two such writes of one micro-batch must stay two writes (the
        # second would otherwise find the first one's decision and abort its own rows).
        if streaming and context is not None:
            batch_id = context.getLocalProperty("streaming.sql.batchId")
            query_id = context.getLocalProperty("sql.streaming.queryId")
            if batch_id is not None:
                write_id = f"{query_id or write_id}-{batch_id}"
        self.broker = redisq.connect(opts.url, namespace=opts.namespace)
        self.keys = self.broker.keys
        self.result = WriteCommit(write_id, self.spark_partition, self.attempt, None)
        self.staging = Staging(opts.batch_size, MAX_BATCH_BYTES)
        self._sent = 0  # batches written to Redis (the next one's index in the transaction)
        self._configs: dict[str, redisq.TopicConfig] = {}
        self._writer: Writer | None = None
        self._identity: ProducerIdentity | None = None
        self._next_batch: dict[tuple[str, int], int] = {}

    def _config(self, topic: str) -> redisq.TopicConfig:
        config = self._configs.get(topic)
        if config is None:
            config = self._configs[topic] = self.broker.topic_config(topic, refresh=True)
        return config

    def _run(self, make: Callable[[], Operation[T]]) -> T:
        """Run an idempotent operation, again after a connection error."""
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                return run_operation(make(), self.broker.scripts.execute)
            except _NETWORK_ERRORS as exc:
                if attempt == SEND_ATTEMPTS:
                    raise
                log.warning("%s; sending again", type(exc).__name__)
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def write(self, batches: Iterator[pa.RecordBatch]) -> WriteCommit:
        encoder = RowEncoder(self.opts, self._config, self.spark_partition)
        try:
            for record_batch in batches:
                for row in encoder.rows(record_batch):
                    self.staging.add(row.topic, row.partition, row.layout, row.parts, row.size)
                    self.result.rows += 1
                    if self.staging.full():
                        self.staging.seal_all()
                        if len(self.staging.staged) >= self.opts.max_in_flight:
                            self._flush()
            self.staging.seal_all()
            self._flush()
        finally:
            self.broker.close()
        log.info(
            "write %s task %d attempt %d: %d rows in %d batches (%s)",
            self.result.write_id,
            self.spark_partition,
            self.attempt,
            self.result.rows,
            self.result.batches,
            self.result.tx_id or self.opts.idempotence,
        )
        return self.result

    def _flush(self) -> None:
        new = self.staging.staged
        if not new:
            return
        if self.opts.idempotence == "transaction":
            self._stage(new)
        else:
            self._append(new)
        self._sent += len(new)
        self.result.batches += len(new)
        self.staging.staged = []  # in Redis now: memory stays bounded

    # -- idempotence="transaction" ----------------------------------------------------------
    def _stage(self, new: list[StagedBatch]) -> None:
        first = self._sent
        if self._writer is None:
            self._writer = self._begin()
        keys, tx_id, writer = self.keys, self.result.tx_id, self._writer
        assert tx_id is not None
        self._run(lambda: tx_ops.stage(keys, tx_id, writer, new, first, register=first == 0))

    def _begin(self) -> Writer:
        """The attempt's transaction: recorded under the write first (so the driver can abort
        it if it loses), by an anonymous writer whose epoch is the server's clock."""
        tx_id = self.result.tx_id = new_transaction_id()
        description = f"{self.spark_partition}:{self.attempt}"
        write_id, keys = self.result.write_id, self.keys
        self._run(lambda: commit.register_attempt(keys, write_id, tx_id, description))
        epoch = self.broker.scripts.execute(Command(("TIME",), server_ms))
        timeout = self.opts.transaction_timeout_ms
        return Writer(
            producer_id=protocol.random_producer_id(),
            name=None,
            epoch=epoch,
            timeout_ms=timeout,
            expire_ms=timeout + 3_600_000,
        )

    # -- idempotence="message_id" / "none" ----------------------------------------------------
    def _append(self, new: list[StagedBatch]) -> None:
        if self._identity is None:
            self._identity = ProducerIdentity(protocol.random_producer_id(), 0)
        mode = "message_id" if self.opts.idempotence == "message_id" else None
        batches = []
        for staged in new:
            tp = (staged.topic, staged.partition)
            number = self._next_batch.get(tp, 0)
            self._next_batch[tp] = number + 1
            count = staged.count * len(staged.layout)
            # The staged arguments as the batch's: protocol.produce joins them, or packs them
            # into one blob on a topic of batch entries
            batches.append(
                _Batch(*tp, staged.layout, staged.count, number, [staged.body], None, count)
            )
        calls = [
            protocol.produce(
                self.keys,
                mode,
                self._identity,
                self._config(b.topic),
                b,
                acked_next=b.base_seq,  # batches of a partition go in order, one at a time
                window=WINDOW,
            )
            for b in batches
        ]
        # Partition by partition, in rounds, so batch n+1 of a partition never precedes batch n.
        rounds: dict[int, list[int]] = {}
        seen: dict[tuple[str, int], int] = {}
        for i, b in enumerate(batches):
            k = seen[(b.topic, b.partition)] = seen.get((b.topic, b.partition), -1) + 1
            rounds.setdefault(k, []).append(i)
        for k in sorted(rounds):
            round_calls = [calls[i] for i in rounds[k]]
            replies = self._send(round_calls)
            for i, reply in zip(rounds[k], replies, strict=True):
                self._settle(batches[i], reply)

    def _send(self, calls: list[Any]) -> list[Any]:
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                replies = self.broker.scripts.execute(calls)
            except _NETWORK_ERRORS as exc:
                replies = [exc]
            errors = [r for r in replies if isinstance(r, _NETWORK_ERRORS)]
            if not errors:
                return list(replies)
            if attempt == SEND_ATTEMPTS or self.opts.idempotence == "none":
                raise errors[0]
            log.warning("%s; sending again", type(errors[0]).__name__)
            time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _settle(self, batch: _Batch, reply: Any) -> None:
        if isinstance(reply, BaseException):
            raise reply
        assert isinstance(reply, BatchResult)
        if reply.flags is not None:
            self.result.duplicates += reply.flags.count("1")


def _winners(messages: list[WriterCommitMessage | None]) -> tuple[str | None, list[str], int]:
    """The write id, the winning attempts' transactions and their rows."""
    results = [m for m in messages if isinstance(m, WriteCommit)]
    write_id = results[0].write_id if results else None
    winners = [m.tx_id for m in results if m.tx_id is not None]
    return write_id, winners, sum(m.rows for m in results)


class _Driver:
    """The driver's side of a write: commit the winners, abort the others."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts

    def commit(self, messages: list[WriterCommitMessage | None], what: str) -> None:
        write_id, winners, rows = _winners(messages)
        if self.opts.idempotence != "transaction" or write_id is None:
            log.info("%s: %d rows written", what, rows)
            return
        with redisq.connect(self.opts.url, namespace=self.opts.namespace) as broker:
            outcome = run_operation(
                commit.commit_write(broker.keys, write_id, winners), broker.scripts.execute
            )
        log.info(
            "%s: %d transactions committed%s (%d messages appended), %d other attempts aborted",
            what,
            len(outcome.committed),
            " as its first run decided" if outcome.replayed else "",
            outcome.appended,
            len(outcome.aborted),
        )

    def abort(self, messages: list[WriterCommitMessage | None], what: str) -> None:
        write_id, reported, _ = _winners(messages)
        if self.opts.idempotence != "transaction" or write_id is None:
            log.warning("%s aborted (rows appended directly stay written)", what)
            return
        with redisq.connect(self.opts.url, namespace=self.opts.namespace) as broker:
            aborted = run_operation(
                commit.abort_write(broker.keys, write_id, reported), broker.scripts.execute
            )
        log.warning("%s aborted: %d attempts rolled back, nothing written", what, len(aborted))


class RedisqBatchWriter(DataSourceArrowWriter):
    """df.write: one transaction per task attempt, committed by the driver."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.job_id = f"job-{uuid.uuid4().hex}"  # made on the driver: every attempt shares it
        self._check_topic()

    def _check_topic(self) -> None:
        if self.opts.topic is None:
            return
        with redisq.connect(self.opts.url, namespace=self.opts.namespace) as broker:
            try:
                broker.topic_config(self.opts.topic, refresh=True)
            except TopicNotFound:
                raise
            except RedisqError:  # pragma: no cover - reported by the tasks instead
                pass

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        return _TaskWriter(self.opts, self.job_id).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _Driver(self.opts).commit(messages, f"write {self.job_id}")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _Driver(self.opts).abort(messages, f"write {self.job_id}")


class RedisqStreamWriter(DataSourceStreamArrowWriter):
    """writeStream: each micro-batch is a write of its own, named by the query id (which
    survives restarts from the checkpoint) and the batch id."""

    def __init__(self, opts: WriteOptions) -> None:
        self.opts = opts
        self.job_id = f"stream-{uuid.uuid4().hex}"  # used only if no query id is visible

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCommit:
        return _TaskWriter(self.opts, self.job_id, streaming=True).write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _Driver(self.opts).commit(messages, f"micro-batch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _Driver(self.opts).abort(messages, f"micro-batch {batchId}")
