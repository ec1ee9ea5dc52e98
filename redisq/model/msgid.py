"""Generated message ids: ULIDs, unique by construction, with no lease and no counter in Redis.

A ULID is 128 bits: 48 bits of milliseconds since the Unix epoch, then 80 random bits, written
as 26 characters of Crockford's base32 (https://github.com/ulid/spec), so ids sort by time.
Within one millisecond a generator increments the random part instead of drawing it again
(the spec's monotonic mode), so its own ids also sort in the order they were made.

Two generators produce the same id only if they draw overlapping 80-bit ranges in the same
millisecond: about n^2 / 2^80 for n ids per millisecond. Nothing in Redis takes part, so nothing
Redis forgets (a restart without persistence, a failover) can make two producers share ids,
which a worker id leased from Redis (the Snowflake scheme) cannot promise.
"""

from __future__ import annotations

import secrets
import threading
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# Two characters per 10 bits: a ULID is 13 lookups.
_PAIRS = [(_ALPHABET[i >> 5] + _ALPHABET[i & 31]).encode() for i in range(1024)]
_RANDOM_BITS = 80
_RANDOM_LIMIT = 1 << _RANDOM_BITS


def encode_ulid(value: int) -> bytes:
    """A 128-bit integer as 26 Crockford base32 characters (the top 2 bits of the first
    character are zero: 130 bits of room)."""
    pairs = _PAIRS
    return b"".join([pairs[(value >> shift) & 1023] for shift in range(120, -1, -10)])[-26:]


def decode_ulid(text: str | bytes) -> int:
    """The 128-bit integer of a ULID (case-insensitive)."""
    if isinstance(text, bytes):
        text = text.decode()
    if len(text) != 26:
        raise ValueError(f"a ULID has 26 characters, not {len(text)}")
    value = 0
    for char in text.upper():
        digit = _ALPHABET.find(char)
        if digit < 0:
            raise ValueError(f"{char!r} is not a Crockford base32 digit")
        value = (value << 5) | digit
    if value >> 128:
        raise ValueError("a ULID is at most 128 bits")
    return value


def ulid_time_ms(text: str | bytes) -> int:
    """The millisecond timestamp of a ULID."""
    return decode_ulid(text) >> _RANDOM_BITS


class MessageIdGenerator:
    """Monotonic ULIDs for one producer (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._prefix = b""  # the 10 characters of _last_ms
        self._random = 0

    def next_id(self) -> bytes:
        with self._lock:
            now = time.time_ns() // 1_000_000
            if now > self._last_ms:
                self._last_ms = now
                self._prefix = encode_ulid(now << _RANDOM_BITS)[:10]
                self._random = secrets.randbits(_RANDOM_BITS)
            else:  # the same millisecond, or the clock went back: keep counting on the last one
                self._random += 1
                if self._random >= _RANDOM_LIMIT:  # 2^80 ids in one ms would be news
                    self._last_ms += 1
                    self._prefix = encode_ulid(self._last_ms << _RANDOM_BITS)[:10]
                    self._random = secrets.randbits(_RANDOM_BITS)
            r = self._random
            pairs = _PAIRS
            return b"".join(
                (
                    self._prefix,
                    pairs[r >> 70],
                    pairs[(r >> 60) & 1023],
                    pairs[(r >> 50) & 1023],
                    pairs[(r >> 40) & 1023],
                    pairs[(r >> 30) & 1023],
                    pairs[(r >> 20) & 1023],
                    pairs[(r >> 10) & 1023],
                    pairs[r & 1023],
                )
            )
