"""The field rules of a redisq stream entry, without I/O: producer ids and sequences
(`parse_id_field`), the headers blob (`encode_headers`, `decode_headers`, `parse_headers`) and
the raw-fields blob a dead letter keeps (`encode_fields`, `decode_fields`). records.py applies
them to whole entries; see its docstring for the rules."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

_NAME_LEN = struct.Struct(">H")
_VALUE_LEN = struct.Struct(">I")
_FIELD_LEN = struct.Struct(">I")
MAX_ID_FIELD = (1 << 63) - 1


def parse_id_field(raw: Any) -> int | None:
    """A producer id or sequence field (bytes or str) as an int, or None when it breaks the rule:
    ASCII decimal digits only (no sign, space or "_", which int() would take), at most 19, below
    2**63. The Spark reader applies the same rule to whole columns."""
    if isinstance(raw, str):
        raw = raw.encode("ascii", "replace")
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 19:
        return None
    number = int(raw)
    return number if number <= MAX_ID_FIELD else None


def encode_headers(headers: Mapping[str, str | bytes] | None) -> bytes:
    """Encode headers; names are str, values str (stored as UTF-8) or bytes."""
    if headers is None:
        return b""
    if not isinstance(headers, Mapping):  # an empty list too: a mistake, not "no headers"
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
    """Decode a headers blob; ValueError (naming the byte) unless it is complete and exact:
    a length that runs past the end would otherwise cut a value short without a word."""
    if not blob:
        return {}
    headers: dict[str, bytes] = {}
    pos = 0
    end = len(blob)
    while pos < end:
        if pos + 2 > end:
            raise ValueError(f"headers: a name length is cut off at byte {pos} of {end}")
        (name_len,) = _NAME_LEN.unpack_from(blob, pos)
        name_end = pos + 2 + name_len
        if name_end + 4 > end:
            raise ValueError(f"headers: the header at byte {pos} runs past the end ({end})")
        try:
            name = blob[pos + 2 : name_end].decode()
        except UnicodeDecodeError:
            raise ValueError(f"headers: the name at byte {pos} is not UTF-8") from None
        (value_len,) = _VALUE_LEN.unpack_from(blob, name_end)
        pos = name_end + 4 + value_len
        if pos > end:
            raise ValueError(f"headers: the value of {name!r} runs past the end ({end})")
        headers[name] = blob[name_end + 4 : pos]
    return headers


def parse_headers(blob: bytes | None) -> dict[str, bytes] | None:
    """decode_headers, leniently: None for a blob that is not a valid headers blob."""
    try:
        return decode_headers(blob)
    except (ValueError, TypeError):
        return None


def encode_fields(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A stream entry's raw fields, in order, duplicates kept: per field a 4-byte name length,
    the name, a 4-byte value length and the value (big-endian). Dead letters of malformed
    entries keep them this way in the header x-redisq-raw-fields."""
    parts: list[bytes] = []
    for name, value in pairs:
        parts += [_FIELD_LEN.pack(len(name)), name, _FIELD_LEN.pack(len(value)), value]
    return b"".join(parts)


def decode_fields(blob: bytes) -> list[tuple[bytes, bytes]]:
    """encode_fields undone; ValueError for a blob that is not one."""
    pairs = []
    pos = 0
    end = len(blob)
    while pos < end:
        items = []
        for _ in range(2):
            if pos + 4 > end:
                raise ValueError(f"raw fields: a length is cut off at byte {pos} of {end}")
            (size,) = _FIELD_LEN.unpack_from(blob, pos)
            pos += 4 + size
            if pos > end:
                raise ValueError(f"raw fields: an item runs past the end ({end})")
            items.append(blob[pos - size : pos])
        pairs.append((items[0], items[1]))
    return pairs


def field_map(flat: Any) -> dict[Any, Any] | None:
    """An entry's fields (a flat list, or a dict) as a dict, the last value of a repeated name
    counting; None when they do not pair up (the entry is then malformed)."""
    if type(flat) is dict:
        return flat
    if not isinstance(flat, list | tuple) or len(flat) % 2:
        return None
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def raw_pairs(flat: Any) -> list[tuple[bytes, bytes]]:
    """An entry's fields as (name, value) bytes pairs, as they came (a MalformedMessage's)."""
    if isinstance(flat, Mapping):
        items = list(flat.items())
    elif isinstance(flat, list | tuple):
        items = list(zip(flat[0::2], flat[1::2], strict=False))
        if len(flat) % 2:
            items.append((flat[-1], b""))
    else:
        items = []
    return [(as_bytes(name), as_bytes(value)) for name, value in items]


def as_bytes(value: Any) -> bytes:
    """A field's name or value (bytes, str or anything else) as bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return str(value).encode()


def show(raw: bytes, limit: int = 40) -> str:
    """A field's bytes for an error message, cut at limit."""
    return repr(raw[:limit]) + ("..." if len(raw) > limit else "")
