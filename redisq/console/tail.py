"""A live tail of a topic: the page polls for what every partition appended since its cursor.

Polling rather than a held connection: a tail holds nothing on the server between two polls
(no thread, no blocked connection), so it stops when the page closes, and one poll is a
bounded read: one pipelined XRANGE per partition from the cursor (exclusive), at most
`per_partition` entries each. The cursor is the ID of the last entry read per partition, not a
message offset (DESIGN §14.9): a batch entry is read whole and shown as its messages, each at
its own offset, and "(" + its ID starts after all of them. It is carried by the page
("0:1700000000000-0,1:..."); a partition missing from it (the topic grew since the page
opened) is read from its start, since all of it is newer than the page. The page keeps the
newest messages only, and stops polling after a while (static/console.js).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.console.browse import BATCH_TOPIC_READ
from redisq.errors import InvalidConfig, read_reply
from redisq.model.offsets import offset_parts
from redisq.model.records import Message, decode_entries
from redisq.protocol import text

if TYPE_CHECKING:
    from redisq.broker import Broker

MAX_PER_POLL = 500  # entries one poll reads at most (over all partitions, but >= 1 each;
# on a batch topic at most browse.BATCH_TOPIC_READ per partition, each a producer batch)
START = "0-0"


@dataclass(frozen=True, slots=True)
class TailBatch:
    messages: list[Message]  # oldest first
    cursor: str  # for the next poll
    more: bool  # a partition had more than one poll reads: poll again at once


def format_cursor(positions: dict[int, str]) -> str:
    return ",".join(f"{p}:{offset}" for p, offset in sorted(positions.items()))


def parse_cursor(raw: str, partitions: int) -> dict[int, str]:
    """The cursor the page sent back, checked: partitions of the topic, valid offsets."""
    positions: dict[int, str] = {}
    for part in filter(None, raw.split(",")):
        number, _, offset = part.partition(":")
        try:
            partition = int(number)
            ms, seq = offset_parts(offset)
        except ValueError:
            raise InvalidConfig(f"tail cursor {part!r}: expected <partition>:<ms>-<seq>") from None
        if not 0 <= partition < partitions:
            raise InvalidConfig(f"tail cursor: partition {partition} is out of range")
        positions[partition] = f"{ms}-{seq}"
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
    per_partition = max(1, MAX_PER_POLL // config.partitions)
    if config.entry_format == "batch":  # an entry holds a producer batch: fewer per poll
        per_partition = min(per_partition, BATCH_TOPIC_READ)
    pipe = broker.client.pipeline(transaction=False)
    for p in range(config.partitions):
        after = "(" + positions.get(p, START)
        pipe.xrange(broker.keys.log(topic, p), min=after, max="+", count=per_partition)
    found: list[Message] = []
    more = False
    for p, reply in enumerate(pipe.execute(raise_on_error=False)):
        entries = read_reply(reply, f"topic {topic!r} partition {p}")
        if entries:
            positions[p] = text(entries[-1][0])
            found += decode_entries(topic, p, entries)
        positions.setdefault(p, START)
        more = more or len(entries) >= per_partition
    found.sort(key=lambda m: (offset_parts(m.offset), m.partition))
    return TailBatch(found, format_cursor(positions), more)
