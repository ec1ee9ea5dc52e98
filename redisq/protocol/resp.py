"""RESP encoding of commands, for callers that write pre-encoded commands to a socket (the
producer's transport): each message is encoded once, when it is queued, and joined at send time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# The bulk-string headers of lengths below 4096, ready made (BULK_HEADERS[n] = b"$<n>\r\n").
BULK_HEADERS = [b"$%d\r\n" % n for n in range(4096)]


def bulk_header(length: int) -> bytes:
    """The RESP bulk-string header for a value of this length."""
    return BULK_HEADERS[length] if length < 4096 else b"$%d\r\n" % length


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"%b%b\r\n" % (bulk_header(len(value)), value)


def encode_arg(value: Any) -> bytes:
    """One command argument as redis-py's Encoder writes it: bytes-likes as they are, int and
    float by repr, str as UTF-8; anything else, bool included, is a TypeError."""
    kind = type(value)
    if kind is bytes:
        return value
    if kind is str:
        return value.encode()
    if kind is int:
        return b"%d" % value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"a command argument of type {type(value).__name__}")
    return (value if isinstance(value, str) else repr(value)).encode()


def command(
    name: bytes, args: Iterable[Any], encoded: Sequence[bytes] = (), encoded_count: int = 0
) -> bytes:
    """A RESP command: name, then args (encoded here), then `encoded` (already bulk strings,
    encoded_count of them)."""
    head = [bulk(encode_arg(a)) for a in args]
    return b"".join([b"*%d\r\n" % (1 + len(head) + encoded_count), bulk(name), *head, *encoded])


def pack_commands(commands: Iterable[Sequence[Any]]) -> bytes:
    """Commands as one RESP write, each argument by encode_arg: the consumers' reads and acks
    carry up to a thousand IDs a command, which redis-py's asyncio connection packs in Python
    at about five times this cost. (The str case and bulk_header are inlined: they run once
    per ID.)"""
    out: list[bytes] = []
    add = out.append
    for cmd in commands:
        add(b"*%d\r\n" % len(cmd))
        for arg in cmd:
            arg = arg.encode() if type(arg) is str else encode_arg(arg)
            add(BULK_HEADERS[len(arg)] if len(arg) < 4096 else b"$%d\r\n" % len(arg))
            add(arg)
            add(b"\r\n")
    return b"".join(out)


def decode_bulks(encoded: bytes, count: int) -> list[bytes]:
    """The values of `count` concatenated RESP bulk strings (the inverse of joining bulk()s), for
    callers that send a pre-encoded body through a client's ordinary command interface."""
    values: list[bytes] = []
    pos = 0
    for _ in range(count):
        if encoded[pos : pos + 1] != b"$":
            raise ValueError(f"not a RESP bulk string at byte {pos}")
        end = encoded.index(b"\r\n", pos)
        length = int(encoded[pos + 1 : end])
        start = end + 2
        values.append(encoded[start : start + length])
        pos = start + length + 2
    if pos != len(encoded):
        raise ValueError(f"{len(encoded) - pos} bytes left after {count} bulk strings")
    return values
