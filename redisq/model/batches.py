"""Batch entries (DESIGN §14): one stream entry holds a producer batch of n messages.

The entry has the ID ``ms-s`` and the fields ``b`` (the blob below), ``n`` (the count, ASCII
decimal), ``p`` (producer id) and, in sequence mode, ``s`` (the batch's base sequence). Message i
(0-based) has the offset ``ms-(s+i)``: the writer moves the stream's last ID to ``ms-(s+n-1)``
(XSETID), so the next entry's ID comes after every offset of this one.

The blob, version 1, big-endian::

    0   u8   version = 1
    1   u8   flags: 0x01 keys, 0x02 headers, 0x04 message ids, 0x08 timestamps
    2   u32  n
    6   per present column, in the order keys, values, headers, message ids: n x u32 lengths
        (values always present); then, with 0x08, n x u64 producer timestamps in ms;
        then the data, column after column: all keys, all values, all headers blobs, all ids.

A length of 0 means "absent" for a key, a headers blob and a message id, never for a value.
A column with no item present is left out by its flag. Nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from redisq.model import native

VERSION = 1
KEYS, HEADERS, MESSAGE_IDS, TIMESTAMPS = 0x01, 0x02, 0x04, 0x08
_KNOWN_FLAGS = KEYS | HEADERS | MESSAGE_IDS | TIMESTAMPS
_HEAD = struct.Struct(">BBI")
HEAD_SIZE = _HEAD.size
MAX_COUNT = (1 << 32) - 1
MAX_SEQ = (1 << 64) - 1
# The layout letters of includes/append.lua, by column (the letter "v" is always there).
_COLUMN_FLAGS = (("k", KEYS), ("h", HEADERS), ("m", MESSAGE_IDS), ("t", TIMESTAMPS))


class BadBatch(ValueError):
    """A batch entry that breaks a rule of this module (the reader makes it a MalformedMessage)."""


def encode_batch(
    values: Sequence[bytes],
    keys: Sequence[bytes | None] | None = None,
    headers: Sequence[bytes | None] | None = None,
    message_ids: Sequence[bytes | None] | None = None,
    timestamps: Sequence[int] | None = None,
) -> bytes:
    """The blob of n messages, given column by column (None or b"" for an absent item)."""
    n = len(values)
    if not 1 <= n <= MAX_COUNT:
        raise ValueError(f"a batch holds 1 to {MAX_COUNT} messages, not {n}")
    flags = 0
    lengths: list[int] = []
    data: list[bytes] = []
    for flag, column in ((KEYS, keys), (0, values), (HEADERS, headers), (MESSAGE_IDS, message_ids)):
        if column is None:
            continue
        items = [item or b"" for item in column]
        if len(items) != n:
            raise ValueError(f"every column holds {n} items, not {len(items)}")
        if flag and not any(items):
            continue
        flags |= flag
        lengths += map(len, items)
        data += items
    stamps = b""
    if timestamps is not None:
        if len(timestamps) != n:
            raise ValueError(f"every column holds {n} items, not {len(timestamps)}")
        flags |= TIMESTAMPS
        stamps = struct.pack(f">{n}Q", *timestamps)
    return b"".join(
        (_HEAD.pack(VERSION, flags, n), struct.pack(f">{len(lengths)}I", *lengths), stamps, *data)
    )


def blob_from_items(layout: str, count: int, items: Sequence[bytes]) -> bytes:
    """The blob of a batch given as its per-message arguments (includes/append.lua's layout
    letters k, v, h, m, t; t is the producer timestamp in ASCII decimal): count x len(layout)
    items, message after message. An empty key, headers blob or id is absent."""
    stride = len(layout)
    if len(items) != count * stride:
        raise ValueError(f"{count} messages of layout {layout!r} are {count * stride} items")
    columns: dict[str, Sequence[bytes]] = {
        letter: items[j::stride] for j, letter in enumerate(layout)
    }
    stamps = columns.get("t")
    return encode_batch(
        columns["v"],
        columns.get("k"),
        columns.get("h"),
        columns.get("m"),
        None if stamps is None else [int(s) for s in stamps],
    )


def blob_from_resp_py(layout: str, count: int, body: bytes) -> bytes:
    """The blob of a sealed batch held as its messages' RESP arguments (the producer's
    encoding, protocol.produce.encode_message): blob_from_items of resp_items."""
    return blob_from_items(layout, count, resp_items(body))


def blob_and_ids_py(layout: str, count: int, body: bytes) -> tuple[bytes, bytes]:
    """blob_from_resp_py, and the messages' ids as their own RESP bulk strings, in order: what
    produce_message_id.lua takes for a topic of batch entries (layout with an m)."""
    if "m" not in layout:
        raise ValueError(f"layout {layout} has no message id")
    items = resp_items(body)
    blob = blob_from_items(layout, count, items)
    ids = items[layout.index("m") :: len(layout)]
    return blob, b"".join(b"$%d\r\n%s\r\n" % (len(i), i) for i in ids)


def resp_items(body: bytes) -> list[bytes]:
    """The strings of a run of RESP bulk strings (``$<len>\\r\\n<data>\\r\\n`` ...): how a
    sealed batch holds its messages' arguments (protocol.produce.encode_message)."""
    items: list[bytes] = []
    append = items.append
    find = body.find
    pos, end = 0, len(body)
    while pos < end:
        if body[pos] != 0x24:  # "$"
            raise ValueError(f"not a RESP bulk string at byte {pos}")
        eol = find(b"\r\n", pos)
        start = eol + 2
        stop = start + int(body[pos + 1 : eol])
        if eol < 0 or body[stop : stop + 2] != b"\r\n":
            raise ValueError(f"not a RESP bulk string at byte {pos}")
        append(body[start:stop])
        pos = stop + 2
    return items


class Batch:
    """A decoded blob: its count and columns (lists of bytes; None for an absent column)."""

    __slots__ = ("n", "keys", "values", "headers", "message_ids", "timestamps")

    def __init__(self, blob: bytes, n_field: int) -> None:
        size = len(blob)
        if size < HEAD_SIZE:
            raise BadBatch(f"the blob has {size} bytes, fewer than its {HEAD_SIZE}-byte header")
        version, flags, n = _HEAD.unpack_from(blob, 0)
        if version != VERSION:
            raise BadBatch(f"blob version {version} is not one this reader knows ({VERSION})")
        if flags & ~_KNOWN_FLAGS:
            raise BadBatch(f"unknown flag bits {flags & ~_KNOWN_FLAGS:#04x} in the blob")
        if n != n_field:
            raise BadBatch(f"the blob holds {n} messages, the field n says {n_field}")
        if n == 0:
            raise BadBatch("a batch entry of 0 messages")
        columns = 1 + bool(flags & KEYS) + bool(flags & HEADERS) + bool(flags & MESSAGE_IDS)
        pos = HEAD_SIZE + 4 * n * columns
        stamps_at = pos
        if flags & TIMESTAMPS:
            pos += 8 * n
        if pos > size:
            raise BadBatch(f"the blob's lengths run past its {size} bytes")
        lengths = struct.unpack_from(f">{n * columns}I", blob, HEAD_SIZE)
        ends = list(accumulate(lengths, initial=pos))
        if ends[-1] != size:
            raise BadBatch(f"the blob's lengths add up to {ends[-1]} bytes, it has {size}")
        cut = [blob[a:b] for a, b in zip(ends, ends[1:], strict=False)]
        at = 0
        self.keys = self.headers = self.message_ids = self.timestamps = None
        if flags & KEYS:
            self.keys = cut[:n]
            at = n
        self.values = cut[at : at + n]
        at += n
        if flags & HEADERS:
            self.headers = cut[at : at + n]
            at += n
        if flags & MESSAGE_IDS:
            self.message_ids = cut[at : at + n]
        if flags & TIMESTAMPS:
            self.timestamps = struct.unpack_from(f">{n}Q", blob, stamps_at)
        self.n = n


def acked_bit(bitmap: bytes | None, i: int) -> bool:
    """Bit i of an entry's settled bitmap (Redis's bit order: bit 0 is byte 0's high bit)."""
    if not bitmap or (i >> 3) >= len(bitmap):
        return False
    return bool(bitmap[i >> 3] & (0x80 >> (i & 7)))


def parse_offset(offset: Any) -> tuple[int, int] | None:
    """A stream ID (str or bytes, ``ms-seq``) as (ms, seq); None when it is not one."""
    if type(offset) is bytes:
        offset = offset.decode("ascii", "replace")
    ms, dash, seq = str(offset).partition("-")
    if not dash or not ms.isdigit() or not seq.isdigit() or not ms.isascii() or not seq.isascii():
        return None
    return int(ms), int(seq)


def cut_entry(entry: Any, position: str, inclusive: bool) -> list[Any]:
    """The part of a stream entry after `position` (at or after it when inclusive), as raw
    entries for the decoder: a resume read's first entry, the one holding the position (§14.7).

    A batch entry cut inside gives one entry of its later messages, with the ID and sequence of
    the first of them (``ms-(s+k)``, ``s+k``): it decodes to exactly the messages the whole
    entry has there. An entry with nothing there, a message entry (its one offset is at or
    before the position) and a malformed batch entry (its span cannot be trusted; it was met at
    its ID) give nothing."""
    entry_id, flat = entry
    at = parse_offset(entry_id)
    where = parse_offset(position)
    if at is None or where is None:
        return []
    if type(flat) is dict:
        pairs = list(flat.items())
    elif isinstance(flat, list | tuple) and not len(flat) % 2:
        pairs = list(zip(flat[0::2], flat[1::2], strict=True))
    else:
        return []
    fields = dict(pairs)
    if not pairs or pairs[0][0] != b"b" or b"v" in fields:
        return []
    try:
        n = int(fields[b"n"]) if bytes(fields[b"n"]).isdigit() else -1
        batch = Batch(bytes(fields[b"b"]), n)
    except (KeyError, TypeError, ValueError):
        return []
    ms, first = at
    if where[0] != ms:
        skip = 0 if where[0] < ms else n
    else:
        skip = where[1] - first + (0 if inclusive else 1)
    skip = max(0, min(n, skip))
    if skip == n:
        return []
    if skip == 0:
        return [entry]
    blob = encode_batch(
        batch.values[skip:],
        None if batch.keys is None else batch.keys[skip:],
        None if batch.headers is None else batch.headers[skip:],
        None if batch.message_ids is None else batch.message_ids[skip:],
        None if batch.timestamps is None else batch.timestamps[skip:],
    )
    rest: list[bytes] = []
    for name, value in pairs:
        if name == b"b":
            value = blob
        elif name == b"n":
            value = b"%d" % (n - skip)
        elif name in (b"s", b"c") and bytes(value).isdigit():
            value = b"%d" % (int(value) + skip)
        rest += (name, value)
    return [(f"{ms}-{first + skip}".encode(), rest)]


# blob_from_resp: redisq._speedups' one-pass C version when it was built (the same blob, the
# same ValueErrors for what the producer never sends), else the Python one.
blob_from_resp: Callable[[str, int, bytes], bytes] = blob_from_resp_py
blob_and_ids: Callable[[str, int, bytes], tuple[bytes, bytes]] = blob_and_ids_py
_speedups = native.load()
if _speedups is not None:
    blob_from_resp = _speedups.blob_from_resp
    _pack = _speedups.blob_from_resp

    def blob_and_ids(layout: str, count: int, body: bytes) -> tuple[bytes, bytes]:
        return _pack(layout, count, body, True)
