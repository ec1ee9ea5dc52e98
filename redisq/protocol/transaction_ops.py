"""Transactions (DESIGN §11), written once as protocol operations both producers run (the
thread driver is redisq.produce.transactional, the asyncio one redisq.produce.transactional_async).

One mechanism serves both APIs: Kafka's atomic writes (`producer.transaction()`) and RocketMQ's
half messages with check-back (`producer.send_in_transaction(...)`).

1. stage: the messages go to the transaction's own list (tx_stage.lua), beside a record of the
   producer, its epoch, the state and a deadline; no consumer reads them there.
2. decide: "committed", "aborted" or "unresolved" is written once, atomically, and is final
   (tx_decide.lua); a consume-transform-produce transaction first holds its input partitions
   (tx_hold.lua, only while the consumer's leases are still its own) and stores their new
   positions with the decision.
3. carry out: a committed transaction's batches are appended to their partitions through
   tx_apply.lua, whose mark beside each partition makes a repeat write nothing (after a crash
   the producer's next instance, the sweeper, the check-back or a consumer taking over an input
   partition repeats it); the input positions are applied once (tx_position.lua); then the
   transaction leaves the registry (tx_finish.lua) and its marks expire an hour later. An
   aborted one is only forgotten; an unresolved one (check-back gave up) goes to the group's
   unresolved topic.

On Redis Cluster the decision lives in the transaction's own slot and each partition's
roll-forward is one script: every committed transaction ends up whole in its partitions, in
stage order per partition, which is what Kafka's read_committed promises too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redisq.errors import (
    LeaseLost,
    RedisqError,
    TopicNotFound,
    TransactionAborted,
    TransactionDecided,
)
from redisq.model.keys import KeySpace, unresolved_topic
from redisq.model.records import decode_headers, encode_headers
from redisq.model.topic import TopicConfig
from redisq.model.transactions import TxMessage, TxState
from redisq.protocol import Atomic, Command, Operation, ScriptCall, Step, optional_text
from redisq.protocol import transactions as tx
from redisq.protocol.group import Grant, Lease
from redisq.protocol.produce import LAYOUTS, BatchResult, encode_message
from redisq.protocol.topics import create_topic, read_config, server_ms
from redisq.protocol.transactions import InputPosition, StagedBatch, TxRecord, Writer, messages_of

log = logging.getLogger("redisq.transactions")

# An open half message (RocketMQ style) is the check-back's: the sweeper looks again this late.
_GROUP_RECHECK_MS = 60_000
# A committed transaction is its producer's to roll forward (the next round trip after the
# decision); a sweeper carries it out once this long has passed since the decision, so a
# producer that died in between delays its messages by about this much plus a sweep interval.
ROLL_FORWARD_GRACE_MS = 2_000


# -- the producer's side -------------------------------------------------------------------------
def stage(
    keys: KeySpace,
    tx_id: str,
    writer: Writer,
    batches: list[StagedBatch],
    first_index: int,
    *,
    register: bool,
) -> Operation[None]:
    """Stage batches first_index, first_index + 1, ... (each once, in order), in one round
    trip, after registering the transaction (register: the first stage). ProducerFenced if a
    newer instance of the name started: batches staged anyway are never decided and expire."""
    steps: list[Step] = []
    if register:
        steps.append(
            tx.register(
                keys,
                tx_id,
                name=writer.name,
                epoch=writer.epoch,
                timeout_ms=writer.timeout_ms,
                group=writer.group,
                first_check_ms=writer.first_check_ms,
                exclusive=writer.exclusive,
            )
        )
    for i, batch in enumerate(batches):
        steps.append(
            tx.stage(
                keys,
                tx_id,
                first_index + i,
                batch,
                producer_id=writer.producer_id,
                name=writer.name,
                epoch=writer.epoch,
                timeout_ms=writer.timeout_ms,
                group=writer.group,
                expire_ms=writer.expire_ms,
            )
        )
    if steps:
        _raise_first((yield steps))


def commit(
    keys: KeySpace,
    tx_id: str,
    writer: Writer,
    batches: list[StagedBatch],
    inputs: list[tuple[Lease, InputPosition]],
    configs: Callable[[str], TopicConfig | None],
) -> Operation[list[BatchResult]]:
    """Hold the inputs, decide "committed", roll forward, apply the inputs, finish.

    LeaseLost (an input partition moved to another member): the transaction is aborted and
    TransactionAborted raised. TransactionDecided: it was aborted before (its timeout, a new
    instance, a consumer that took an input over)."""
    if inputs:
        holds = yield [tx.hold_input(keys, lease, tx_id, p) for lease, p in inputs]
        lost = [r for r in holds if isinstance(r, LeaseLost)]
        if lost:
            # A retry whose first attempt decided "committed" (its reply was lost) finds the
            # inputs moved on: the decision stands, and abort() carried it out.
            state, results = yield from abort_or_outcome(
                keys, tx_id, writer, [p for _, p in inputs], batches, configs
            )
            if state == "committed":
                return results
            raise TransactionAborted(f"transaction {tx_id} aborted: {lost[0]}")
        _raise_first(holds)
    positions = [p for _, p in inputs]
    decided, *rest = yield [
        tx.decide(
            keys, tx_id, "committed", epoch=writer.epoch, positions=positions, staged=bool(batches)
        ),
        # Due in the registry from now on: should this producer die before the roll-forward
        # below, any sweeper of the namespace (a transactional producer, a consumer, a
        # scheduler) carries it out ROLL_FORWARD_GRACE_MS after the decision (see sweep()).
        tx.reschedule(keys.transactions(), tx_id, 0),
    ]
    if isinstance(decided, TransactionDecided):
        raise TransactionAborted(f"transaction {tx_id} was {decided.state} before it could commit")
    _raise_first([decided, *rest])
    results = yield from roll_forward(keys, tx_id, batches, configs, writer.producer_id)
    yield from apply_positions(keys, tx_id, positions, committed=True)
    yield from finish(keys, tx_id, writer.name, writer.group, tx.forget_marks(keys, tx_id, batches))
    return results


def abort(
    keys: KeySpace, tx_id: str, writer: Writer | None, positions: list[InputPosition]
) -> Operation[str]:
    """Decide "aborted" (writer None: recovery); returns the state now stored (a transaction
    that was committed first stays committed, and is carried out instead)."""
    try:
        state = yield tx.decide(
            keys, tx_id, "aborted", epoch=None if writer is None else writer.epoch
        )
    except TransactionDecided as exc:
        state = exc.state
    if state != "aborted":  # committed first, or unresolved: carry that out
        yield from resolve(keys, tx_id)
        return state
    yield from apply_positions(keys, tx_id, positions, committed=False)
    yield from finish(
        keys,
        tx_id,
        None if writer is None else writer.name,
        None if writer is None else writer.group,
    )
    return state


def abort_or_outcome(
    keys: KeySpace,
    tx_id: str,
    writer: Writer,
    positions: list[InputPosition],
    batches: list[StagedBatch],
    configs: Callable[[str], TopicConfig | None],
) -> Operation[tuple[str, list[BatchResult]]]:
    """abort(), for the producer that staged `batches`: the state now stored and, when the
    transaction turns out to have been committed first (a commit whose reply was lost, or the
    check-back), what its batches were written as (abort() carried them out; the repeated
    roll-forward writes nothing and answers their offsets)."""
    state = yield from abort(keys, tx_id, writer, positions)
    if state != "committed":
        return state, []
    return state, (yield from roll_forward(keys, tx_id, batches, configs, writer.producer_id))


def settle_half(
    keys: KeySpace,
    tx_id: str,
    writer: Writer,
    answer: TxState,
    batches: list[StagedBatch],
    configs: Callable[[str], TopicConfig | None],
) -> Operation[tuple[str, list[BatchResult]]]:
    """local()'s COMMIT or ROLLBACK of a half message, carried out: the state now stored (a
    check-back's decision made first stands) and what the batches were written as."""
    if answer is TxState.COMMIT:
        return "committed", (yield from commit(keys, tx_id, writer, batches, [], configs))
    return (yield from abort_or_outcome(keys, tx_id, writer, [], batches, configs))


# -- carrying out a decision (anyone) ------------------------------------------------------------
def roll_forward(
    keys: KeySpace,
    tx_id: str,
    batches: list[StagedBatch],
    configs: Callable[[str], TopicConfig | None],
    producer_id: int | None,
    marks: str = "",
) -> Operation[list[BatchResult]]:
    """Append each staged batch once, all in one Atomic step: on a single server one MULTI/EXEC,
    so a reader sees every partition's part of the transaction or none; on a Cluster one at a
    time, in rounds (round k carries the k-th batch of every partition; after a failure the
    partition's later batches are not sent), so a later batch of a partition never lands before
    an earlier one. A deleted
    topic's batches have nowhere to go and are skipped."""
    results: list[BatchResult | None] = [None] * len(batches)
    rounds: dict[int, list[int]] = {}
    seen: dict[tuple[str, int], int] = {}
    for i, batch in enumerate(batches):
        k = seen.get((batch.topic, batch.partition), 0)
        seen[(batch.topic, batch.partition)] = k + 1
        rounds.setdefault(k, []).append(i)
    calls: list[tuple[int, ScriptCall[BatchResult]]] = []
    for k in sorted(rounds):
        for i in rounds[k]:
            config = configs(batches[i].topic)
            if config is None or batches[i].partition >= config.partitions:
                log.warning("transaction %s: topic %s is gone", tx_id, batches[i].topic)
                results[i] = BatchResult(first_id=None)
                continue
            calls.append(
                (i, tx.apply_batch(keys, tx_id, f"{marks}{i}", batches[i], config, producer_id))
            )
    replies = (yield Atomic(call for _, call in calls)) if calls else []
    failed = None
    for (i, _), reply in zip(calls, replies, strict=True):
        if isinstance(reply, TopicNotFound):
            results[i] = BatchResult(first_id=None)
        elif isinstance(reply, BaseException):
            failed = failed or reply
        else:
            results[i] = reply
    if failed is not None:
        raise failed
    return [r for r in results if r is not None]


def apply_positions(
    keys: KeySpace, tx_id: str, positions: list[InputPosition], *, committed: bool
) -> Operation[None]:
    if positions:
        _raise_first(
            (yield [tx.apply_position(keys, tx_id, p, committed=committed) for p in positions])
        )


def finish(
    keys: KeySpace, tx_id: str, name: str | None, group: str | None, marks: Sequence[Step] = ()
) -> Operation[None]:
    """Forget a carried-out transaction (every step idempotent: one round trip); then, once its
    staged batches are known to be gone, shorten its roll-forward marks' lives
    (tx.forget_marks: one more round trip)."""
    _raise_first(
        (yield [*tx.close_record(keys, tx_id), tx.finish(keys, tx_id, name=name, group=group)])
    )
    if marks:
        _raise_first((yield list(marks)))


def resolve(keys: KeySpace, tx_id: str, *, abort_open: bool = True) -> Operation[str]:
    """Carry out whatever was decided (recovery: the producer's next instance, the sweeper, a
    consumer taking over an input partition): committed -> roll forward and apply positions;
    aborted -> forget; unresolved -> to the group's unresolved topic; open -> abort it
    (abort_open) or leave it. Returns the state."""
    record = yield tx.read_record(keys, tx_id)
    if record is None:
        # Nothing staged yet: abort, so that a late stage of a paused producer is refused.
        return (yield from abort(keys, tx_id, None, []))
    if record.state == "open":
        if not abort_open:
            return "open"
        return (yield from abort(keys, tx_id, None, []))
    marks: list[Step] = []
    if record.state == "committed":
        batches = yield tx.read_batches(keys, tx_id)
        configs = yield from _configs(keys, batches)
        yield from roll_forward(keys, tx_id, batches, configs.get, record.producer_id)
        yield from apply_positions(keys, tx_id, record.positions, committed=True)
        marks = tx.forget_marks(keys, tx_id, batches)
    elif record.state == "unresolved" and record.group:
        marks = yield from _to_unresolved(keys, record)
    yield from finish(keys, tx_id, record.name, record.group, marks)
    return record.state


def _configs(keys: KeySpace, batches: list[StagedBatch]) -> Operation[dict[str, TopicConfig]]:
    configs = {}
    for topic in sorted({b.topic for b in batches}):
        config = yield from read_config(keys, topic)
        if config is not None:
            configs[topic] = config
    return configs


def _to_unresolved(keys: KeySpace, record: TxRecord) -> Operation[list[Step]]:
    """Check-back gave up: the half messages go to ``<group>~unresolved``, kept, with where they
    were headed in their headers (redisq.tx, redisq.model.topic, redisq.consume.partition_io)."""
    assert record.group is not None
    topic = unresolved_topic(record.group)
    # message entries: the half messages are copied one per entry, with their headers
    config = yield from create_topic(keys, topic, 1, exist_ok=True, entry_format="message")
    batches = yield tx.read_batches(keys, record.tx_id)
    moved = []
    for batch in batches:
        parts: list[bytes] = []
        layout = ""
        for message in batch.messages():
            headers = decode_headers(message.get("h") or None)
            headers.update(
                {
                    "redisq.tx": record.tx_id.encode(),
                    "redisq.topic": batch.topic.encode(),
                    "redisq.partition": b"%d" % batch.partition,
                }
            )
            key, mid = message.get("k") or None, message.get("m") or None
            layout = LAYOUTS[key is not None, True, mid is not None]
            parts += encode_message(key, message["v"], encode_headers(headers), mid)
        moved.append(StagedBatch(topic, 0, layout, batch.count, b"".join(parts)))
    yield from roll_forward(keys, record.tx_id, moved, {topic: config}.get, record.producer_id, "u")
    return tx.forget_marks(keys, record.tx_id, moved, "u")


# -- the sweeper and the check-back --------------------------------------------------------------
def take_lease(key: str, token: str, ttl_ms: int) -> Operation[bool]:
    """A plain lease for background duties (one sweeper, one checker per group at a time):
    taken if free, renewed if ours. Two holders at once (a paused one) cost only repeated work:
    every step they take is idempotent or final."""
    taken = yield Command(("SET", key, token, "NX", "PX", ttl_ms))
    if taken:
        return True
    return bool(int((yield ScriptCall("extend_lease", (key,), (token, ttl_ms)))))


def sweep(keys: KeySpace, limit: int = 100) -> Operation[int]:
    """Look at the registry's due transactions: abort open ones past their deadline (Kafka's
    transaction.timeout.ms; half messages are the check-back's), carry out decided ones.
    Returns how many were looked at."""
    now = yield Command(("TIME",), server_ms)
    ids = yield tx.due(keys.transactions(), now, limit)
    for tx_id in ids:
        record = yield tx.read_record(keys, tx_id)
        if record is not None and record.state == "committed":
            settled_at = record.decided_ms + ROLL_FORWARD_GRACE_MS
            if now < settled_at:  # its producer is probably rolling it forward right now
                yield tx.reschedule(keys.transactions(), tx_id, settled_at)
                continue
        if record is not None and record.state == "open":
            if record.group:
                yield tx.reschedule(keys.transactions(), tx_id, now + _GROUP_RECHECK_MS)
                continue
            if now < record.deadline_ms:
                yield tx.reschedule(keys.transactions(), tx_id, record.deadline_ms)
                continue
        try:
            yield from resolve(keys, tx_id)
        except RedisqError as exc:  # the next sweep tries again
            log.warning("sweeping transaction %s: %s", tx_id, exc)
    return len(ids)


@dataclass(frozen=True, slots=True)
class CheckDue:
    """An open half message whose check-back is due: ask `check` about it."""

    record: TxRecord
    messages: list[TxMessage]


def due_checks(keys: KeySpace, group: str, limit: int = 100) -> Operation[list[CheckDue]]:
    """The group's transactions due for a check-back; decided ones are carried out here."""
    now = yield Command(("TIME",), server_ms)
    ids = yield tx.due(keys.transaction_group(group), now, limit)
    due: list[CheckDue] = []
    for tx_id in ids:
        record = yield tx.read_record(keys, tx_id)
        if record is None or record.state != "open":
            yield from resolve(keys, tx_id)
            continue
        batches = yield tx.read_batches(keys, tx_id)
        due.append(CheckDue(record, messages_of(batches)))
    return due


def answer_check(
    keys: KeySpace, record: TxRecord, answer: TxState, *, max_checks: int, interval_ms: int
) -> Operation[str]:
    """Act on a check-back's answer: commit, roll back, or ask again in interval_ms; after
    max_checks unknown answers the transaction is unresolved and its messages move to the
    group's unresolved topic. Returns the state now."""
    if answer is TxState.UNKNOWN:
        # Counted once per round: a second checker that asked about the same round (the first
        # one's lease expired during a slow check) finds it taken and rescheduled, and counts
        # nothing; otherwise two answers of one round would give up after too few rounds.
        claimed = yield tx.claim_check(keys, record.group or "", record.tx_id, interval_ms)
        if not claimed:
            log.info(
                "transaction %s: check-back answer not counted: its round was answered already",
                record.tx_id,
            )
            return "open"
        checks = yield tx.count_check(keys, record.tx_id)
        if checks < max_checks:
            return "open"
        decision = "unresolved"
    else:
        decision = "committed" if answer is TxState.COMMIT else "aborted"
    try:
        yield tx.decide(keys, record.tx_id, decision, epoch=None, check=True)
    except TransactionDecided:
        pass  # decided meanwhile (the producer answered late): carry that out
    return (yield from resolve(keys, record.tx_id))


def _raise_first(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


# -- an input partition taken over ----------------------------------------------------------------
def settle_input(keys: KeySpace, grant: Grant) -> Operation[Grant]:
    """A lease granted on a partition whose previous owner's transaction carries its position
    (tx_hold.lua): resolve that transaction first (aborting it while open: its owner lost the
    lease, so it may not commit) and start where it leaves the group."""
    tx_id, lease = grant.pending_tx, grant.lease
    assert tx_id is not None
    state = yield from resolve(keys, tx_id)
    record = yield tx.read_record(keys, tx_id)
    here = (lease.group, lease.topic, lease.partition)
    for position in record.positions if record is not None else []:
        if state == "committed" and (position.group, position.topic, position.partition) == here:
            return replace(  # the takeovers were counted at the old position, not this one
                grant,
                position=position.position,
                entries_read=position.entries_read,
                takeovers=0,
                pending_tx=None,
            )
    dropped = InputPosition(lease.group, lease.topic, lease.partition, "", None)
    yield tx.apply_position(keys, tx_id, dropped, committed=False)
    return replace(grant, pending_tx=None)


def recover(keys: KeySpace, name: str) -> Operation[str | None]:
    """A new instance of a transactional producer: complete or abort the open transaction its
    predecessor left (Kafka's InitProducerId). Returns its id, if there was one."""
    tx_id = yield Command(("HGET", keys.named_producer(name), "tx"), optional_text)
    if tx_id is not None:
        yield from resolve(keys, tx_id)
    return tx_id


def commit_staged(keys: KeySpace, tx_id: str) -> Operation[str]:
    """Commit a transaction staged elsewhere (the Spark driver commits its tasks' attempts):
    decide "committed" without an epoch, then carry it out. TransactionAborted if it was aborted
    first, or if nothing was staged under that id."""
    try:
        yield tx.decide(keys, tx_id, "committed", epoch=None)
    except TransactionDecided as exc:
        if exc.state != "committed":
            raise TransactionAborted(f"transaction {tx_id} is {exc.state}") from None
    return (yield from resolve(keys, tx_id))
