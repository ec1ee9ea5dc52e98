"""Produce-side scripts: producer identities, fencing, and appending sealed batches.

Identities never repeat, whatever Redis forgets (a restart without persistence, an AOF loss, a
failover): an anonymous producer's id is 63 random bits drawn when it starts, a named producer's
id is a hash of its name (every instance of a name shares it, as in Kafka), and epochs are taken
from the server's clock (init_producer.lua), so an instance started later outranks every earlier
one even when the registration of the name was lost. No counter in Redis hands anything out.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from redisq.model.batches import blob_and_ids, blob_from_resp
from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.protocol import Command, ScriptCall, Step, text
from redisq.protocol.resp import bulk_header

MODES = ("sequence", "message_id", None)
# Managed servers cap a command's arguments (ElastiCache Serverless refuses 4,000 or more): a
# script call, its name, key count, keys and fixed arguments included, stays below this.
MAX_COMMAND_ARGS = 3_998
# What a produce or schedule call carries besides its messages' arguments, with room to spare:
# EVALSHA, the digest, the key count, up to 6 keys and up to 11 fixed arguments are 20.
RESERVED_ARGS = 48


def messages_per_call(args_per_message: int) -> int:
    """The most messages one script call can carry at args_per_message arguments each."""
    return (MAX_COMMAND_ARGS - RESERVED_ARGS) // args_per_message


REGISTRY_TTL_MS = 7 * 24 * 3600 * 1000
_ID_MASK = (1 << 63) - 1

# The per-message argument layout of a batch (see lua/includes/append.lua), by
# (has key, has headers, has message id).
LAYOUTS: Mapping[tuple[bool, bool, bool], str] = {
    (k, h, m): ("k" if k else "") + "v" + ("h" if h else "") + ("m" if m else "")
    for k in (False, True)
    for h in (False, True)
    for m in (False, True)
}


def random_producer_id() -> int:
    """63 random bits (a positive signed 64-bit integer, as Kafka's and Spark's longs): two
    producers share one with probability n^2 / 2^64 for n producers alive within the state ttl."""
    while True:
        pid = secrets.randbits(63)
        if pid:
            return pid


def named_producer_id(name: str) -> int:
    """The id every instance of a named producer writes under; instances differ by epoch."""
    digest = hashlib.blake2b(b"redisq-producer\0" + name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") & _ID_MASK) or 1


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """Who writes: the producer id, the instance's epoch, and the name (None: anonymous)."""

    producer_id: int
    epoch: int
    name: str | None = None

    @property
    def named(self) -> bool:
        return self.name is not None


def encode_message(
    key: bytes | None, value: bytes, headers: bytes | None, message_id: bytes | None
) -> list[bytes]:
    """A message's per-message arguments as RESP bulk strings, in LAYOUTS order (k v h m); None
    leaves an argument out (its letter is not in the layout), b"" sends it empty (the general
    layouts of append.lua then omit that field)."""
    parts: list[bytes] = []
    if key is not None:
        parts += (bulk_header(len(key)), key, b"\r\n")
    parts += (bulk_header(len(value)), value, b"\r\n")
    if headers is not None:
        parts += (bulk_header(len(headers)), headers, b"\r\n")
    if message_id is not None:
        parts += (bulk_header(len(message_id)), message_id, b"\r\n")
    return parts


class SealedBatch(Protocol):
    """A batch as the producer and the Spark writer hold it: frozen once sealed, so a retry
    re-sends exactly the same messages with the same base sequence."""

    topic: str
    partition: int
    layout: str
    count: int
    base_seq: int
    args: list[bytes]  # RESP pieces of every message (encode_message), in order
    body: bytes | None  # the joined arguments, made once at the first send
    body_count: int


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The broker's answer for one batch.

    sequence / no idempotence: first_id (messages have consecutive IDs from it, None if the
    broker no longer remembers a duplicate's offsets) and duplicate.
    message_id: flags ("0" appended, "1" duplicate, per message), first_id of the appended ones
    and the original IDs of the duplicates, in order.
    """

    first_id: str | None
    duplicate: bool = False
    flags: str | None = None
    duplicate_ids: tuple[str, ...] = ()


def _sequence_reply(reply: Any) -> BatchResult:
    return BatchResult(
        first_id=text(reply[1]) if len(reply) > 1 else None, duplicate=reply[0] == b"DUP"
    )


def _message_id_reply(reply: Any) -> BatchResult:
    return BatchResult(
        first_id=text(reply[1]) or None,
        flags=text(reply[0]),
        duplicate_ids=tuple(text(r) for r in reply[2:]),
    )


def sequence_bulks(first: int, count: int) -> bytes:
    """The RESP bulk strings of the decimal numbers first, first + 1, ..., first + count - 1.

    Numbers of one width share their header, so each run of them is one str.join over
    map(str, range(...)): no Python-level work per number."""
    runs: list[str] = []
    number, end = first, first + count
    while number < end:
        digits = len(str(number))
        stop = min(end, 10**digits)
        header = f"${digits}\r\n"
        runs.append(header + f"\r\n{header}".join(map(str, range(number, stop))) + "\r\n")
        number = stop
    return "".join(runs).encode()


def _body(
    batch: SealedBatch, sequences: bool, packed: bool = False, with_ids: bool = False
) -> tuple[bytes, int]:
    """The batch's arguments joined once; a retry sends exactly these bytes. packed: one
    argument, the batch's blob (a batch entry, model/batches.py), instead of the messages';
    with_ids: then the messages' ids, one argument each (produce_message_id.lua)."""
    if batch.body is None and packed:
        if with_ids:
            blob, ids = blob_and_ids(batch.layout, batch.count, b"".join(batch.args))
        else:
            blob, ids = blob_from_resp(batch.layout, batch.count, b"".join(batch.args)), b""
        batch.body = b"".join((bulk_header(len(blob)), blob, b"\r\n", ids))
        batch.body_count = 1 + (batch.count if with_ids else 0)
    if batch.body is None:
        parts = batch.args
        batch.body_count = batch.count * len(batch.layout)
        if sequences:
            parts = [*parts, sequence_bulks(batch.base_seq, batch.count)]
            batch.body_count += batch.count
        batch.body = b"".join(parts)
    return batch.body, batch.body_count


def produce(
    keys: KeySpace,
    mode: str | None,
    identity: ProducerIdentity,
    config: TopicConfig,
    batch: SealedBatch,
    *,
    acked_next: int,
    window: int,
    retry_horizon_ms: int = 0,
) -> ScriptCall[BatchResult]:
    """Append a sealed batch: produce_sequence.lua, produce_message_id.lua or produce.lua.

    acked_next: the sequence (message_id mode: batch number) after the last batch of this
    identity acknowledged on the partition; window: batches remembered with their offsets;
    retry_horizon_ms: how long the producer may re-send this batch (its delivery timeout): the
    state that makes a re-send a duplicate must live at least that long, whatever the topic's
    producer_state_ttl_ms.
    """
    state_ttl_ms = max(config.state_ttl_ms, retry_horizon_ms)
    topic, p = batch.topic, batch.partition
    log_key = keys.log(topic, p)
    named = "1" if identity.named else "0"
    packed = config.entry_format == "batch"
    counts = (keys.counts(topic, p),) if packed else ()  # the scripts count batch entries
    if mode == "sequence":
        body, count = _body(batch, sequences=not packed, packed=packed)
        return ScriptCall(
            "produce_sequence",
            (log_key, keys.producer_state(topic, p, identity.producer_id), *counts),
            (
                identity.producer_id,
                identity.epoch,
                batch.base_seq,
                batch.count,
                acked_next,
                window,
                state_ttl_ms,
                config.retention_messages,
                config.retention_ms,
                "b" if packed else batch.layout,
                named,
            ),
            _sequence_reply,
            topic,
            body,
            count,
        )
    if mode == "message_id":
        body, count = _body(batch, sequences=False, packed=packed, with_ids=packed)
        return ScriptCall(
            "produce_message_id",
            (
                log_key,
                keys.dedup_bucket(topic, p, 0),
                keys.dedup_bucket(topic, p, 1),
                keys.producer_state(topic, p, identity.producer_id),
                *counts,
            ),
            (
                identity.producer_id,
                identity.epoch,
                config.dedup_window_ms,
                config.retention_messages,
                config.retention_ms,
                # "b:": the batch's blob then its ids, written as one batch entry
                f"b:{batch.layout}" if packed else batch.layout,
                batch.count,
                batch.base_seq,  # the batch number, in this mode
                acked_next,
                state_ttl_ms,
                named,
            ),
            _message_id_reply,
            topic,
            body,
            count,
        )
    body, count = _body(batch, sequences=False, packed=packed)
    return ScriptCall(
        "produce",
        (log_key, *counts),
        (
            identity.producer_id,
            config.retention_messages,
            config.retention_ms,
            "b" if packed else batch.layout,
            batch.count,
        ),
        _sequence_reply,
        topic,
        body,
        count,
    )


def _init_reply(reply: Any) -> tuple[int, list[str]]:
    return int(reply[0]), [text(t) for t in reply[1:]]


def init_named_producer(
    keys: KeySpace, name: str, held_epoch: int | None = None
) -> ScriptCall[tuple[int, list[str]]]:
    """init_producer.lua: a new epoch for the name, and the topics its instances wrote to.
    held_epoch: the renewing instance's epoch (refused with ProducerFenced if superseded)."""
    return ScriptCall(
        "init_producer",
        (keys.named_producer(name), keys.named_producer_topics(name)),
        (REGISTRY_TTL_MS, "" if held_epoch is None else held_epoch),
        _init_reply,
    )


def register_topic(keys: KeySpace, identity: ProducerIdentity, topic: str) -> ScriptCall[Any]:
    """register_producer_topic.lua: prove the instance's epoch is still its name's (topic ""
    checks only); ProducerFenced if a newer instance started."""
    name = identity.name or ""
    return ScriptCall(
        "register_producer_topic",
        (keys.named_producer(name), keys.named_producer_topics(name)),
        (identity.epoch, topic, REGISTRY_TTL_MS),
        topic=topic or "?",
    )


def fence_partition(
    keys: KeySpace, identity: ProducerIdentity, config: TopicConfig, partition: int
) -> ScriptCall[bool]:
    """fence_producer.lua: store the instance's epoch on one partition (older epochs are refused
    there from now on); ProducerFenced if a newer one is stored."""
    return ScriptCall(
        "fence_producer",
        (keys.producer_state(config.name, partition, identity.producer_id),),
        (identity.epoch, config.state_ttl_ms),
        lambda reply: bool(int(reply)),
        config.name,
    )


def ack_barrier(anchor: str) -> ScriptCall[Any]:
    """ack_barrier.lua in the slot of anchor (a key holding data there), for a WAIT / WAITAOF
    after it on the same connection."""
    return ScriptCall("ack_barrier", (anchor, f"{anchor}:barrier"), ())


def ack_wait(acks: str, min_replicas: int, ack_timeout_ms: int) -> Command[Any]:
    """WAIT (acks="replicas") or WAITAOF (acks="fsync") after each node's own writes of a
    transport round (redisq.server.transport.StepRound)."""
    if acks == "replicas":
        # Not again on another connection: it would confirm nothing written there.
        return Command(("WAIT", min_replicas, ack_timeout_ms), nodes="written", retry_safe=False)
    return Command(("WAITAOF", 1, 0, ack_timeout_ms), nodes="written", retry_safe=False)


def replicated(anchors: list[str], acks: str, min_replicas: int, ack_timeout_ms: int) -> list[Step]:
    """The steps that confirm acks="replicas" / "fsync" for writes already made in the slots of
    `anchors`: ack_barrier.lua in each, then WAIT / WAITAOF after each node's own barriers. The
    last result maps each barrier's index to its node's WAIT / WAITAOF reply."""
    return [*map(ack_barrier, anchors), ack_wait(acks, min_replicas, ack_timeout_ms)]
