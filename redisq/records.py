"""What goes into a partition stream and what comes back out.

A stream entry has the fields ``v`` (value), and when present ``k`` (key), ``h`` (headers),
``m`` (message id), ``p`` (producer id) and ``s`` (sequence). Headers are one binary field:
for each header, a 2-byte name length, the UTF-8 name, a 4-byte value length and the value
(big-endian), so header values may be any bytes and the Lua scripts never parse them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_NAME_LEN = struct.Struct(">H")
_VALUE_LEN = struct.Struct(">I")


def encode_headers(headers: Mapping[str, str | bytes] | None) -> bytes:
    """Encode headers; names are str, values str (stored as UTF-8) or bytes."""
    if not headers:
        return b""
    if not isinstance(headers, Mapping):
        raise TypeError(
            f"headers must be a mapping of str to str or bytes, not {type(headers).__name__}"
        )
    parts: list[bytes] = []
    for name, value in headers.items():
        if not isinstance(name, str):
            raise TypeError(f"header names must be str, not {type(name).__name__}")
        if isinstance(value, str):
            value = value.encode()
        elif not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(
                f"header {name!r}: values must be str or bytes, not {type(value).__name__}"
            )
        raw_name = name.encode()
        if len(raw_name) > 0xFFFF:
            raise ValueError(f"header name of {len(raw_name)} bytes is longer than 65535")
        value = bytes(value)
        parts += [_NAME_LEN.pack(len(raw_name)), raw_name, _VALUE_LEN.pack(len(value)), value]
    return b"".join(parts)


def decode_headers(blob: bytes | None) -> dict[str, bytes]:
    if not blob:
        return {}
    headers: dict[str, bytes] = {}
    pos = 0
    while pos < len(blob):
        (name_len,) = _NAME_LEN.unpack_from(blob, pos)
        pos += 2
        name = blob[pos : pos + name_len].decode()
        pos += name_len
        (value_len,) = _VALUE_LEN.unpack_from(blob, pos)
        pos += 4
        headers[name] = blob[pos : pos + value_len]
        pos += value_len
    return headers


def offset_parts(offset: str) -> tuple[int, int]:
    """A stream ID ``<ms>-<seq>`` as a sortable pair of integers."""
    ms, _, seq = offset.partition("-")
    return int(ms), int(seq or 0)


def offset_at(first_id: str, index: int) -> str:
    """The ID of message `index` of a batch appended from `first_id` (IDs are consecutive)."""
    ms, _, seq = first_id.partition("-")
    return f"{ms}-{int(seq) + index}"


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """What the broker answered for one sent message.

    offset is the stream ID. duplicate=True means the message had been written before and
    nothing was written now; offset is then the original ID, or None when the broker no longer
    remembers it (a duplicate older than the producer's window).
    """

    topic: str
    partition: int
    offset: str | None
    duplicate: bool = False


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
        """Append time in seconds since the epoch (from the stream ID)."""
        return self.timestamp_ms / 1000.0


def decode_entry(
    topic: str, partition: int, entry_id: Any, fields: Mapping[bytes, bytes]
) -> Message:
    """A stream entry (as redis-py returns it, bytes) as a Message."""
    offset = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    producer_id = fields.get(b"p")
    sequence = fields.get(b"s")
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        key=fields.get(b"k"),
        value=fields.get(b"v", b""),
        headers=decode_headers(fields.get(b"h")),
        timestamp_ms=offset_parts(offset)[0],
        producer_id=int(producer_id) if producer_id is not None else None,
        sequence=int(sequence) if sequence is not None else None,
        message_id=fields.get(b"m"),
    )
