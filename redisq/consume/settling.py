"""A concurrent member's view of the batch entries it was given (DESIGN §14.8). No I/O.

Redis's pending-entries list holds entries, and XACK takes entry IDs: a batch entry of n
messages is acknowledged once all n are settled (handled or dead-lettered), by its ID. Until
then its settled messages are remembered here, so a redelivery of the entry to this member (its
own pending entries after a pause) gives only the others. A member that dies leaves the whole
entry pending: the member that claims it gets every message of it again (at least once; a
settled message may be handled twice, as after any crash before an XACK).

Message entries (one message, whose offset is the entry ID) pass through unchanged."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from redisq.model.batches import parse_offset


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _batch_count(flat: Any) -> int | None:
    """n of a batch entry's fields (first field b, no v), else None."""
    if type(flat) is dict:
        names = list(flat)
        if not names or names[0] != b"b" or b"v" in flat:
            return None
        raw = flat.get(b"n")
    elif isinstance(flat, list | tuple) and flat and flat[0] == b"b":
        fields = dict(zip(flat[0::2], flat[1::2], strict=False))
        if b"v" in fields:
            return None
        raw = fields.get(b"n")
    else:
        return None
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 10:
        return None
    return int(raw)


class EntrySettling:
    """Batch entries given out and not yet settled whole; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry_of: dict[str, str] = {}  # message offset -> its entry's ID
        self._unsettled: dict[str, set[str]] = {}  # entry ID -> offsets not settled yet
        self._sizes: dict[str, int] = {}  # entry ID -> n

    def given(self, entries: Sequence[Any]) -> dict[str, bytes] | None:
        """Raw entries just read (XREADGROUP, XAUTOCLAIM): remember their batch entries. Returns
        the settled bitmaps of entries given before and partly settled since (for the decoder's
        `acked`, model.records.decode_entries_py), or None when there are none."""
        acked: dict[str, bytes] | None = None
        with self._lock:
            for entry_id, flat in entries:
                n = _batch_count(flat)
                if n is None or n < 2:
                    continue
                entry = _text(entry_id)
                at = parse_offset(entry)
                if at is None:
                    continue
                ms, first = at
                unsettled = self._unsettled.get(entry)
                if unsettled is not None and self._sizes.get(entry) == n:
                    bits = bytearray((n + 7) // 8)
                    for i in range(n):
                        if f"{ms}-{first + i}" not in unsettled:
                            bits[i >> 3] |= 0x80 >> (i & 7)
                    if any(bits):
                        acked = acked or {}
                        acked[entry] = bytes(bits)
                    continue
                offsets = {f"{ms}-{first + i}" for i in range(n)}
                self._unsettled[entry] = offsets
                self._sizes[entry] = n
                for offset in offsets:
                    self._entry_of[offset] = entry
        return acked

    def settle(self, offsets: Iterable[str]) -> list[str]:
        """Messages settled: the entry IDs to XACK now (message entries' offsets as they are,
        batch entries once their last message is settled)."""
        return self.settle_counted(offsets)[0]

    def settle_counted(self, offsets: Iterable[str]) -> tuple[list[str], int, int]:
        """settle(), and how many of the offsets were batch entries' messages settled now, and
        how many batch entries the IDs to XACK hold."""
        ready: list[str] = []
        settled = whole = 0
        with self._lock:
            for offset in offsets:
                # An offset stays known until its entry is settled whole: the offset of a
                # batch's first message is its entry's ID, which must not be XACKed before.
                entry = self._entry_of.get(offset)
                if entry is None:
                    ready.append(offset)
                    continue
                unsettled = self._unsettled[entry]
                if offset not in unsettled:
                    continue  # settled before (acked twice)
                settled += 1
                unsettled.discard(offset)
                if not unsettled:
                    self._drop(entry)
                    ready.append(entry)
                    whole += 1
        return ready, settled, whole

    def _drop(self, entry: str) -> None:
        n = self._sizes.pop(entry)
        del self._unsettled[entry]
        at = parse_offset(entry)
        if at is not None:
            for i in range(n):
                self._entry_of.pop(f"{at[0]}-{at[1] + i}", None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._unsettled)
