"""Spark's commit protocol on redisq transactions: what the driver decides for a write.

Each task attempt stages its rows as one transaction (redisq.protocol.transaction_ops.stage) and
reports its id in
its commit message; nothing it staged is visible yet. Before staging, the attempt records its id
in the write's record, so the driver knows every attempt, including those that never reported
(killed executors, zombie or speculative attempts, a stage run again after a lost shuffle).
The driver then, as the protocol operations below:

1. records which attempts win (the tasks' commit messages: one per Spark partition), first
   writer wins (HSETNX): a streaming epoch replayed after a restart finds the ids its first run
   recorded and commits those, never the new attempts of the replay;
2. decides each winner "committed" (tx_decide.lua), all of them before carrying out any, so a
   driver that dies mid-way leaves only decided transactions, which anyone completes;
3. rolls each forward (tx_apply.lua, a mark per batch in the partition's dedup ring: a repeat
   writes nothing twice), chunk by chunk, in stage order per partition;
4. aborts every other attempt it knows of; one that registers later stays open, is never
   committed, and is aborted by the sweeper past its timeout (its keys expire after that).

The write's record lives in a slot of its own (`keys.transaction("spark~<write id>")`: the
write is the transaction that decides which of its tasks' transactions commit), kept RECORD_KEEP_MS.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redisq.errors import RedisqError, TopicNotFound, TransactionDecided
from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.protocol import Command, Operation, Step, optional_text, text
from redisq.protocol import transaction_ops as tx_ops
from redisq.protocol import transactions as tx
from redisq.protocol.topics import read_config
from redisq.protocol.transactions import StagedBatch

log = logging.getLogger("redisq.spark.commit")

# How long a write's record stays: a streaming epoch can be replayed (after a restart from the
# checkpoint) as long as this, and still commit exactly what its first run committed.
RECORD_KEEP_MS = 7 * 24 * 3600 * 1000
_ATTEMPT = "attempt:"
_DECIDED = "decided"
_CHUNK = 64  # staged batches read and rolled forward per round trip


class IncompleteWrite(RedisqError):
    """A winning attempt's transaction could not be committed (aborted by its timeout, or its
    keys expired before the driver came back): its rows are not in the topic."""


@dataclass
class WriteOutcome:
    committed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    replayed: bool = False  # the decision was taken by an earlier run of this epoch
    appended: int = 0  # messages appended now (0 for what an earlier run appended)


def write_record(keys: KeySpace, write_id: str) -> str:
    return keys.transaction(f"spark~{write_id}")


def register_attempt(
    keys: KeySpace, write_id: str, tx_id: str, description: str
) -> Operation[None]:
    """A task attempt, before it stages anything: the driver will know to abort it if it loses."""
    record = write_record(keys, write_id)
    yield [
        Command(("HSET", record, _ATTEMPT + tx_id, description)),
        Command(("PEXPIRE", record, RECORD_KEEP_MS)),
    ]


def attempts(keys: KeySpace, write_id: str) -> Operation[dict[str, str]]:
    """Every attempt registered for the write: tx id -> "partition:attempt"."""
    raw = yield Command(("HGETALL", write_record(keys, write_id)))
    fields = _pairs(raw)
    return {k[len(_ATTEMPT) :]: v for k, v in fields.items() if k.startswith(_ATTEMPT)}


def commit_write(keys: KeySpace, write_id: str, winners: Iterable[str]) -> Operation[WriteOutcome]:
    """Steps 1-4 of the module docstring. IncompleteWrite if a decided winner cannot commit."""
    record = write_record(keys, write_id)
    proposed = sorted(set(winners))
    earlier = yield Command(("HGET", record, _DECIDED), optional_text)
    if earlier is None:
        # Every winner must still be open before the decision: one aborted past its timeout
        # fails the write, and a winner decided all the same would be rolled forward later by
        # a sweeper, a part of a failed write (there twice once the job is re-run). Nothing is
        # recorded then: a replayed epoch stages and commits attempts of its own.
        records = yield [tx.read_record(keys, tx_id) for tx_id in proposed]
        lost = [
            f"{tx_id} ({'expired' if r is None else r.state})"
            for tx_id, r in zip(proposed, records, strict=True)
            if r is None or r.state != "open"
        ]
        if lost:
            raise IncompleteWrite(
                f"write {write_id}: attempts {', '.join(lost)} were aborted or expired before "
                "the commit; nothing of the write is in the topic (raise transactionTimeoutMs?)"
            )
    stored = yield Command(("HSETNX", record, _DECIDED, json.dumps(proposed)), int)
    outcome = WriteOutcome()
    if stored:
        decided = proposed
        yield Command(("PEXPIRE", record, RECORD_KEEP_MS))
    else:
        decided = json.loads((yield Command(("HGET", record, _DECIDED), text)))
        outcome.replayed = True
        log.info("write %s was decided before: committing its %d attempts", write_id, len(decided))
    results = yield [tx.decide(keys, tx_id, "committed", epoch=None) for tx_id in decided]
    failed = []
    for tx_id, result in zip(decided, results, strict=True):
        if isinstance(result, TransactionDecided) and result.state != "committed":
            failed.append(f"{tx_id} ({result.state})")
        elif isinstance(result, BaseException):
            raise result
    if failed:
        raise IncompleteWrite(
            f"write {write_id}: attempts {', '.join(failed)} were aborted or expired before the "
            "commit; their rows are not in the topic (raise transactionTimeoutMs?)"
        )
    for tx_id in decided:
        outcome.appended += yield from carry_out(keys, tx_id)
    outcome.committed = decided
    known = yield from attempts(keys, write_id)
    outcome.aborted = yield from abort_attempts(keys, sorted(set(known) - set(decided)))
    yield from _settled(keys, write_id, sorted(known))
    return outcome


def abort_write(keys: KeySpace, write_id: str, reported: Iterable[str]) -> Operation[list[str]]:
    """A failed write (or epoch): abort every attempt but those a decision already names."""
    decided_raw = yield Command(("HGET", write_record(keys, write_id), _DECIDED), optional_text)
    decided = set(json.loads(decided_raw)) if decided_raw else set()
    known = yield from attempts(keys, write_id)
    losers = sorted((set(known) | set(reported)) - decided)
    aborted = yield from abort_attempts(keys, losers)
    yield from _settled(keys, write_id, losers)
    return aborted


def abort_attempts(keys: KeySpace, tx_ids: list[str]) -> Operation[list[str]]:
    aborted = []
    for tx_id in tx_ids:
        state = yield from tx_ops.abort(keys, tx_id, None, [])
        if state == "aborted":
            aborted.append(tx_id)
        else:  # pragma: no cover - only the driver commits, and never a loser
            log.warning("attempt %s was %s, not aborted", tx_id, state)
    return aborted


def _settled(keys: KeySpace, write_id: str, tx_ids: list[str]) -> Operation[None]:
    """Attempts committed or aborted leave the write's record: what stays there is the
    decision and the attempts not settled yet."""
    if tx_ids:
        yield Command(("HDEL", write_record(keys, write_id), *(_ATTEMPT + t for t in tx_ids)))


def carry_out(keys: KeySpace, tx_id: str) -> Operation[int]:
    """Roll a committed transaction forward, _CHUNK staged batches per round trip (memory stays
    bounded whatever the task wrote), then forget it. Batch i carries mark "<tx id>:i", the
    mark tx_ops.resolve gives it: a sweeper resolving the same transaction writes nothing twice.
    Returns the messages appended now."""
    record = yield tx.read_record(keys, tx_id)
    if record is None or record.state != "committed":
        return 0  # carried out and forgotten long ago, or never ours to carry out
    configs: dict[str, TopicConfig | None] = {}
    appended = 0
    start = 0
    while True:
        batches = yield _read_batches(keys, tx_id, start, start + _CHUNK - 1)
        for topic in sorted({b.topic for b in batches} - set(configs)):
            configs[topic] = yield from read_config(keys, topic)
        appended += yield from _apply(keys, tx_id, start, batches, configs, record.producer_id)
        start += len(batches)
        if len(batches) < _CHUNK:
            break
    yield from tx_ops.finish(keys, tx_id, None, None)
    return appended


def _apply(
    keys: KeySpace,
    tx_id: str,
    first: int,
    batches: list[StagedBatch],
    configs: dict[str, TopicConfig | None],
    producer_id: int | None,
) -> Operation[int]:
    """Batches first, first + 1, ... in rounds: round k carries the k-th batch of each
    partition, so no batch of a partition lands before an earlier one of that partition."""
    rounds: dict[int, list[int]] = {}
    seen: dict[tuple[str, int], int] = {}
    for i, batch in enumerate(batches):
        k = seen.get((batch.topic, batch.partition), 0)
        seen[(batch.topic, batch.partition)] = k + 1
        rounds.setdefault(k, []).append(i)
    appended = 0
    for k in sorted(rounds):
        sent: list[int] = []
        calls: list[Step] = []
        for i in rounds[k]:
            config = configs.get(batches[i].topic)
            if config is None or batches[i].partition >= config.partitions:
                log.warning("transaction %s: topic %s is gone", tx_id, batches[i].topic)
                continue
            sent.append(i)
            calls.append(tx.apply_batch(keys, tx_id, first + i, batches[i], config, producer_id))
        replies = yield calls
        for i, reply in zip(sent, replies, strict=True):
            if isinstance(reply, TopicNotFound):
                continue
            if isinstance(reply, BaseException):
                raise reply
            if not reply.duplicate:
                appended += batches[i].count
    return appended


def _read_batches(keys: KeySpace, tx_id: str, first: int, last: int) -> Command[list[StagedBatch]]:
    return Command(
        ("LRANGE", keys.transaction_messages(tx_id), first, last),
        lambda reply: [StagedBatch.parse(raw) for raw in reply],
    )


def _pairs(raw: Any) -> dict[str, str]:
    if isinstance(raw, dict):
        return {text(k): text(v) for k, v in raw.items()}
    return {text(k): text(v) for k, v in zip(raw[0::2], raw[1::2], strict=True)}
