"""A concurrent member's view of the batch entries it was given (DESIGN §14.8). No I/O.

Redis's pending-entries list holds entries, and XACK takes entry IDs: a batch entry of n
messages is acknowledged once all n are settled (handled or dead-lettered), by its ID. Until
then its settled messages are remembered here, and written beside the pending list as the
entry's settled bitmap (KeySpace.settled_messages, with the acks that settle them): a member
that claims the entry from a dead one gets only the messages not settled (`given(stored=)`).
A message settled after the last write of the bitmap may be handled twice, as after any crash
before an XACK (at least once).

Message entries (one message, whose offset is the entry ID) pass through unchanged."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redisq.model.batches import acked_bit as bit
from redisq.model.batches import parse_offset
from redisq.model.counting import batch_counts
from redisq.protocol import text


def sorted_offsets(ms: int, first: int, n: int) -> list[str]:
    """The offsets of a batch entry's n messages, in order."""
    return [f"{ms}-{first + i}" for i in range(n)]


def _batch_count(flat: Any) -> int | None:
    """n of a batch entry's fields (first field b, no v), else None."""
    counts = batch_counts(flat)
    return None if counts is None else counts[0]


def batch_entry_ids(entries: Sequence[Any]) -> list[str]:
    """The IDs of the batch entries of more than one message among raw entries."""
    return [text(entry_id) for entry_id, flat in entries if (_batch_count(flat) or 0) > 1]


@dataclass(slots=True)
class Settled:
    """What settling some messages does: `ready`, the entry IDs to XACK now (message entries'
    offsets, batch entries settled whole); `messages`, how many of the offsets were batch
    entries' messages settled now; `whole`, the batch entries among ready (their bitmaps go);
    `partial`, entry ID -> settled bitmap of the batch entries still partly unsettled."""

    ready: list[str] = field(default_factory=list)
    messages: int = 0
    whole: list[str] = field(default_factory=list)
    partial: dict[str, bytes] = field(default_factory=dict)
    # entry ID -> (n, the offsets of it settled now): what undo() gives back
    taken: dict[str, tuple[int, list[str]]] = field(default_factory=dict, compare=False)


class EntrySettling:
    """Batch entries given out and not yet settled whole; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry_of: dict[str, str] = {}  # message offset -> its entry's ID
        self._unsettled: dict[str, set[str]] = {}  # entry ID -> offsets not settled yet
        self._sizes: dict[str, int] = {}  # entry ID -> n

    def given(
        self, entries: Sequence[Any], stored: Mapping[str, bytes] | None = None
    ) -> dict[str, bytes] | None:
        """Raw entries just read (XREADGROUP, XAUTOCLAIM): remember their batch entries. Returns
        the settled bitmaps of entries given before and partly settled since (for the decoder's
        `acked`, model.records.decode_entries_py), or None when there are none. stored: the
        bitmaps kept in Redis for entries this member has not seen (claimed from another)."""
        acked: dict[str, bytes] | None = None
        with self._lock:
            for entry_id, flat in entries:
                n = _batch_count(flat)
                if n is None or n < 2:
                    continue
                entry = text(entry_id)
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
                in_order = sorted_offsets(ms, first, n)
                offsets = set(in_order)
                bitmap = stored.get(entry) if stored else None
                if bitmap and len(bitmap) == (n + 7) // 8:
                    left = {o for i, o in enumerate(in_order) if not bit(bitmap, i)}
                    if left:  # (a full bitmap was never written: its entry went with an XACK)
                        acked = acked or {}
                        acked[entry] = bytes(bitmap)
                        offsets = left
                self._unsettled[entry] = offsets
                self._sizes[entry] = n
                self._entry_of.update(dict.fromkeys(offsets, entry))  # in C: n per entry
        return acked

    def settle(self, offsets: Iterable[str]) -> Settled:
        """Messages settled (acknowledged or dead-lettered): what to XACK and to write."""
        result = Settled()
        touched: set[str] = set()
        with self._lock:
            for offset in offsets:
                # An offset stays known until its entry is settled whole: the offset of a
                # batch's first message is its entry's ID, which must not be XACKed before.
                entry = self._entry_of.get(offset)
                if entry is None:
                    result.ready.append(offset)
                    continue
                unsettled = self._unsettled[entry]
                if offset not in unsettled:
                    continue  # settled before (acked twice)
                result.messages += 1
                unsettled.discard(offset)
                result.taken.setdefault(entry, (self._sizes[entry], []))[1].append(offset)
                touched.add(entry)
                if not unsettled:
                    self._drop(entry)
                    touched.discard(entry)
                    result.ready.append(entry)
                    result.whole.append(entry)
            for entry in touched:
                result.partial[entry] = self._bitmap(entry)
        return result

    def undo(self, settled: Settled) -> None:
        """A settle() whose XACK and bitmap writes did not go out (the write failed): its
        messages are unsettled again, so that the caller's next try sends them (settled twice,
        the second settle() would be taken for a repeat and its entry never XACKed)."""
        with self._lock:
            for entry, (n, offsets) in settled.taken.items():
                unsettled = self._unsettled.get(entry)
                if unsettled is None:
                    unsettled = self._unsettled[entry] = set()
                    self._sizes[entry] = n
                unsettled.update(offsets)
                for offset in offsets:
                    self._entry_of[offset] = entry

    @contextmanager
    def settling(self, offsets: Iterable[str]) -> Iterator[Settled]:
        """settle(offsets) for a block that sends what it says: undone if the block raises."""
        settled = self.settle(offsets)
        try:
            yield settled
        except BaseException:
            self.undo(settled)
            raise

    def _bitmap(self, entry: str) -> bytes:
        n = self._sizes[entry]
        unsettled = self._unsettled[entry]
        bits = bytearray((n + 7) // 8)
        at = parse_offset(entry)
        if at is not None:
            for i, offset in enumerate(sorted_offsets(at[0], at[1], n)):
                if offset not in unsettled:
                    bits[i >> 3] |= 0x80 >> (i & 7)
        return bytes(bits)

    def _drop(self, entry: str) -> None:
        n = self._sizes.pop(entry)
        del self._unsettled[entry]
        at = parse_offset(entry)
        if at is not None:
            entry_of = self._entry_of
            for offset in sorted_offsets(at[0], at[1], n):
                entry_of.pop(offset, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._unsettled)


# A partition read for the first time by run(), the messages per entry unknown: this many entries
# at most, so that a first read of batch entries does not bring batch_size whole batches.
FIRST_READ_ENTRIES = 16
# run() reads batch_size entries at most and about this many times batch_size messages: on batch
# entries, reads of batch_size messages cut run()'s rate by a quarter (Redis 7.0, 100,000
# messages: orderly 239k msg/s against 315k for whole reads, concurrent 269k against 362k);
# four times as many gave 317k and 354k.
RUN_READ_FACTOR = 4


class EntrySizes:
    """The messages per entry of each partition's last read (a batch entry holds many), so that
    a read of about `count` messages asks for that many messages' worth of entries (poll()'s
    max_messages, run()'s batch_size)."""

    def __init__(self) -> None:
        self._per_entry: dict[Any, float] = {}

    def expect(self, tp: Any, entry_format: str, counts: Sequence[Any] | None = None) -> None:
        """Before a partition's first read: a topic of message entries holds one message per
        entry (its transactions and delayed messages too); a topic of batch entries the
        messages per entry its counters tell (counts: m and e of KeySpace.counts). Either way
        its first read is not cut to FIRST_READ_ENTRIES."""
        if entry_format == "message":
            self._per_entry.setdefault(tp, 1.0)
            return
        try:
            messages, entries = (int(c) for c in counts or ())
        except (TypeError, ValueError):  # nothing counted yet, or not two numbers
            return
        if messages > 0 and entries > 0:
            self._per_entry.setdefault(tp, max(1.0, messages / entries))

    def entries_for(self, tp: Any, count: int) -> int:
        return max(1, math.ceil(count / self._per_entry.get(tp, 1.0)))

    def entries_to_run(self, tp: Any, count: int) -> int:
        """run(): count entries at most, about RUN_READ_FACTOR * count messages, and
        FIRST_READ_ENTRIES at most while the partition's size is unknown."""
        if tp not in self._per_entry:
            return min(count, FIRST_READ_ENTRIES)
        return min(count, self.entries_for(tp, RUN_READ_FACTOR * count))

    def note(self, tp: Any, entries: Sequence[Any], messages: Sequence[Any]) -> None:
        if entries and messages:
            self._per_entry[tp] = max(1.0, len(messages) / len(entries))

    def note_entries(self, tp: Any, entries: Sequence[Any]) -> None:
        """note() before decoding: the messages of the read's last entry stand for each."""
        if entries:
            counts = batch_counts(entries[-1][1])
            self._per_entry[tp] = float(counts[0]) if counts is not None else 1.0
