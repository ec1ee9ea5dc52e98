"""The producer's wire codec, shared by the thread and the asyncio drivers. No I/O.

`MessageEncoder` checks and encodes one message (types, size, message id, partition): the hot
path of send_async. `Round` is what one write to the servers holds: per node, the batches'
EVALSHA commands (behind ASKING after an ASK redirection) and WAIT/WAITAOF for stronger acks;
`Round.settle` reads the replies into the core's decisions.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import redis

from redisq import errors
from redisq.errors import MessageTooLarge, NotEnoughReplicas
from redisq.model.keys import KeySpace
from redisq.model.msgid import MessageIdGenerator
from redisq.model.partitioner import StickyPartitioner, partition_for_key
from redisq.model.records import encode_headers
from redisq.model.topic import TopicConfig
from redisq.produce.accumulator import Batch, ProducerCore
from redisq.protocol import ScriptCall
from redisq.protocol import produce as protocol
from redisq.protocol.produce import LAYOUTS, ProducerIdentity, encode_message
from redisq.protocol.resp import BULK_HEADERS, command
from redisq.protocol.rounds import Redirect, Router
from redisq.settings import ProducerSettings

log = logging.getLogger("redisq.producer")

_crc32 = zlib.crc32  # partitioner.partition_for_key, inlined on the hot path
_join = b"".join
_BULK = BULK_HEADERS
_CRLF = b"\r\n"
MAX_TIMESTAMP_MS = 1 << 48  # 48 bits of ms: year 10889, as a ULID's time


def serializer(spec: Callable[[Any], bytes] | str | None) -> Callable[[Any], bytes] | None:
    """A key/value serializer option as a function: "json" (compact UTF-8 JSON), "str"
    (str(value) in UTF-8), a callable returning bytes, or None (bytes and str as they are)."""
    if spec is None or callable(spec):
        return spec
    if spec == "json":
        return lambda value: json.dumps(value, separators=(",", ":")).encode()
    if spec == "str":
        return lambda value: str(value).encode()
    raise TypeError(f"a serializer is 'json', 'str' or a callable, not {spec!r}")


def refuse_timestamp_with_delay(timestamp_ms: int | None) -> None:
    if timestamp_ms is not None:
        raise errors.InvalidConfig(
            "timestamp_ms and a delay: a delayed message's time is when it is delivered"
        )


def as_bytes(what: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


def _check_partition_type(partition: object) -> None:
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"partition must be an int, not {type(partition).__name__}")


def _timestamp_field(timestamp_ms: object) -> bytes:
    """A send()'s timestamp_ms, checked, as the entry's field t."""
    if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int):
        raise TypeError(f"timestamp_ms must be an int, not {type(timestamp_ms).__name__}")
    if not 0 <= timestamp_ms <= MAX_TIMESTAMP_MS:
        raise ValueError(f"timestamp_ms={timestamp_ms}: ms since the epoch, 0 to 2**48")
    return b"%d" % timestamp_ms


class Encoded:
    """One checked, encoded message: where it goes and its RESP pieces."""

    __slots__ = ("partition", "layout", "parts", "size")

    def __init__(self, partition: int, layout: str, parts: list[bytes], size: int) -> None:
        self.partition = partition
        self.layout = layout
        self.parts = parts
        self.size = size


class MessageEncoder:
    """Checks a message, picks its partition and encodes it once (the sender only joins the
    pieces). Raises at once on bad input, before anything is queued."""

    def __init__(self, settings: ProducerSettings) -> None:
        self._max_bytes = settings.max_message_bytes
        self._selector = settings.partitioner
        self._sticky = StickyPartitioner()
        self._ids = MessageIdGenerator() if settings.idempotence == "message_id" else None
        self._key_serializer = serializer(settings.key_serializer)
        self._value_serializer = serializer(settings.value_serializer)
        self._serializing = bool(self._key_serializer or self._value_serializer)

    def serialize(self, value: Any, key: Any) -> tuple[Any, Any]:
        """The configured serializers applied (a key of None stays None)."""
        if self._value_serializer is not None:
            value = self._value_serializer(value)
        if key is not None and self._key_serializer is not None:
            key = self._key_serializer(key)
        return value, key

    def batch_sealed(self, batch: Batch) -> None:
        self._sticky.batch_sealed(batch.topic, batch.partition, batch.config.partitions)

    def check(
        self,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """The checks of encode() that need no topic: types, sizes, an empty key or id, the
        partition's type, the timestamp. (Only a partition's range needs the topic.)"""
        if self._serializing:
            value, key = self.serialize(value, key)
        self._fields(value, key, headers, message_id, generate=False)
        if partition is not None:
            _check_partition_type(partition)
        if timestamp_ms is not None:
            _timestamp_field(timestamp_ms)

    def _fields(
        self,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        generate: bool = True,
    ) -> tuple[bytes, bytes | None, bytes | None, bytes | None, int]:
        # The common case (bytes value and key, no headers) is kept to a handful of checks.
        if type(value) is not bytes:
            value = as_bytes("value", value)
        size = len(value)
        if key is not None:
            if type(key) is not bytes:
                key = as_bytes("key", key)
            if not key:
                raise ValueError("key must not be empty; use key=None for a message without a key")
            size += len(key)
        headers_b = (encode_headers(headers) or None) if headers is not None else None
        if headers_b:
            size += len(headers_b)
        mid: bytes | None = None
        if message_id is not None:
            if isinstance(message_id, int) and not isinstance(message_id, bool):
                mid = b"%d" % message_id
            else:
                mid = as_bytes("message_id", message_id)
            if not mid:
                raise ValueError("message_id must not be empty")
            size += len(mid)  # the caller's bytes: key, value, headers and id
        if size > self._max_bytes:
            raise MessageTooLarge(size, self._max_bytes)
        if mid is None and self._ids is not None and generate:
            mid = self._ids.next_id()
            size += len(mid)  # not held against max_message_bytes, but it fills the batch
        return value, key, headers_b, mid, size

    def encode(
        self,
        config: TopicConfig,
        value: Any,
        key: Any,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        timestamp_ms: int | None = None,
    ) -> Encoded:
        """Check, route and encode one message (serialized first, if configured)."""
        if self._serializing:
            value, key = self.serialize(value, key)
        return self._encode(config, value, key, headers, message_id, partition, timestamp_ms)

    def _encode(
        self,
        config: TopicConfig,
        value: bytes | str,
        key: bytes | str | None,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        timestamp_ms: int | None,
    ) -> Encoded:
        value, key, headers_b, mid, size = self._fields(value, key, headers, message_id)
        partitions = config.partitions
        if partition is not None:
            _check_partition_type(partition)
            if not 0 <= partition < partitions:
                raise errors.PartitionOutOfRange(config.name, partition, partitions)
        elif self._selector is not None:
            partition = self._selector(config.name, key, value, partitions)
            if type(partition) is not int or not 0 <= partition < partitions:
                raise errors.PartitionOutOfRange(config.name, partition, partitions)
        elif key is not None:
            partition = partition_for_key(key, partitions)
        elif mid is not None and self._ids is not None:
            partition = partition_for_key(mid, partitions)  # an id's dedup scope is its partition
        else:
            partition = self._sticky.partition(config.name, partitions)
        layout = LAYOUTS[key is not None, headers_b is not None, mid is not None]
        parts = encode_message(key, value, headers_b, mid)
        if timestamp_ms is not None:  # Kafka's CreateTime: the entry's field t
            stamp = _timestamp_field(timestamp_ms)
            layout += "t"
            parts += (_BULK[len(stamp)], stamp, _CRLF)
        return Encoded(partition, layout, parts, size)

    def encode_fast(
        self,
        config: TopicConfig,
        value: Any,
        key: Any,
        headers: Mapping[str, str | bytes] | None,
        message_id: bytes | str | int | None,
        partition: int | None,
        timestamp_ms: int | None = None,
    ) -> tuple[int, str, bytes | list[bytes], int]:
        """encode() as (partition, layout, RESP pieces, size), for send_async's hot path.

        A keyed message without headers, an explicit partition or a custom selector (with or
        without a message id: the common shapes) is checked and encoded here in one step, as
        one bytes object; anything else, and every error, goes through encode(). Same checks,
        same bytes on the wire."""
        if self._serializing:
            value, key = self.serialize(value, key)
        if (
            key is not None
            and headers is None
            and partition is None
            and self._selector is None
            and timestamp_ms is None
        ):
            if type(value) is not bytes:
                value = value.encode() if type(value) is str else as_bytes("value", value)
            if type(key) is not bytes:
                key = key.encode() if type(key) is str else as_bytes("key", key)
            key_len, value_len = len(key), len(value)
            size = key_len + value_len
            if key_len and size <= self._max_bytes and value_len < 4096 and key_len < 4096:
                if message_id is None and self._ids is None:
                    return (
                        _crc32(key) % config.partitions,
                        "kv",
                        _join((_BULK[key_len], key, _CRLF, _BULK[value_len], value, _CRLF)),
                        size,
                    )
                if type(message_id) is str:
                    message_id = message_id.encode()
                if (
                    type(message_id) is bytes
                    and message_id
                    and len(message_id) < 4096
                    and size + len(message_id) <= self._max_bytes
                ):
                    return (
                        _crc32(key) % config.partitions,
                        "kvm",
                        _join(
                            (
                                _BULK[key_len],
                                key,
                                _CRLF,
                                _BULK[value_len],
                                value,
                                _CRLF,
                                _BULK[len(message_id)],
                                message_id,
                                _CRLF,
                            )
                        ),
                        size + len(message_id),
                    )
        message = self._encode(config, value, key, headers, message_id, partition, timestamp_ms)
        return message.partition, message.layout, message.parts, message.size


class Round:
    """Batches written together, per node, whose replies are still to be read."""

    __slots__ = ("nodes", "payloads", "tails")

    def __init__(self) -> None:
        self.nodes: dict[str, list[tuple[Batch, Callable[[Any], Any]] | None]] = {}
        self.payloads: dict[str, bytes] = {}
        # acks="replicas" / "fsync": the replies after a node's batches (ASKING, the barrier,
        # WAIT / WAITAOF)
        self.tails: dict[str, int] = {}

    @classmethod
    def build(
        cls,
        work: list[Batch],
        *,
        core: ProducerCore,
        keys: KeySpace,
        settings: ProducerSettings,
        identity: ProducerIdentity,
        pack: Callable[[ScriptCall[Any]], bytes],
        router: Router,
    ) -> Round:
        round_ = cls()
        parts_by_node: dict[str, list[bytes]] = {}
        anchors: dict[str, tuple[str, bool]] = {}  # per node: a log written there, ASK-routed?
        for batch in work:
            call = protocol.produce(
                keys,
                settings.idempotence,
                identity,
                batch.config,
                batch,
                acked_next=core.acked_next(batch),
                window=settings.window,
                retry_horizon_ms=settings.delivery_timeout_ms,
            )
            key = call.keys[0]
            node = router.node_for(key)
            parts = parts_by_node.setdefault(node, [])
            entries = round_.nodes.setdefault(node, [])
            asked = router.asking(key)
            if asked:
                router.forget_asking(key)
                parts.append(command(b"ASKING", ()))
                entries.append(None)
            parts.append(pack(call))
            entries.append((batch, call.decode))
            if node not in anchors or anchors[node][1]:
                anchors[node] = (key, asked)
        wait = b""  # WAIT / WAITAOF, packed once for every node of the round
        if settings.acks != "leader":
            step = protocol.ack_wait(settings.acks, settings.min_replicas, settings.ack_timeout_ms)
            wait = command(step.args[0].encode(), step.args[1:])
        for node, parts in parts_by_node.items():
            if wait:
                # A barrier write of this connection's own before WAIT / WAITAOF: a batch whose
                # retry is answered as a duplicate writes nothing, and on a new connection WAIT
                # would then confirm nothing (see lua/ack_barrier.lua).
                anchor, asked = anchors[node]
                if asked:
                    parts.append(command(b"ASKING", ()))
                parts += [pack(protocol.ack_barrier(anchor)), wait]
                round_.tails[node] = 3 if asked else 2
            round_.payloads[node] = b"".join(parts)
        return round_

    def batches(self) -> list[Batch]:
        return [entry[0] for entries in self.nodes.values() for entry in entries if entry]

    def expected_replies(self, node: str) -> int:
        return len(self.nodes[node]) + self.tails.get(node, 0)

    def settle(
        self,
        replies: dict[str, list[Any]],
        *,
        core: ProducerCore,
        keys: KeySpace,
        settings: ProducerSettings,
        router: Router,
        forget_topic: Callable[[str], None],
    ) -> tuple[bool, bool]:
        """Hand each batch's reply to the core; returns (progress, retry)."""
        progress = retry = False
        for node, entries in self.nodes.items():
            node_replies = list(replies[node])
            tail = node_replies[len(entries) :]
            durable_error = tail_failure(tail, settings) if tail else None
            for entry, reply in zip(entries, node_replies[: len(entries)], strict=True):
                if entry is None:  # the reply to ASKING
                    continue
                batch, decode = entry
                if isinstance(reply, Redirect):
                    if reply.kind == "ASK":
                        router.note_ask(keys.log(batch.topic, batch.partition), reply.node)
                    core.redirected(batch)
                    retry = True
                elif isinstance(reply, Exception):
                    mapped = (
                        errors.from_reply(str(reply), batch.topic)
                        if isinstance(reply, redis.ResponseError)
                        else None
                    )
                    if isinstance(mapped, errors.TopicNotFound):
                        forget_topic(batch.topic)  # deleted: the next send reads it again
                    core.refused(batch, mapped or reply)
                    retry = True
                elif durable_error is not None:
                    if str(durable_error).startswith("NOSCRIPT"):  # the barrier's
                        core.reload_scripts = True
                    core.not_durable(batch, durable_error)
                    batch.unknown = True  # stored on the primary, maybe not on a replica
                    retry = True
                else:
                    core.complete(batch, decode(reply))
                    progress = True
            if durable_error is not None and str(durable_error).startswith("NOSCRIPT"):
                # A new or restarted server: the scripts load on first use, and the round
                # goes again (nothing lost, nothing to tell the user)
                log.debug("the acks barrier script was not loaded yet: loading it")
            elif durable_error is not None:
                log.warning("acks=%s not confirmed: %s", settings.acks, durable_error)
        return progress, retry


def tail_failure(tail: list[Any], settings: ProducerSettings) -> BaseException | None:
    """What the barrier and WAIT / WAITAOF replies after a node's batches say against them."""
    barrier = tail[-2]
    if isinstance(barrier, Redirect):
        return redis.ResponseError(f"the acks barrier was redirected: {barrier}")
    if isinstance(barrier, BaseException):
        return barrier
    return ack_failure(tail[-1], settings)


def ack_failure(reply: Any, settings: ProducerSettings) -> BaseException | None:
    """What the WAIT / WAITAOF reply of a node's round (acks="replicas" / "fsync") says against
    the batches written there before it: None if they are acknowledged."""
    if isinstance(reply, Exception):
        return reply
    count = int(reply[0] if isinstance(reply, list) else reply)
    needed = settings.min_replicas if settings.acks == "replicas" else 1
    if count < needed:
        return NotEnoughReplicas(
            f"acks={settings.acks}: {count} of {needed} acknowledged "
            f"within {settings.ack_timeout_ms} ms"
        )
    return None


def scripts_for(settings: ProducerSettings) -> tuple[str, ...]:
    """The scripts a producer's sender runs (loaded again after NOSCRIPT): the produce script of
    its idempotence mode, fencing, and the acks barrier unless acks="leader"."""
    produce = {"sequence": "produce_sequence", "message_id": "produce_message_id"}.get(
        settings.idempotence or "", "produce"
    )
    barrier = () if settings.acks == "leader" else ("ack_barrier",)
    return (produce, "fence_producer", *barrier)
