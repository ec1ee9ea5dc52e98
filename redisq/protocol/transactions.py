"""Transaction scripts (DESIGN §11): register, stage, decide, roll forward (tx_apply), finish;
the input positions a consume-transform-produce transaction carries (tx_hold, tx_position)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redisq.model.batches import blob_from_items, resp_items
from redisq.model.keys import KeySpace
from redisq.model.records import decode_headers
from redisq.model.topic import TopicConfig
from redisq.model.transactions import TxMessage
from redisq.protocol import Command, ScriptCall, Step, text
from redisq.protocol.group import Commit, Lease, parked_and_held, record_args
from redisq.protocol.produce import BatchResult, ProducerIdentity
from redisq.protocol.resp import bulk, decode_bulks
from redisq.settings import ProducerSettings

STATES = ("open", "committed", "aborted", "unresolved")
# A decided transaction's record stays this long after it was carried out, so a late call of a
# fenced or paused instance finds the decision instead of opening the transaction again.
RECORD_KEEP_MS = 24 * 3600 * 1000
# A roll-forward mark (KeySpace.tx_mark) lives until its transaction is carried out (the expiry
# is only a bound on what a transaction nobody ever finishes leaves behind), then this long, so a
# roll-forward that read the staged batches just before they went still finds it.
MARK_KEEP_MS = 30 * 24 * 3600 * 1000
MARK_GRACE_MS = 3600 * 1000


@dataclass(frozen=True, slots=True)
class StagedBatch:
    """One batch of a transaction: where it goes and its RESP-encoded messages."""

    topic: str
    partition: int
    layout: str
    count: int
    body: bytes  # the messages' arguments, RESP bulk strings (protocol.produce.encode_message)

    def serialize(self) -> bytes:
        head = f"{self.topic}\n{self.partition}\n{self.layout}\n{self.count}\n".encode()
        return head + self.body

    @classmethod
    def parse(cls, raw: bytes) -> StagedBatch:
        topic, partition, layout, count, body = raw.split(b"\n", 4)
        return cls(topic.decode(), int(partition), layout.decode(), int(count), body)

    def messages(self) -> list[dict[str, bytes]]:
        """The batch's messages as {letter: argument} (k key, v value, h headers blob, m message
        id; a letter missing or empty: not given)."""
        width = len(self.layout)
        values = decode_bulks(self.body, self.count * width)
        return [
            {letter: values[i * width + j] for j, letter in enumerate(self.layout)}
            for i in range(self.count)
        ]


@dataclass(frozen=True, slots=True)
class TxRecord:
    """A transaction's record as stored (tx_stage.lua creates it, tx_decide.lua decides it)."""

    tx_id: str
    state: str
    producer_id: int | None
    name: str | None
    epoch: str
    group: str | None
    created_ms: int
    deadline_ms: int
    checks: int
    positions: list[InputPosition]
    decided_ms: int = 0  # when the decision was stored (server clock); 0 while open

    @classmethod
    def from_hash(cls, tx_id: str, raw: dict[str, Any]) -> TxRecord:
        def get(name: str, default: str = "") -> str:
            value = raw.get(name)
            return default if value is None else text(value)

        return cls(
            tx_id=tx_id,
            state=get("state", "open"),
            producer_id=int(get("producer")) if get("producer").isdigit() else None,
            name=get("name") or None,
            epoch=get("epoch"),
            group=get("group") or None,
            created_ms=int(get("created_ms", "0")),
            deadline_ms=int(get("deadline_ms", "0")),
            checks=int(get("checks", "0")),
            positions=decode_positions(raw.get("positions")),
            decided_ms=int(get("decided_ms", "0")),
        )


@dataclass(frozen=True, slots=True)
class InputPosition:
    """A consumer's position on an input partition, committed with a transaction. `records`:
    the held messages (and parked keys) it passes, recorded when the input is held (not kept in
    the transaction's record: the hold stores them under the lease); `commit_seq`: the hold's
    number among the lease's commits (neither is in the record)."""

    group: str
    topic: str
    partition: int
    position: str
    entries_read: int | None
    records: Commit = field(default_factory=Commit, compare=False)
    commit_seq: int = field(default=0, compare=False)  # the hold's number (tx_hold.lua)

    def as_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "topic": self.topic,
            "partition": self.partition,
            "position": self.position,
            "entries_read": self.entries_read,
        }


def encode_positions(positions: list[InputPosition]) -> str:
    return json.dumps([p.as_json() for p in positions]) if positions else ""


def decode_positions(raw: Any) -> list[InputPosition]:
    if not raw:
        return []
    return [InputPosition(**item) for item in json.loads(text(raw))]


def register(
    keys: KeySpace,
    tx_id: str,
    *,
    name: str | None,
    epoch: int,
    timeout_ms: int,
    group: str | None,
    first_check_ms: int | None,
    exclusive: bool,
) -> ScriptCall[Any]:
    """tx_register.lua: the transaction in the registry (named: proves the epoch; exclusive:
    the name's one open transaction, which its next instance completes or aborts)."""
    return ScriptCall(
        "tx_register",
        (
            keys.named_producer(name) if name else keys.transactions(),
            keys.transactions(),
            keys.transaction_group(group) if group else keys.transactions(),
        ),
        (
            tx_id,
            epoch if name else "",
            timeout_ms,
            "" if first_check_ms is None else first_check_ms,
            "1" if exclusive and name else "0",
        ),
    )


def read_record(keys: KeySpace, tx_id: str) -> Command[TxRecord | None]:
    """The transaction's record (None: nothing was staged or decided, or it was forgotten)."""

    def decode(reply: Any) -> TxRecord | None:
        if isinstance(reply, dict):
            raw = {text(k): v for k, v in reply.items()}
        else:
            raw = {text(k): v for k, v in zip(reply[0::2], reply[1::2], strict=True)}
        return TxRecord.from_hash(tx_id, raw) if raw else None

    return Command(("HGETALL", keys.transaction(tx_id)), decode)


def read_batches(keys: KeySpace, tx_id: str) -> Command[list[StagedBatch]]:
    """The staged batches, in the order they were staged."""
    return Command(
        ("LRANGE", keys.transaction_messages(tx_id), 0, -1),
        lambda reply: [StagedBatch.parse(raw) for raw in reply],
    )


def close_record(keys: KeySpace, tx_id: str) -> list[Step]:
    """A carried-out transaction: its staged batches go, its decided record expires later."""
    return [
        Command(("DEL", keys.transaction_messages(tx_id))),
        Command(("PEXPIRE", keys.transaction(tx_id), RECORD_KEEP_MS)),
    ]


def due(key: str, now_ms: int, limit: int) -> Command[list[str]]:
    """Ids due in a registry zset (the registry, or a group's check-back schedule)."""
    return Command(
        ("ZRANGEBYSCORE", key, "-inf", now_ms, "LIMIT", 0, limit),
        lambda reply: [text(r) for r in reply],
    )


def reschedule(key: str, tx_id: str, at_ms: int) -> Command[Any]:
    """Look at a transaction again at at_ms (only while it is still in that zset)."""
    return Command(("ZADD", key, "XX", at_ms, tx_id))


def claim_check(keys: KeySpace, group: str, tx_id: str, interval_ms: int) -> ScriptCall[bool]:
    """tx_claim_check.lua: an UNKNOWN answer takes the transaction's due check-back round and
    reschedules it interval_ms from now; False: the round was not due (another checker's answer
    took it, or the transaction is gone), so this answer must not be counted."""
    return ScriptCall(
        "tx_claim_check",
        (keys.transaction_group(group),),
        (tx_id, interval_ms),
        lambda reply: bool(int(reply)),
    )


def count_check(keys: KeySpace, tx_id: str) -> Command[int]:
    """One more check-back answered UNKNOWN (or failed), after claim_check took its round; the
    number so far."""
    return Command(("HINCRBY", keys.transaction(tx_id), "checks", 1), int, retry_safe=False)


def stage(
    keys: KeySpace,
    tx_id: str,
    index: int,
    batch: StagedBatch,
    *,
    producer_id: int,
    name: str | None,
    epoch: int,
    timeout_ms: int,
    group: str | None,
    expire_ms: int,
) -> ScriptCall[int]:
    """tx_stage.lua: batch `index` of the transaction, where no consumer reads it (once)."""
    return ScriptCall(
        "tx_stage",
        (keys.transaction(tx_id), keys.transaction_messages(tx_id)),
        (
            producer_id,
            epoch,
            timeout_ms,
            group or "",
            batch.serialize(),
            index,
            name or "",
            expire_ms,
        ),
        int,
    )


def decide(
    keys: KeySpace,
    tx_id: str,
    decision: str,
    *,
    epoch: int | None,
    positions: list[InputPosition] | None = None,
    check: bool = False,
    staged: bool = False,
) -> ScriptCall[str]:
    """tx_decide.lua: the final decision (epoch None: recovery, which may only finish what is
    open; staged: the deciding producer staged batches, so its record must still exist)."""
    return ScriptCall(
        "tx_decide",
        (keys.transaction(tx_id), keys.transaction_messages(tx_id)),
        (
            decision,
            "" if epoch is None else epoch,
            encode_positions(positions or []),
            "1" if check else "0",
            "1" if staged else "0",
        ),
        text,
    )


def finish(keys: KeySpace, tx_id: str, *, name: str | None, group: str | None) -> ScriptCall[Any]:
    """tx_finish.lua: forget a carried-out transaction in the registry."""
    return ScriptCall(
        "tx_finish",
        (
            keys.named_producer(name) if name else keys.transactions(),
            keys.transactions(),
            keys.transaction_group(group) if group else keys.transactions(),
        ),
        (tx_id, "1" if name else "0"),
    )


def _applied(reply: Any) -> BatchResult:
    return BatchResult(first_id=text(reply[1]), duplicate=reply[0] == b"DUP")


def apply_batch(
    keys: KeySpace,
    tx_id: str,
    index: int | str,
    batch: StagedBatch,
    config: TopicConfig,
    producer_id: int | None,
) -> ScriptCall[BatchResult]:
    """tx_apply.lua: roll staged batch `index` forward into its partition, once. On a batch
    topic (DESIGN §14) the staged messages are appended as one batch entry of their blob."""
    topic, p = batch.topic, batch.partition
    mark = f"{tx_id}:{index}"
    layout, body, arguments = batch.layout, batch.body, batch.count * len(batch.layout)
    counts: tuple[str, ...] = ()
    if config.entry_format == "batch":
        counts = (keys.counts(topic, p),)
        blob = blob_from_items(batch.layout, batch.count, resp_items(batch.body))
        layout, body, arguments = "b", bulk(blob), 1
    return ScriptCall(
        "tx_apply",
        (
            keys.log(topic, p),
            keys.dedup_bucket(topic, p, 0),
            keys.dedup_bucket(topic, p, 1),
            keys.tx_mark(topic, p, mark),
            *counts,
        ),
        (
            mark,
            config.retention_messages,
            config.retention_ms,
            "" if producer_id is None else producer_id,
            layout,
            batch.count,
            MARK_KEEP_MS,
        ),
        _applied,
        topic,
        body,
        arguments,
    )


def forget_marks(
    keys: KeySpace, tx_id: str, batches: list[StagedBatch], prefix: str = ""
) -> list[Step]:
    """A carried-out transaction's roll-forward marks (batch i's: apply_batch's index
    prefix + i) expire MARK_GRACE_MS from now."""
    marks = [
        keys.tx_mark(b.topic, b.partition, f"{tx_id}:{prefix}{i}") for i, b in enumerate(batches)
    ]
    return [Command(("PEXPIRE", mark, MARK_GRACE_MS)) for mark in marks]


def hold_input(
    keys: KeySpace, lease: Lease, tx_id: str, position: InputPosition
) -> ScriptCall[Any]:
    """tx_hold.lua: the input partition waits for this transaction's position, and what the
    position passes is recorded (held messages, parked keys) (LeaseLost if the lease moved: the
    transaction must abort)."""
    topic, p, group = lease.topic, lease.partition, lease.group
    return ScriptCall(
        "tx_hold",
        (
            keys.lease(topic, p, group),
            keys.group_partition_state(topic, p, group),
            *parked_and_held(keys, lease, position.records),
        ),
        (lease.value, tx_id, position.commit_seq, *record_args(position.records)),
        topic=topic,
    )


def apply_position(
    keys: KeySpace, tx_id: str, position: InputPosition, *, committed: bool
) -> ScriptCall[bool]:
    """tx_position.lua: apply a committed transaction's input position (or drop the mark of an
    aborted one), once."""
    return ScriptCall(
        "tx_position",
        (
            keys.log(position.topic, position.partition),
            keys.group_partition_state(position.topic, position.partition, position.group),
        ),
        (
            position.group,
            tx_id,
            position.position if committed else "",
            "" if position.entries_read is None or not committed else position.entries_read,
        ),
        lambda reply: bool(int(reply)),
        position.topic,
    )


def barrier_keys(
    keys: KeySpace, tx_id: str, batches: list[StagedBatch], positions: list[InputPosition]
) -> list[str]:
    """A key holding data in every slot a committed transaction wrote to (ack_barrier.lua's
    KEYS[1]): the topics' set (the registry's slot), its record, each output and input
    partition's log."""
    found = [keys.topics(), keys.transaction(tx_id)]
    found += [keys.log(b.topic, b.partition) for b in batches]
    found += [keys.log(p.topic, p.partition) for p in positions]
    return list(dict.fromkeys(found))


def messages_of(batches: Iterable[StagedBatch]) -> list[TxMessage]:
    result = []
    for batch in batches:
        for parts in batch.messages():
            result.append(
                TxMessage(
                    batch.topic,
                    batch.partition,
                    parts.get("k") or None,
                    parts["v"],
                    decode_headers(parts.get("h") or None),
                    parts.get("m") or None,
                )
            )
    return result


@dataclass(slots=True)
class Writer:
    """Who writes a transaction: the producer's id, name, epoch, and its transaction options."""

    producer_id: int
    name: str | None
    epoch: int
    timeout_ms: int
    group: str | None = None
    first_check_ms: int | None = None
    exclusive: bool = False  # Kafka style: the name's one open transaction
    # when an undecided transaction's keys expire: past its timeout (or its last check-back)
    # with an hour to spare for the sweeper
    expire_ms: int = 3_600_000

    @classmethod
    def of(cls, settings: ProducerSettings, identity: ProducerIdentity) -> Writer:
        """The writer of a producer's transactions, from its settings and current identity."""
        group = settings.transactional_group
        return cls(
            producer_id=identity.producer_id,
            name=identity.name,
            epoch=identity.epoch,
            timeout_ms=settings.transaction_timeout_ms,
            group=group,
            first_check_ms=settings.check_first_ms if group else None,
            exclusive=settings.transactional,
            expire_ms=expire_ms(settings),
        )


# An undecided half message's keys live this long past the time its last check-back is due (set
# when it is staged), for a member of its group to come back and ask `check` (RocketMQ keeps its
# half topic's messages for the retention, 72 h by default).
HALF_KEEP_MS = 72 * 3600 * 1000


def expire_ms(settings: ProducerSettings) -> int:
    """How long an undecided transaction's keys live: past its timeout, with an hour to spare
    for a sweeper to come by; a half message: past its last check-back, by HALF_KEEP_MS."""
    if settings.transactional_group is not None:
        checks = settings.check_first_ms + settings.check_interval_ms * settings.max_checks
        return max(settings.transaction_timeout_ms, checks) + HALF_KEEP_MS
    return settings.transaction_timeout_ms + 3_600_000
