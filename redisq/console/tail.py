"""A live tail of a topic: the page polls for what every partition appended since its cursor.

Polling rather than a held connection: a tail holds nothing on the server between two polls
(no thread, no blocked connection), so it stops when the page closes, and one poll is a
bounded read in one pipelined round trip: per partition, one XRANGE from the cursor
(exclusive), and it gives at most `MAX_PER_POLL` messages over all partitions (at least one
each). The page carries the cursor ("0:1700000000000-0,1:..."), one position per partition:
- "<p>:<id>": after the entry that holds <id> (an entry's ID, or any offset of its span: the
  next entry's ID is after it, DESIGN §14.1): the next poll is `XRANGE (<id>`;
- "<p>:<offset>~": after this message, which is inside a batch entry (a poll stopped there:
  the entry held more messages than the poll gives): the next poll is a resume read
  (DESIGN §14.7), `XREVRANGE <offset> - COUNT 1` for the rest of that entry, then the XRANGE.
A batch entry is shown as its messages, each at its own offset. A partition missing from the
cursor (the topic grew since the page opened) is read from its start, since all of it is newer
than the page. The page keeps the newest messages only, and stops polling after a while
(static/console.js).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.console.browse import BATCH_TOPIC_READ
from redisq.errors import InvalidConfig, read_reply
from redisq.model.batches import cut_entry
from redisq.model.offsets import offset_parts
from redisq.model.records import Message, decode_entries
from redisq.protocol import text

if TYPE_CHECKING:
    from redisq.broker import Broker

MAX_PER_POLL = 500  # messages one poll gives at most (over all partitions, but >= 1 each);
# it reads as many entries per partition, or browse.BATCH_TOPIC_READ on a batch topic (each
# holds a producer batch), and cuts the messages past the partition's share
START = "0-0"
INSIDE = "~"  # marks a cursor position inside a batch entry (see the module docstring)


@dataclass(frozen=True, slots=True)
class TailBatch:
    messages: list[Message]  # oldest first
    cursor: str  # for the next poll
    more: bool  # a partition had more than one poll reads: poll again at once


def format_cursor(positions: dict[int, str]) -> str:
    return ",".join(f"{p}:{offset}" for p, offset in sorted(positions.items()))


def parse_cursor(raw: str, partitions: int) -> dict[int, str]:
    """The cursor the page sent back, checked: partitions of the topic, valid offsets (each
    may end with INSIDE)."""
    positions: dict[int, str] = {}
    for part in filter(None, raw.split(",")):
        number, _, offset = part.partition(":")
        inside = offset.endswith(INSIDE)
        try:
            partition = int(number)
            ms, seq = offset_parts(offset.removesuffix(INSIDE))
        except ValueError:
            raise InvalidConfig(
                f"tail cursor {part!r}: expected <partition>:<ms>-<seq>[{INSIDE}]"
            ) from None
        if not 0 <= partition < partitions:
            raise InvalidConfig(f"tail cursor: partition {partition} is out of range")
        positions[partition] = f"{ms}-{seq}" + (INSIDE if inside else "")
    return positions


def start_cursor(broker: Broker, topic: str) -> str:
    """Each partition's last offset now (one pipelined round trip): the tail shows what
    comes after."""
    config = broker.topic_config(topic, refresh=True)
    pipe = broker.client.pipeline(transaction=False)
    for p in range(config.partitions):
        pipe.xrevrange(broker.keys.log(topic, p), max="+", min="-", count=1)
    positions = {}
    for p, reply in enumerate(pipe.execute(raise_on_error=False)):
        last = read_reply(reply, f"topic {topic!r} partition {p}")
        positions[p] = text(last[0][0]) if last else START
    return format_cursor(positions)


def read_tail(broker: Broker, topic: str, cursor: str) -> TailBatch:
    """What each partition appended after the cursor, bounded (see the module docstring)."""
    config = broker.topic_config(topic, refresh=True)
    positions = parse_cursor(cursor, config.partitions)
    share = max(1, MAX_PER_POLL // config.partitions)  # messages per partition
    size = share  # entries per XRANGE
    if config.entry_format == "batch":  # an entry holds a producer batch: fewer per poll
        size = min(size, BATCH_TOPIC_READ)
    pipe = broker.client.pipeline(transaction=False)
    resumed: set[int] = set()
    for p in range(config.partitions):
        position = positions.get(p, START)
        key = broker.keys.log(topic, p)
        if position.endswith(INSIDE):  # the rest of the entry the last poll stopped inside
            resumed.add(p)
            pipe.xrevrange(key, max=position.removesuffix(INSIDE), min="-", count=1)
        pipe.xrange(key, min="(" + position.removesuffix(INSIDE), max="+", count=size)
    replies = iter(pipe.execute(raise_on_error=False))
    found: list[Message] = []
    more = False
    for p in range(config.partitions):
        where = f"topic {topic!r} partition {p}"
        held = read_reply(next(replies), where) if p in resumed else []
        entries = read_reply(next(replies), where)
        more = more or len(entries) >= size
        position = positions.get(p, START).removesuffix(INSIDE)
        if held:  # its messages after the position (XRANGE starts at the next entry)
            entries[:0] = cut_entry(held[0], position, False)
        messages = decode_entries(topic, p, entries)
        if len(messages) > share:  # the partition's share given: the next poll goes on after
            # the last message given, inside its entry unless the next message starts one
            starts = {text(entry[0]) for entry in entries}
            inside = messages[share].offset not in starts
            messages = messages[:share]
            positions[p] = messages[-1].offset + (INSIDE if inside else "")
            more = True
        elif entries:
            positions[p] = text(entries[-1][0])
        else:
            positions[p] = position
        found += messages
    found.sort(key=lambda m: (offset_parts(m.offset), m.partition))
    return TailBatch(found, format_cursor(positions), more)
