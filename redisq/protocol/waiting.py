"""Messages not yet in their partitions, as the console and the metrics see them: transactions
open or decided and not yet carried out (DESIGN §11), the half messages check-back gave up on,
and delayed messages not yet due (DESIGN §12).

Each read is a protocol operation of a fixed number of pipelined round trips, whatever the
number of transactions or partitions (`redisq.protocol.transaction_admin.list_transactions` reads
through
`transactions_snapshot`). The namespace snapshot (redisq.protocol.overview) also
counts each partition's delayed messages, beside its stream; `schedules` reads only those (two
small commands per partition, no XINFO STREAM).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redisq.errors import read_reply
from redisq.model.keys import KeySpace, parse_unresolved_topic
from redisq.model.records import Message, decode_entries, decode_headers
from redisq.protocol import Command, Operation, Step, text
from redisq.protocol import transactions as tx
from redisq.protocol.resp import decode_bulks
from redisq.protocol.topics import server_ms

__all__ = [
    "PartitionSchedule",
    "TransactionInfo",
    "PendingTransaction",
    "ScheduledMessage",
    "TransactionsSnapshot",
    "Unresolved",
    "scheduled_messages",
    "schedules",
    "transactions_snapshot",
    "unresolved_messages",
]


@dataclass(frozen=True, slots=True)
class TransactionInfo:
    """A transaction in the registry: open, or decided and not yet carried out."""

    transaction_id: str
    state: str  # "open", "committed", "aborted", "unresolved", or "missing" (nothing staged)
    producer: str  # the producer's name, or its id
    group: str | None  # the transactional group (half messages)
    batches: int  # staged batches
    age_ms: int
    deadline_ms: int | None  # open: when the sweeper aborts it (None: check-back decides)
    checks: int  # check-backs answered UNKNOWN so far


@dataclass(frozen=True, slots=True)
class PendingTransaction:
    """A transaction in the registry (see TransactionInfo) and, for a half message, when its
    next check-back is due (server ms; None once decided)."""

    info: TransactionInfo
    next_check_ms: int | None


@dataclass(frozen=True, slots=True)
class TransactionsSnapshot:
    """The registry's transactions (at most `limit` of `total`: the first the sweeper will look
    at), oldest first."""

    now_ms: int
    total: int
    transactions: list[PendingTransaction] = field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(1 for t in self.transactions if t.info.state == state)


def _ids(reply: Any) -> list[str]:
    return [text(r) for r in reply]


def _score(reply: Any, what: str) -> int | None:
    reply = read_reply(reply, what)
    return None if reply is None else int(float(reply))


def transactions_snapshot(keys: KeySpace, limit: int = 1000) -> Operation[TransactionsSnapshot]:
    """The registry's transactions with their records, staged batches and next check-back: two
    round trips (three when half messages are open), whatever their number."""
    first = yield [
        Command(("TIME",), server_ms),
        Command(("ZRANGE", keys.transactions(), 0, limit - 1), _ids),
        Command(("ZCARD", keys.transactions()), int),
    ]
    now, ids, total = (read_reply(reply, "the transaction registry") for reply in first)
    if not ids:
        return TransactionsSnapshot(now_ms=now, total=total)
    steps: list[Step] = []
    for tx_id in ids:
        steps += [
            tx.read_record(keys, tx_id),
            Command(("LLEN", keys.transaction_messages(tx_id)), int),
        ]
    replies = yield steps
    infos = []
    for i, tx_id in enumerate(ids):
        record, batches = (read_reply(r, f"transaction {tx_id!r}") for r in replies[2 * i :][:2])
        if record is None:  # forgotten since the ZRANGE
            infos.append(TransactionInfo(tx_id, "missing", "", None, 0, 0, None, 0))
            continue
        infos.append(
            TransactionInfo(
                transaction_id=tx_id,
                state=record.state,
                producer=record.name or str(record.producer_id or ""),
                group=record.group,
                batches=batches,
                age_ms=max(0, now - record.created_ms) if record.created_ms else 0,
                deadline_ms=record.deadline_ms if record.group is None else None,
                checks=record.checks,
            )
        )
    halves = [i for i in infos if i.group and i.state == "open"]
    checks: dict[str, int | None] = {}
    if halves:
        scores = yield [
            Command(("ZSCORE", keys.transaction_group(i.group or ""), i.transaction_id))
            for i in halves
        ]
        checks = {
            i.transaction_id: _score(s, f"transaction {i.transaction_id!r}'s next check-back")
            for i, s in zip(halves, scores, strict=True)
        }
    infos.sort(key=lambda i: -i.age_ms)
    return TransactionsSnapshot(
        now_ms=now,
        total=total,
        transactions=[PendingTransaction(i, checks.get(i.transaction_id)) for i in infos],
    )


# -- delayed messages: how many, when the next ------------------------------------------------
@dataclass(frozen=True, slots=True)
class PartitionSchedule:
    """A partition's schedule: how many delayed messages wait, when the first is due (ms)."""

    topic: str
    partition: int
    scheduled: int
    next_due_ms: int | None


@dataclass(frozen=True, slots=True)
class Schedules:
    """Every topic of the namespace and the partitions that have delayed messages."""

    now_ms: int
    topics: list[str]
    partitions: list[PartitionSchedule]

    @property
    def scheduled(self) -> int:
        return sum(p.scheduled for p in self.partitions)


def schedules(keys: KeySpace) -> Operation[Schedules]:
    """Three round trips: the topic registry, each topic's partition count, each partition's
    ZCARD and first entry of its schedule."""
    first = yield [Command(("SMEMBERS", keys.topics())), Command(("TIME",), server_ms)]
    members, now = (read_reply(reply, "the topic registry") for reply in first)
    names = sorted(text(m) for m in members)
    if not names:
        return Schedules(now, [], [])
    counts = yield [Command(("HGET", keys.topic_meta(t), "partitions")) for t in names]
    parts = [  # a topic deleted since the registry was read has no partitions (None)
        (t, p)
        for t, count in zip(names, counts, strict=True)
        for p in range(int(read_reply(count, f"topic {t!r} (settings)") or 0))
    ]
    if not parts:
        return Schedules(now, names, [])
    steps: list[Step] = []
    for t, p in parts:
        steps += [
            Command(("ZCARD", keys.scheduled(t, p)), int),
            Command(("ZRANGE", keys.scheduled(t, p), 0, 0, "WITHSCORES"), _pairs),
        ]
    replies = yield steps
    found = []
    for i, (t, p) in enumerate(parts):
        what = f"topic {t!r} partition {p}'s schedule"
        count, head = (read_reply(r, what) for r in replies[2 * i :][:2])
        if count:
            due = head[0][1] if head else None
            found.append(PartitionSchedule(t, p, count, due))
    return Schedules(now, names, found)


# -- half messages check-back gave up on ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Unresolved:
    """A transactional group's unresolved topic (``<group>~unresolved``): its newest messages,
    each with where it was headed (headers redisq.tx, redisq.model.topic,
    redisq.consume.partition_io)."""

    group: str
    topic: str
    messages: list[Message]
    length: int  # messages in the topic (the newest are in `messages`)

    @staticmethod
    def destination(message: Message) -> tuple[str, str, str]:
        """(transaction id, topic, partition) the message was headed for."""
        h = message.headers
        return tuple(  # type: ignore[return-value]
            h.get(name, b"").decode(errors="replace")
            for name in ("redisq.tx", "redisq.topic", "redisq.partition")
        )


def unresolved_messages(
    keys: KeySpace, topics: Sequence[str], count: int = 50
) -> Operation[list[Unresolved]]:
    """The newest `count` messages of each unresolved topic among `topics` (the namespace's
    topic names), newest first, and their lengths: one round trip (one partition each)."""
    found = [(t, g) for t in sorted(topics) if (g := parse_unresolved_topic(t)) is not None]
    if not found:
        return []
    steps: list[Step] = []
    for t, _ in found:
        steps += [
            Command(("XREVRANGE", keys.log(t, 0), "+", "-", "COUNT", count)),
            Command(("XLEN", keys.log(t, 0)), int),
        ]
    replies = yield steps
    result = []
    for i, (topic, group) in enumerate(found):
        entries, length = (read_reply(r, f"topic {topic!r}") for r in replies[2 * i :][:2])
        messages = decode_entries(topic, 0, entries or [])
        result.append(Unresolved(group, topic, messages, length))
    return result


# -- delayed messages ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScheduledMessage:
    """A delayed message waiting in its partition's schedule."""

    topic: str
    partition: int
    schedule_id: bytes  # the sender's identity and counter, or the message id
    due_ms: int
    producer_id: int | None
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    message_id: bytes | None


def _parse_scheduled(
    topic: str, partition: int, schedule_id: bytes, due_ms: int, raw: Any
) -> ScheduledMessage | None:
    """schedule.lua's stored form: "<refuse until>\\n<producer id>\\n<layout>\\n<RESP args>"."""
    if not isinstance(raw, bytes):
        return None
    try:
        _until, producer, layout, body = raw.split(b"\n", 3)
        parts = dict(zip(layout.decode(), decode_bulks(body, len(layout)), strict=True))
    except ValueError:  # not what schedule.lua stores
        return None
    return ScheduledMessage(
        topic=topic,
        partition=partition,
        schedule_id=schedule_id,
        due_ms=due_ms,
        producer_id=int(producer) if producer.isdigit() else None,
        key=parts.get("k") or None,
        value=parts.get("v", b""),
        headers=decode_headers(parts.get("h") or None),
        message_id=parts.get("m") or None,
    )


def _pairs(reply: Any) -> list[tuple[bytes, int]]:
    """ZRANGE ... WITHSCORES (RESP2 flat or pairs, RESP3 pairs) as (member, score ms); members
    stay bytes (a message id need not be UTF-8)."""
    if not reply:
        return []
    if isinstance(reply[0], list | tuple):
        return [(bytes(m), int(float(s))) for m, s in reply]
    it = iter(reply)
    return [(bytes(m), int(float(s))) for m, s in zip(it, it, strict=True)]


def scheduled_messages(
    keys: KeySpace, next_due: dict[tuple[str, int], int], count: int = 50
) -> Operation[list[ScheduledMessage]]:
    """The first `count` scheduled messages by due time, given each partition's next due time
    (from the namespace snapshot): two round trips. Only the `count` partitions due first are
    read: a message among the first `count` has at most count - 1 before it, so at most
    count - 1 other partitions are due before its own."""
    partitions = heapq.nsmallest(count, next_due.items(), key=lambda item: (item[1], item[0]))
    if not partitions:
        return []
    replies = yield [
        Command(("ZRANGE", keys.scheduled(t, p), 0, count - 1, "WITHSCORES"))
        for (t, p), _ in partitions
    ]
    due = heapq.nsmallest(
        count,
        (
            (score, t, p, member)
            for ((t, p), _), reply in zip(partitions, replies, strict=True)
            for member, score in _pairs(read_reply(reply, f"topic {t!r} partition {p}'s schedule"))
        ),
    )
    by_partition: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
    for score, t, p, member in due:
        by_partition.setdefault((t, p), []).append((score, member))
    wanted = list(by_partition.items())
    if not wanted:
        return []
    bodies = yield [
        Command(("HMGET", keys.scheduled_messages(t, p), *[m for _, m in members]))
        for (t, p), members in wanted
    ]
    found = []
    for ((t, p), members), reply in zip(wanted, bodies, strict=True):
        values = read_reply(reply, f"topic {t!r} partition {p}'s delayed messages")
        for (score, member), raw in zip(members, values, strict=False):
            message = _parse_scheduled(t, p, member, score, raw)
            if message is not None:  # delivered between the two round trips
                found.append(message)
    return sorted(found, key=lambda m: (m.due_ms, m.topic, m.partition, m.schedule_id))
