"""Reading messages for the console: a partition by offset or time range, a message by its id or
its key, and a value shown as text, JSON or hex.

Everything decodes through `redisq.model.records.decode_entries`, the one entry decoder, so the
console shows exactly what a consumer would get (a foreign entry as a MalformedMessage with its
reason). A batch entry (DESIGN §14) is shown as its messages, one row each at its own offset
``ms-(s+i)``: pages count messages, not entries, and an offset inside an entry is found in the
entry that holds it (Broker.read's resume read, XREVRANGE <offset> - COUNT 1, then a cut).

Searches are bounded: a key is looked for in the partition the default partitioner sends it to
(CRC-32 of the key), newest first, over at most `scan_limit` entries; a message id is first
looked up in the partitions' dedup buckets (message-id producers remember id -> offset there,
one HGET per bucket, pipelined), and only then scanned for, bounded the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.errors import InvalidConfig, read_reply
from redisq.model.offsets import offset_before, offset_parts
from redisq.model.partitioner import partition_for_key
from redisq.model.records import Message, decode_entries, decode_entries_py
from redisq.protocol import Command, Operation, run_operation, text
from redisq.protocol.topics import read_cuts

if TYPE_CHECKING:
    from redisq.broker import Broker

MAX_COUNT = 500
SCAN_LIMIT = 20_000  # entries a key or message-id search reads at most per partition
SHOWN_BYTES = 64 * 1024  # of a value, per view
# Entries per read of a page of a batch topic (each may hold up to a producer batch of
# messages): a page of 50 messages needs a few entries, not 50 of them.
BATCH_TOPIC_READ = 16
VIEWS = ("text", "json", "hex")


@dataclass(frozen=True, slots=True)
class Page:
    """Messages of one partition in offset order, and where the pages before and after start."""

    messages: list[Message]
    older: str | None  # pass as end= for the page before ("(" + the first offset)
    newer: str | None  # pass as start= for the page after


@dataclass(frozen=True, slots=True)
class Search:
    messages: list[Message]
    scanned: int  # entries read
    where: str  # what was searched, for the page


def parse_bound(value: str | None, *, time: bool = False) -> str | None:
    """An offset bound from a form: "<ms>-<seq>" / "<ms>", or with time=True an ISO date-time or
    epoch milliseconds (as the first ID of that millisecond). "(" keeps a bound exclusive."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    exclusive = value.startswith("(")
    raw = value[1:] if exclusive else value
    if time and not raw.isdigit():
        from datetime import datetime

        try:
            when = datetime.fromisoformat(raw)
        except ValueError:
            raise InvalidConfig(f"{raw!r} is neither a date-time nor epoch milliseconds") from None
        raw = str(int(when.timestamp() * 1000))
    try:
        ms, seq = offset_parts(raw)
    except ValueError:
        raise InvalidConfig(f"{raw!r} is not an offset (<ms>-<seq>)") from None
    return ("(" if exclusive else "") + f"{ms}-{seq}"


def browse(
    broker: Broker,
    topic: str,
    partition: int,
    *,
    start: str | None = None,
    end: str | None = None,
    count: int = 50,
) -> Page:
    """Up to `count` messages from start to end (inclusive unless "(" given); with neither
    bound, the newest `count`; with only end, the `count` before it. Messages, not entries,
    are counted: a batch entry gives each of its messages, cut at start and end."""
    broker.check_partition(topic, partition)
    count = max(1, min(count, MAX_COUNT))
    size = _read_size(broker, topic, count)
    if start is None:
        messages = _newest(broker, topic, partition, end or "+", count, size)
    else:
        messages = list(
            broker.read(topic, partition, start=start, end=end or "+", count=count, batch=size)
        )
    if not messages:
        return Page([], None, None)
    return Page(messages, "(" + messages[0].offset, "(" + messages[-1].offset)


def _read_size(broker: Broker, topic: str, count: int) -> int:
    """Entries per read for `count` messages: as many on a message topic, fewer on a batch topic
    (the reads go on until `count` messages are found, whatever the entries hold)."""
    if broker.topic_config(topic).entry_format == "batch":
        return min(count, BATCH_TOPIC_READ)
    return count


def _newest(
    broker: Broker, topic: str, partition: int, end: str, count: int, size: int
) -> list[Message]:
    """The last `count` messages up to end (Broker.read's bounds: inclusive, or "(" exclusive),
    oldest first: entries read newest first, the one holding end cut there (read_cuts)."""
    key = broker.keys.log(topic, partition)
    upto = read_cuts("-", end)[1]
    found: list[Message] = []
    cursor = end
    while len(found) < count:
        entries = broker.client.xrevrange(key, max=cursor, min="-", count=size)
        if not entries:
            break
        entries.reverse()
        if upto is None:
            found[:0] = decode_entries(topic, partition, entries)
        else:
            found[:0] = decode_entries_py(topic, partition, entries, upto=upto)
        before = offset_before(text(entries[0][0]))
        if len(entries) < size or before is None:
            break
        cursor = before
    return found[-count:]


def message_at(broker: Broker, topic: str, partition: int, offset: str) -> list[Message]:
    """The message at this offset (none when it is trimmed, a hole, or no offset of the
    partition): Broker.read from it to it, so an offset inside a batch entry is found in the
    entry that holds it (DESIGN §14.7: XREVRANGE <offset> - COUNT 1, then the cut)."""
    return list(broker.read(topic, partition, start=offset, end=offset, count=1, batch=1))


def _scan(
    broker: Broker, topic: str, partition: int, wanted: int, limit: int, match: object
) -> tuple[list[Message], int]:
    """Newest first, at most `limit` entries (a batch entry is one, with all its messages),
    until `wanted` messages satisfy match(message)."""
    key = broker.keys.log(topic, partition)
    found: list[Message] = []
    scanned = 0
    cursor = "+"
    while scanned < limit and len(found) < wanted:
        batch = min(1000, limit - scanned)
        entries = broker.client.xrevrange(key, max=cursor, min="-", count=batch)
        if not entries:  # an empty partition, or nothing before the cursor
            break
        scanned += len(entries)
        found += [m for m in decode_entries(topic, partition, entries) if match(m)]  # type: ignore[operator]
        before = offset_before(text(entries[-1][0]))
        if len(entries) < batch or before is None:
            break
        cursor = before
    # Newest first before the cut: a batch entry's messages come oldest first.
    found.sort(key=lambda m: offset_parts(m.offset), reverse=True)
    return sorted(found[:wanted], key=lambda m: offset_parts(m.offset)), scanned


def find_by_key(
    broker: Broker,
    topic: str,
    key: bytes,
    *,
    count: int = 50,
    partition: int | None = None,
    scan_limit: int = SCAN_LIMIT,
) -> Search:
    """The newest messages with this key, in the partition the default partitioner routes it to
    (or the one given: a custom partitioner may have sent it elsewhere)."""
    config = broker.topic_config(topic, refresh=True)
    if partition is None:
        partition = partition_for_key(key, config.partitions)
    else:
        broker.check_partition(topic, partition)
    found, scanned = _scan(
        broker, topic, partition, min(count, MAX_COUNT), scan_limit, lambda m: m.key == key
    )
    return Search(found, scanned, f"partition {partition}, the newest {scanned} entries")


def find_by_message_id(
    broker: Broker, topic: str, message_id: bytes, *, scan_limit: int = SCAN_LIMIT
) -> Search:
    """The message carrying this id: looked up in every partition's dedup buckets (one
    pipelined round trip), else scanned for (newest first, bounded) in the partition the id
    routes to when a message has no key, then in the others."""
    config = broker.topic_config(topic, refresh=True)
    keys = broker.keys

    def lookup() -> Operation[list[tuple[int, str]]]:
        replies = yield [
            Command(("HGET", keys.dedup_bucket(topic, p, bucket), message_id))
            for p in range(config.partitions)
            for bucket in (0, 1)
        ]
        offsets = []
        for i, reply in enumerate(replies):
            what = f"topic {topic!r} partition {i // 2}'s dedup window"
            if read_reply(reply, what) is not None:
                offsets.append((i // 2, text(reply)))
        return offsets

    remembered = run_operation(lookup(), broker.scripts.execute)
    found: list[Message] = []
    for p, offset in remembered:
        found += message_at(broker, topic, p, offset)
    if found:
        return Search(found, len(found), "the dedup window (id -> offset)")
    first = partition_for_key(message_id, config.partitions)
    order = [first] + [p for p in range(config.partitions) if p != first]
    scanned = 0
    for p in order:
        matches, read = _scan(
            broker, topic, p, 1, max(scan_limit - scanned, 0), lambda m: m.message_id == message_id
        )
        scanned += read
        if matches:
            return Search(matches, scanned, f"partition {p}, scanned newest first")
        if scanned >= scan_limit:
            break
    return Search([], scanned, f"the dedup window, then the newest {scanned} entries")


# -- values --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rendered:
    body: str
    note: str = ""  # e.g. "not UTF-8", "not JSON", "first 64 KiB of 1 MiB"


def render_value(value: bytes | None, view: str) -> Rendered:
    """A value as text (UTF-8, undecodable bytes replaced), JSON (pretty) or a hex dump, cut at
    SHOWN_BYTES. The page escapes it (Jinja2 autoescape)."""
    if value is None:
        return Rendered("", "none")
    shown = value[:SHOWN_BYTES]
    cut = f"first {len(shown)} of {len(value)} bytes" if len(value) > len(shown) else ""
    if view == "hex":
        return Rendered(hexdump(shown), cut)
    try:
        decoded = shown.decode()
        utf8 = True
    except UnicodeDecodeError:
        decoded = shown.decode(errors="replace")
        utf8 = False
    if view == "json":
        try:
            return Rendered(
                json.dumps(json.loads(value), indent=2, ensure_ascii=False)[:SHOWN_BYTES]
            )
        except (ValueError, UnicodeDecodeError):
            return Rendered(decoded, "; ".join(n for n in ("not JSON", cut) if n))
    return Rendered(decoded, "; ".join(n for n in ("" if utf8 else "not UTF-8", cut) if n))


def hexdump(data: bytes, width: int = 16) -> str:
    lines = []
    for at in range(0, len(data), width):
        chunk = data[at : at + width]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        printable = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{at:08x}  {hexes:<{width * 3}} {printable}")
    return "\n".join(lines)


def preview(value: bytes | None, limit: int = 80) -> str:
    """One line of a value for tables."""
    if value is None:
        return ""
    decoded = value[: limit * 4].decode(errors="replace")
    line = decoded.replace("\n", " ").replace("\r", " ")
    return line[:limit] + ("…" if len(line) > limit or len(value) > limit * 4 else "")
