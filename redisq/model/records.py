"""What goes into a partition stream and what comes back out: the one entry decoder.

A stream entry has the fields ``v`` (value), and when present ``k`` (key), ``h`` (headers),
``m`` (message id), ``p`` (producer id) and ``s`` (sequence). Headers are one binary field:
for each header, a 2-byte name length, the UTF-8 name, a 4-byte value length and the value
(big-endian), so header values may be any bytes and the Lua scripts never parse them.

Any client can XADD to a partition stream, so an entry may not be one redisq wrote. The rules,
shared by the consumer, `Broker.read` and the Spark reader:

* ``p`` and ``s`` are ASCII decimal digits, at most 19, below 2**63 (`parse_id_field`), so they
  fit Spark's bigint; ``h`` is a complete headers blob (`parse_headers`); ``v`` is present.
  Keys, values and message ids are opaque bytes.
* Fields with other names are ignored, so an older consumer reads what a newer producer adds.
* A name given twice counts with its last value, as redis-py's reply parsing reads it: every
  path (raw replies, redis-py's parsed ones, Spark) then agrees on what an entry says.
* An entry that breaks a rule decodes as a `MalformedMessage`: a Message carrying the reason,
  the raw fields, and every field that could be read. The consumer never hands one to a handler;
  the group's failure policy takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any, Protocol

from redisq.errors import RedisqError
from redisq.model import batches, native
from redisq.model.fields import (
    MAX_ID_FIELD,
    as_bytes,
    decode_headers,
    field_map,
    parse_id_field,
    raw_pairs,
    show,
)
from redisq.model.fields import encode_headers as encode_headers
from redisq.model.fields import parse_headers as parse_headers


class MalformedEntry(RedisqError, ValueError):
    """A stream entry that is not a redisq message (written by another client, or damaged).

    Raised by `Broker.read(on_malformed="raise")` and by the Spark reader with
    failOnMalformed=true; the consumer hands such entries to the group's failure policy."""

    def __init__(self, topic: str, partition: int, offset: str, reason: str) -> None:
        super().__init__(f"malformed entry {topic}/{partition}@{offset}: {reason}")
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.reason = reason


# -- records -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """What the broker answered for one sent message.

    offset is the stream ID. duplicate=True means the message had been written before and
    nothing was written now; offset is then the original ID, or None when the broker no longer
    remembers it (a duplicate older than the producer's window).

    A delayed message (send(..., delay_ms=...)) has no offset yet (None): schedule_id names it
    in its partition's schedule and deliver_at_ms is when it is due (the server's clock; None
    when it had already been delivered, duplicate=True).
    """

    topic: str
    partition: int
    offset: str | None
    duplicate: bool = False
    schedule_id: str | None = None
    deliver_at_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One message read from a partition."""

    topic: str
    partition: int
    offset: str
    key: bytes | None
    value: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    timestamp_ms: int = 0
    producer_id: int | None = None
    sequence: int | None = None
    message_id: bytes | None = None
    attempt: int = 1

    @property
    def timestamp(self) -> float:
        """timestamp_ms in seconds: the producer's timestamp when it set one (send(...,
        timestamp_ms=): Kafka's CreateTime), else the append time (the stream ID's)."""
        return self.timestamp_ms / 1000.0

    @property
    def append_time_ms(self) -> int:
        """When the broker appended it (the stream ID's milliseconds: Kafka's LogAppendTime)."""
        return int(self.offset.partition("-")[0])


@dataclass(frozen=True, slots=True)
class MalformedMessage(Message):
    """An entry that breaks the rules of this module (see the module docstring).

    A subclass rather than an error attribute on Message: code typed for Message keeps working
    (ack() takes it), `isinstance(m, MalformedMessage)` is the one test, and the read hot path
    sets no extra slot on every good message.

    What could be read is set: offset and timestamp_ms always; key (``k``), value (``v``, else
    b""), message_id (``m``) as stored; headers when ``h`` is a valid blob, else {}; producer_id
    and sequence when they follow the rule, else None. raw_fields holds every field as stored,
    in order; reason says what is wrong.
    """

    reason: str = ""
    raw_fields: tuple[tuple[bytes, bytes], ...] = ()

    def error(self) -> MalformedEntry:
        return MalformedEntry(self.topic, self.partition, self.offset, self.reason)


# The read hot path builds Messages without the frozen dataclass's __init__ (which stores each
# field through object.__setattr__): it fills a _MessageFields, a plain class with the same slots,
# by ordinary attribute stores and then makes it a Message by assigning __class__ (the language
# allows that between classes with the same __slots__). Measured per message on this machine:
# 0.2-0.4 us, against 0.6-1.2 us through the slot descriptors' __set__ and more through __init__.
_MESSAGE_FIELDS = (
    "topic",
    "partition",
    "offset",
    "key",
    "value",
    "headers",
    "timestamp_ms",
    "producer_id",
    "sequence",
    "message_id",
    "attempt",
)


class _MessageFields:
    __slots__ = _MESSAGE_FIELDS
    topic: str
    partition: int
    offset: str
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    timestamp_ms: int
    producer_id: int | None
    sequence: int | None
    message_id: bytes | None
    attempt: int


_METADATA_FIELDS = ("topic", "partition", "offset", "duplicate", "schedule_id", "deliver_at_ms")


class _MetadataFields:
    __slots__ = _METADATA_FIELDS
    topic: str
    partition: int
    offset: str | None
    duplicate: bool
    schedule_id: str | None
    deliver_at_ms: int | None


def _check_layout(cls: type, fields_of: type, names: tuple[str, ...]) -> None:
    if tuple(f.name for f in fields(cls)) != names or getattr(cls, "__slots__", ()) != names:
        raise ImportError(f"{cls.__name__} changed: update records.{fields_of.__name__}")
    probe: Any = object.__new__(fields_of)
    for name in names:
        setattr(probe, name, None)
    probe.__class__ = cls  # TypeError here if the layouts differ


_check_layout(Message, _MessageFields, _MESSAGE_FIELDS)
_check_layout(RecordMetadata, _MetadataFields, _METADATA_FIELDS)

# Field layouts of includes/append.lua (names at the even positions of an entry's field list).
_K_V_P = [b"k", b"v", b"p"]
_V_P_S = [b"v", b"p", b"s"]
_K_V_M_P = [b"k", b"v", b"m", b"p"]
_K_V = [b"k", b"v"]
_K_V_H_P_S = [b"k", b"v", b"h", b"p", b"s"]
_MISSING: Any = object()


def batch_metadata(
    topic: str, partition: int, offsets: Sequence[str | None], duplicate: bool
) -> list[RecordMetadata]:
    """RecordMetadata of a sent batch's messages, one per offset (the asyncio producer settles a
    whole batch's futures at once), built as decode_entries builds Messages."""
    new = object.__new__
    result: list[RecordMetadata] = []
    append = result.append
    for offset in offsets:
        m = new(_MetadataFields)
        m.topic = topic
        m.partition = partition
        m.offset = offset
        m.duplicate = duplicate
        m.schedule_id = None
        m.deliver_at_ms = None
        m.__class__ = RecordMetadata  # type: ignore[assignment]
        append(m)  # type: ignore[arg-type]
    return result


def decode_entries_py(
    topic: str,
    partition: int,
    entries: Sequence[Any],
    deliveries: Sequence[Any] | None = None,
    *,
    after: str | None = None,
    upto: str | None = None,
    acked: Mapping[str, bytes] | None = None,
) -> list[Message]:
    """Stream entries (raw flat field lists, or dicts as redis-py's callbacks give them) as
    Messages, in order; an entry that breaks the rules becomes a MalformedMessage in its place.
    deliveries[i] is entry i's delivery count (the Message's attempt). Never raises for what an
    entry holds.

    A batch entry (model.batches) gives its n messages, at offsets ms-(s+i). after: messages at
    or before this offset are left out (a read that resumes inside an entry); upto: messages at
    or after this offset are left out (an exclusive end); acked: entry ID -> its settled bitmap,
    whose set bits are left out (DESIGN §14.8).

    This is the read hot path: the field layouts written by includes/append.lua are recognised
    by their field names and taken by position, the timestamp is parsed once per millisecond,
    producer ids once per call, and the Messages are built as _MessageFields."""
    messages: list[Message] = []
    append = messages.append
    new = object.__new__
    # The millisecond cache: "<digits>-" and its int. Only a prefix that parsed is kept, so an
    # entry decodes as it would alone (redisq._speedups hands entries to this function one at
    # a time): no ID is taken without being parsed, none gets another entry's milliseconds.
    ms_prefix = "0-"
    ms = 0
    producer_ids: dict[Any, int | None] = {}
    max_id = MAX_ID_FIELD
    bounds = None
    if after is not None or upto is not None:
        bounds = (
            batches.parse_offset(after) if after is not None else None,
            batches.parse_offset(upto) if upto is not None else None,
        )
    i = -1
    for entry_id, flat in entries:
        i += 1
        offset = entry_id.decode() if type(entry_id) is bytes else str(entry_id)
        attempt = max(1, int(deliveries[i])) if deliveries is not None else 1
        if (type(flat) is list and flat and flat[0] == b"b") or (
            type(flat) is dict and next(iter(flat), None) == b"b"
        ):
            found = field_map(flat)
            if found is not None and b"v" not in found:
                _decode_batch(
                    messages,
                    topic,
                    partition,
                    offset,
                    flat,
                    found,
                    attempt,
                    bounds,
                    acked.get(offset) if acked else None,
                )
                continue
        if bounds is not None and not _inside(offset, 0, bounds):
            continue
        try:
            if not offset.startswith(ms_prefix):
                dash = offset.find("-")
                if dash <= 0 or not offset[:dash].isdigit():
                    raise ValueError(offset)
                ms = int(offset[:dash])  # ValueError for some isdigit() ones, as "\u00b2"
                ms_prefix = offset[: dash + 1]
            blob = message_id = sequence = created = None
            # The layout idempotence="sequence" writes (the default), told without building a
            # list of the names (one allocation less per entry for the collector to count).
            if type(flat) is list and len(flat) == 8:
                n0, key, n1, value, n2, producer_id, n3, sequence = flat
                if n0 == b"k" and n1 == b"v" and n2 == b"p" and n3 == b"s":
                    names = None
                else:
                    names, sequence = flat[0::2], None
            else:
                names = flat[0::2] if type(flat) is list else _MISSING
            if names is None:
                pass
            elif names == _K_V_P:
                key, value, producer_id = flat[1], flat[3], flat[5]
            elif names == _V_P_S:
                key, value, producer_id, sequence = None, flat[1], flat[3], flat[5]
            elif names == _K_V_M_P:
                key, value, message_id, producer_id = flat[1], flat[3], flat[5], flat[7]
            elif names == _K_V:
                key, value, producer_id = flat[1], flat[3], None
            elif names == _K_V_H_P_S:
                key, value, blob, producer_id, sequence = (
                    flat[1],
                    flat[3],
                    flat[5],
                    flat[7],
                    flat[9],
                )
            else:
                found = field_map(flat)
                if found is None or b"v" not in found:
                    raise ValueError(offset)
                get = found.get
                key, value, blob = get(b"k"), found[b"v"], get(b"h")
                message_id, producer_id, sequence = get(b"m"), get(b"p"), get(b"s")
                stamp = get(b"t")  # the producer's timestamp (CreateTime), when it set one
                if stamp is not None:
                    if not stamp.isdigit() or len(stamp) > 15:
                        raise ValueError(offset)
                    created = int(stamp)
            if producer_id is not None:
                # Cached for plain bytes only: other objects equal to cached ones may parse
                # otherwise (a bytes subclass, an __eq__), so each entry decodes as it would alone.
                if type(producer_id) is bytes:
                    pid = producer_ids.get(producer_id, _MISSING)
                    if pid is _MISSING:
                        pid = producer_ids[producer_id] = parse_id_field(producer_id)
                else:
                    pid = parse_id_field(producer_id)
                if pid is None:
                    raise ValueError(offset)
            else:
                pid = None
            # isdigit() of bytes takes ASCII digits only; a str that int() refuses raises
            # here and is caught below: the rule is parse_id_field's.
            if sequence is not None:
                if not sequence.isdigit() or (seq := int(sequence)) > max_id:
                    raise ValueError(offset)
            else:
                seq = None
            headers = decode_headers(blob) if blob else {}
        except Exception:  # every rule broken, and anything unforeseen: never raise
            at_ms = ms if offset.startswith(ms_prefix) else 0
            append(_malformed(topic, partition, offset, at_ms, flat, attempt))
            continue
        m = new(_MessageFields)
        m.topic = topic
        m.partition = partition
        m.offset = offset
        m.key = key
        m.value = value
        m.headers = headers
        m.timestamp_ms = ms if created is None else created
        m.producer_id = pid
        m.sequence = seq
        m.message_id = message_id
        m.attempt = attempt
        m.__class__ = Message  # type: ignore[assignment]
        append(m)  # type: ignore[arg-type]
    return messages


def _inside(offset: str, span: int, bounds: tuple[Any, Any]) -> bool:
    """Whether an entry at offset holding span + 1 offsets keeps anything between the bounds
    (an entry whose ID is not a stream ID is kept: it decodes as malformed)."""
    at = batches.parse_offset(offset)
    if at is None:
        return True
    after, upto = bounds
    return (after is None or (at[0], at[1] + span) > after) and (upto is None or at < upto)


def _malformed_batch(
    messages: list[Message],
    topic: str,
    partition: int,
    offset: str,
    at: tuple[int, int] | None,
    flat: Any,
    attempt: int,
    bounds: tuple[Any, Any] | None,
    exc: Exception,
) -> None:
    """A batch entry that broke a rule, as one MalformedMessage at its ID (unless it lies
    outside the read's bounds)."""
    if bounds is not None and not _inside(offset, 0, bounds):
        return
    reason = str(exc) if isinstance(exc, ValueError) else f"undecodable batch entry: {exc!r}"
    messages.append(
        MalformedMessage(
            topic=topic,
            partition=partition,
            offset=offset,
            key=None,
            value=b"",
            timestamp_ms=at[0] if at is not None else 0,
            attempt=attempt,
            reason=f"batch entry: {reason}",
            raw_fields=tuple(raw_pairs(flat)),
        )
    )


def _decode_batch(
    messages: list[Message],
    topic: str,
    partition: int,
    offset: str,
    flat: Any,
    found: dict[Any, Any],
    attempt: int,
    bounds: tuple[Any, Any] | None,
    bitmap: bytes | None,
) -> None:
    """A batch entry's messages appended to messages (or one MalformedMessage at its ID)."""
    at = batches.parse_offset(offset)
    try:
        if at is None:
            raise batches.BadBatch(f"the entry ID {offset!r} is not a stream ID")
        ms, first_seq = at
        n = parse_id_field(found.get(b"n"))
        if n is None or n > batches.MAX_COUNT:
            raise batches.BadBatch(f"message count n={show(as_bytes(found.get(b'n')))}")
        if first_seq + n - 1 > batches.MAX_SEQ:
            raise batches.BadBatch(f"{n} messages from {offset} pass the last stream ID")
        for name in (b"c", b"s"):
            if name in found and parse_id_field(found[name]) is None:
                raise batches.BadBatch(
                    f"{name.decode()}={show(as_bytes(found[name]))} is not a decimal below 2**63"
                )
        producer_id = found.get(b"p")
        pid = None if producer_id is None else parse_id_field(producer_id)
        if producer_id is not None and pid is None:
            raise batches.BadBatch(f"producer id {show(as_bytes(producer_id))} is not a decimal")
        base = found.get(b"s")
        base_seq = None if base is None else parse_id_field(base)
        if base_seq is not None and base_seq + n - 1 > MAX_ID_FIELD:
            raise batches.BadBatch(f"sequences from s={base_seq} pass 2**63-1")
        blob = found.get(b"b")
        if type(blob) is not bytes:
            blob = as_bytes(blob)
        batch = None  # the C loop takes a blob without headers (and refuses a broken one)
        if _batch_messages is None or (len(blob) > 1 and blob[1] & batches.HEADERS):
            batch = batches.Batch(blob, n)
    except Exception as exc:  # every rule broken, and anything unforeseen: never raise
        _malformed_batch(messages, topic, partition, offset, at, flat, attempt, bounds, exc)
        return
    start, stop = 0, n
    if bounds is not None:
        after, upto = bounds
        if after is not None:
            if after[0] > ms:
                return
            if after[0] == ms:
                start = max(0, min(n, after[1] - first_seq + 1))
        if upto is not None:
            if upto[0] < ms:
                return
            if upto[0] == ms:
                stop = max(0, min(n, upto[1] - first_seq))
    header_maps = None
    try:
        if batch is None:
            args = (topic, partition, blob, n, ms, first_seq, start, stop, pid, base_seq)
            if _batch_messages is not None and _batch_messages(messages, *args, attempt, bitmap):
                return
            batch = batches.Batch(blob, n)  # refused by C: the rule it breaks, named
        if batch.headers is not None:
            header_maps = [decode_headers(h) if h else {} for h in batch.headers]
    except Exception as exc:
        _malformed_batch(messages, topic, partition, offset, at, flat, attempt, bounds, exc)
        return
    keys, values, ids, stamps = batch.keys, batch.values, batch.message_ids, batch.timestamps
    new = object.__new__
    prefix = f"{ms}-"
    for i in range(start, stop):
        if bitmap is not None and batches.acked_bit(bitmap, i):
            continue
        m = new(_MessageFields)
        m.topic = topic
        m.partition = partition
        m.offset = prefix + str(first_seq + i)
        m.key = (keys[i] or None) if keys is not None else None
        m.value = values[i]
        m.headers = header_maps[i] if header_maps is not None else {}
        m.timestamp_ms = stamps[i] if stamps is not None else ms
        m.producer_id = pid
        m.sequence = base_seq + i if base_seq is not None else None
        m.message_id = (ids[i] or None) if ids is not None else None
        m.attempt = attempt
        m.__class__ = Message  # type: ignore[assignment]
        messages.append(m)  # type: ignore[arg-type]


# run()'s workers (both modes) decode and handle a read this many entries at a time: the
# Messages of a chunk die once it is handled, so the collector (triggered by how many objects
# are alive) runs less often and finds fewer to trace. Measured on one 1,000-entry read decoded
# and handled: 1.45 us per entry in chunks of 64 against 1.77 us all at once (1.23 us with the
# collector off); chunks of 32 or 128 did no better.
DECODE_CHUNK = 64


def decode_lazily(
    topic: str, partition: int, entries: list[Any], size: int = DECODE_CHUNK
) -> Iterator[Message]:
    """decode_entries for a caller that handles each message before taking the next: `size`
    entries are decoded at a time, so the Messages it has handled can die young."""
    return chain.from_iterable(
        decode_entries(topic, partition, entries[start : start + size])
        for start in range(0, len(entries), size)
    )


def decode_entry(
    topic: str, partition: int, entry_id: Any, fields: Mapping[bytes, bytes] | Sequence[bytes]
) -> Message:
    """One stream entry as a Message (or a MalformedMessage); see decode_entries."""
    return decode_entries(topic, partition, [(entry_id, fields)])[0]


def _malformed(
    topic: str, partition: int, offset: str, ms: int, flat: Any, attempt: int
) -> MalformedMessage:
    """The slow path: read what can be read and say everything that is wrong."""
    pairs = raw_pairs(flat)
    reasons: list[str] = []
    if flat is None or not pairs:
        reasons.append("the entry has no fields")
    elif isinstance(flat, list | tuple) and len(flat) % 2:
        reasons.append(f"an odd number of field items ({len(flat)}): names and values do not pair")
    last = dict(pairs)  # a repeated name counts with its last value (field_map)
    if pairs and b"v" not in last:
        reasons.append("no value field 'v'")
    producer_id = sequence = None
    if b"p" in last:
        producer_id = parse_id_field(last[b"p"])
        if producer_id is None:
            reasons.append(f"producer id {show(last[b'p'])} is not a decimal below 2**63")
    if b"s" in last:
        sequence = parse_id_field(last[b"s"])
        if sequence is None:
            reasons.append(f"sequence {show(last[b's'])} is not a decimal below 2**63")
    headers: dict[str, bytes] = {}
    if last.get(b"h"):
        try:
            headers = decode_headers(last[b"h"])
        except ValueError as exc:
            reasons.append(str(exc))
    dash = offset.find("-")
    if dash <= 0 or not offset[:dash].isdigit():
        reasons.append(f"the entry ID {offset!r} is not a stream ID")
    if not reasons:  # pragma: no cover - the fast path sent a valid entry here
        reasons.append("undecodable entry")
    return MalformedMessage(
        topic=topic,
        partition=partition,
        offset=offset,
        key=last.get(b"k"),
        value=last.get(b"v", b""),
        headers=headers,
        timestamp_ms=ms,
        producer_id=producer_id,
        sequence=sequence,
        message_id=last.get(b"m"),
        attempt=attempt,
        reason="; ".join(reasons),
        raw_fields=tuple(pairs),
    )


class _Decoder(Protocol):
    def __call__(
        self, topic: str, partition: int, entries: Sequence[Any], deliveries: Any = None
    ) -> list[Message]: ...


# decode_entries: redisq._speedups' C decoder when it was built (hatch_build.py), 3-4 times
# faster per entry; it hands every entry outside the plain layouts (batch entries too) to
# decode_entries_py. A read that cuts entries (after, upto, acked) calls decode_entries_py.
decode_entries: _Decoder = decode_entries_py
# _batch_messages: the C loop over a batch entry's messages (its blob without headers), which
# decode_entries_py calls for every batch entry; None in pure Python.
_batch_messages: Callable[..., bool] | None = None
_speedups = native.load()
if _speedups is not None:
    _speedups.set_layout(Message, _MESSAGE_FIELDS, decode_entries_py)
    decode_entries = _speedups.decode_entries
    _batch_messages = _speedups.batch_messages
