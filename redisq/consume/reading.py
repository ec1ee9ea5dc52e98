"""What a consumer's reads give back, taken apart without I/O: the deserializers, the replies of
the parked-key and offset reads, and the rest of an orderly poll() read cut at max_messages."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from redisq.consume.dispatch import OrderlyPartition
from redisq.consume.ownership import TopicPartition
from redisq.model.keys import KeySpace
from redisq.model.records import Message, decode_entries


def deserializer(spec: Callable[[bytes], Any] | str | None) -> Callable[[bytes], Any] | None:
    """A key/value deserializer from its option: "json", "str", a callable, or None."""
    if spec == "json":
        return json.loads
    if spec == "str":
        return lambda raw: raw.decode()
    return spec if callable(spec) else None


def deserialize(
    message: Message,
    key_decoder: Callable[[bytes], Any] | None,
    value_decoder: Callable[[bytes], Any] | None,
) -> Message:
    changes: dict[str, Any] = {}
    if key_decoder is not None and message.key is not None:
        changes["key"] = key_decoder(message.key)
    if value_decoder is not None:
        changes["value"] = value_decoder(message.value)
    return replace(message, **changes) if changes else message


def parked_reads(keys: KeySpace, group: str, tp: TopicPartition) -> list[tuple[str, str]]:
    """load_parked's two reads, sent in one round trip (the keys share the partition's slot)."""
    return [
        ("HGETALL", keys.parked_keys(tp[0], tp[1], group)),
        ("HGETALL", keys.held_messages(tp[0], tp[1], group)),
    ]


def hashes(replies: list[Any]) -> list[dict[bytes, bytes]]:
    """Raw HGETALL replies (RESP2 flat lists or RESP3 maps) as dicts; an error reply raises."""
    result = []
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
        result.append(
            reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
        )
    return result


def offset_entries(tp: TopicPartition, replies: list[Any], offsets: list[str]) -> list[Message]:
    """The messages at `offsets` in fetch_offsets' replies (each the entry at or before its
    offset: a message entry at it, a batch entry holding it, or else the offset is gone: a hole,
    trimmed). An error reply raises: read as "no entry"
    it made a blocked message look deleted (passed over, never handled) and a released held
    message look trimmed, when the XRANGE was only answered ASK, MOVED or TRYAGAIN while the
    partition's slot migrated."""
    found: list[Message] = []
    for offset, reply in zip(offsets, replies, strict=True):
        if isinstance(reply, Exception):
            raise reply
        found += (m for m in decode_entries(tp[0], tp[1], reply) if m.offset == offset)
    return found


class ReadRest:
    """The messages of orderly poll() reads past max_messages (the entries of a read hold more
    when they are batch entries), kept per partition for the next poll(), so it gives them
    without reading and decoding their entry again (profiled: a re-read cut entry cost a tenth
    of poll()'s time). They are given only while the reader stands where the cut left it: the
    same grant (reader), no seek or hand-over since (moves), the position at the last message
    given (the acks moved nothing else). Else they are dropped and the partition is read
    again from its position. The caller holds the consumer's guard."""

    def __init__(self) -> None:
        self._rest: dict[
            TopicPartition, tuple[OrderlyPartition, int, str, list[Message], int, float]
        ] = {}

    def keep(
        self, reader: OrderlyPartition, messages: list[Message], start: int, now: float
    ) -> None:
        """messages[start:] follow the position of `reader` just admitted (inside an entry),
        read under the lease at `now` (monotonic)."""
        self._rest[reader.tp] = (reader, reader.moves, reader.read_from, messages, start, now)

    def take(self, reader: OrderlyPartition, now: float) -> tuple[list[Message], int, float] | None:
        """(messages, start, read_at) kept for the reader's partition, or None: none kept, the
        reader moved since (they would not follow its position), or the read is older than
        REST_MAX_AGE_S (its lease check is that old: the partition is read again, fenced)."""
        kept = self._rest.pop(reader.tp, None)
        if kept is None:
            return None
        was, moves, position, messages, start, read_at = kept
        if was is not reader or reader.moves != moves or reader.inclusive:
            return None
        if now - read_at > REST_MAX_AGE_S:
            return None
        return (messages, start, read_at) if reader.read_from == position else None

    def clear(self) -> None:
        self._rest.clear()


# A cut read's rest is given for this long after the read (whose fenced lease check it carries);
# a caller slower than that gets the partition read again, under a fresh check.
REST_MAX_AGE_S = 1.0
