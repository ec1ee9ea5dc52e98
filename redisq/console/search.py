"""Search across every partition of a topic: by key, by message id, or by time, bounded.

* By time (a timestamp range): a partition's offsets are its append times in milliseconds, so
  a time range is an XRANGE by milliseconds on each partition, pipelined (one round trip), at
  most limit + 1 entries each; merged by time, the first `limit` are shown, and the page says
  when there were more.
* By key (optionally within a time range): every partition read newest first in rounds, one
  pipelined XREVRANGE per partition per round, until `limit` messages match or `scan_limit`
  entries were read in all; the page says which bound stopped it. A key is searched in every
  partition, not only the one the default partitioner picks: a custom partitioner, or a topic
  grown since, puts it elsewhere.
* By message id: browse.find_by_message_id (the dedup window's id -> offset index in every
  partition, one pipelined round trip, then a bounded scan).

Everything decodes through redisq.model.records.decode_entries, as a consumer would: a batch
entry (DESIGN §14) gives each of its messages at its own offset. Bounds count entries read
(a batch entry is one), limits count messages; a time range is entry-aligned (the messages of an
entry share its millisecond).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.console.browse import MAX_COUNT, SCAN_LIMIT, find_by_message_id, parse_bound
from redisq.errors import InvalidConfig, read_reply
from redisq.model.offsets import offset_before, offset_parts
from redisq.model.records import Message, decode_entries
from redisq.protocol import text

if TYPE_CHECKING:
    from redisq.broker import Broker

SCAN_BATCH = 1000  # entries per partition per round of a key search
LAST_SEQ = "18446744073709551615"  # the largest sequence of a millisecond


@dataclass(frozen=True, slots=True)
class TopicSearch:
    messages: list[Message]  # newest first for a key, oldest first for a time range
    scanned: int  # entries read
    stopped: str  # "" when the search was complete, else what bound it stopped at
    where: str  # what was searched, for the page


def time_range(since: str | None, until: str | None) -> tuple[str, str]:
    """XRANGE bounds of a time range: ISO date-times or epoch milliseconds, `until` taken as the
    whole of its millisecond; either may be blank (open)."""
    start = parse_bound(since, time=True) or "-"
    end = parse_bound(until, time=True)
    if end is None:
        end = "+"
    elif not end.startswith("("):
        end = end.split("-")[0] + "-" + LAST_SEQ
    if start != "-" and end != "+":
        low = offset_parts(start.lstrip("("))
        high = offset_parts(end.lstrip("("))
        if low > high:
            raise InvalidConfig(f"the time range ends ({until}) before it starts ({since})")
    return start, end


def by_time(
    broker: Broker, topic: str, since: str | None, until: str | None, *, limit: int = 100
) -> TopicSearch:
    """The first `limit` messages of the range over all partitions, oldest first."""
    config = broker.topic_config(topic, refresh=True)
    limit = max(1, min(limit, MAX_COUNT))
    start, end = time_range(since, until)
    pipe = broker.client.pipeline(transaction=False)
    for p in range(config.partitions):
        pipe.xrange(broker.keys.log(topic, p), min=start, max=end, count=limit + 1)
    found: list[Message] = []
    for p, reply in enumerate(pipe.execute(raise_on_error=False)):
        found += decode_entries(topic, p, read_reply(reply, f"topic {topic!r} partition {p}"))
    found.sort(key=lambda m: (offset_parts(m.offset), m.partition))
    stopped = f"the limit of {limit} messages" if len(found) > limit else ""
    return TopicSearch(
        found[:limit], len(found), stopped, f"all {config.partitions} partitions, by time"
    )


def by_key(
    broker: Broker,
    topic: str,
    key: bytes,
    *,
    since: str | None = None,
    until: str | None = None,
    limit: int = 100,
    scan_limit: int = SCAN_LIMIT,
) -> TopicSearch:
    """The newest messages with this key in every partition (within the time range if given),
    newest first; bounded by `limit` matches and `scan_limit` entries read."""
    config = broker.topic_config(topic, refresh=True)
    limit = max(1, min(limit, MAX_COUNT))
    low, high = time_range(since, until)
    cursors: dict[int, str] = dict.fromkeys(range(config.partitions), high)
    found: list[Message] = []
    scanned = 0
    while cursors and scanned < scan_limit and len(found) < limit:
        batch = max(1, min(SCAN_BATCH, (scan_limit - scanned) // len(cursors)))
        pipe = broker.client.pipeline(transaction=False)
        order = sorted(cursors)
        for p in order:
            pipe.xrevrange(broker.keys.log(topic, p), max=cursors[p], min=low, count=batch)
        for p, reply in zip(order, pipe.execute(raise_on_error=False), strict=True):
            entries = read_reply(reply, f"topic {topic!r} partition {p}")
            scanned += len(entries)
            found += [m for m in decode_entries(topic, p, entries) if m.key == key]
            before = offset_before(text(entries[-1][0])) if entries else None
            if len(entries) < batch or before is None:
                del cursors[p]  # read to the start of the range
            else:
                cursors[p] = before
    found.sort(key=lambda m: (offset_parts(m.offset), m.partition), reverse=True)
    if len(found) >= limit and (cursors or len(found) > limit):
        stopped = f"the limit of {limit} messages"
    elif cursors:
        stopped = f"the scan limit of {scan_limit:,} entries"
    else:
        stopped = ""
    return TopicSearch(
        found[:limit],
        scanned,
        stopped,
        f"all {config.partitions} partitions, newest first, {scanned:,} entries read",
    )


def by_message_id(
    broker: Broker, topic: str, message_id: bytes, *, scan_limit: int = SCAN_LIMIT
) -> TopicSearch:
    result = find_by_message_id(broker, topic, message_id, scan_limit=scan_limit)
    stopped = (
        f"the scan limit of {scan_limit:,} entries"
        if not result.messages and result.scanned >= scan_limit
        else ""
    )
    return TopicSearch(result.messages, result.scanned, stopped, result.where)
