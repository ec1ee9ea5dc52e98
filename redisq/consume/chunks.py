"""How a worker (thread or asyncio) takes an orderly or concurrent read: in lanes by key
(key_concurrency), and chunk by chunk as it handles them (admitted once, decoded as taken). No
I/O."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from redisq.consume.dispatch import OrderlyPartition
from redisq.model.records import MalformedMessage, Message, decode_entries


def lanes(messages: list[Message], count: int) -> list[list[Message]]:
    """key_concurrency: a key always maps to the same lane, so each key stays in order while
    different keys run in parallel; keyless messages spread out."""
    result: list[list[Message]] = [[] for _ in range(count)]
    for i, message in enumerate(messages):
        lane = zlib.crc32(message.key) if message.key is not None else i
        result[lane % count].append(message)
    return [lane for lane in result if lane]


def lanes_end(messages: list[Message], blocks_malformed: bool) -> int:
    """key_concurrency: how many of a read's messages go to lanes. When the policy blocks on a
    malformed entry, they stop short of the first one: it is met (and the partition blocks,
    reading again from it) only once all before it is handled, and nothing after it is
    handled before it."""
    if blocks_malformed:
        for i, message in enumerate(messages):
            if message.__class__ is MalformedMessage:
                return i
    return len(messages)


def admitted_chunks(
    reader: OrderlyPartition,
    entries: list[Any],
    size: int,
    lock: AbstractContextManager[Any],
    moves: int,
) -> Iterator[list[Message]]:
    """One fenced read's raw entries as Messages, admitted once (under `lock`) and decoded
    `size` at a time as the caller takes them, for a worker that handles each chunk before
    taking the next. With a key parked, or a read of one chunk, the read is decoded and
    admitted whole (admit holds back the parked keys' messages), and given out `size` at a
    time. `moves`: reader.moves when the read was sent. A position that jumped since (a seek,
    an aborted transaction) drops the read, whole if it jumped while the read was in flight,
    else its chunks not given out yet: the next read starts where it jumped to.

    The raw entries of each chunk given out are dropped from `entries` (set to None): the
    reply dies as it is handled instead of living, and being traced by the collector, until the
    next read replaces it (about a fifth less time in collections)."""
    topic, partition = reader.tp
    whole = len(entries) <= size
    head = decode_entries(topic, partition, entries[:size])
    last = None if whole else decode_entries(topic, partition, entries[-1:])[-1].offset
    with lock:
        if reader.moves != moves:
            return
        now = time.monotonic()
        if whole or reader.parked:
            messages = head if whole else decode_entries(topic, partition, entries)
            head, whole = reader.admit(messages, now), True
        else:
            reader.admit_read(head, last, now)
    if whole:
        for start in range(0, len(head), size):
            if start and reader.moves != moves:
                return
            yield head[start : start + size]
        return
    entries[:size] = [None] * size
    yield head
    for start in range(size, len(entries), size):
        if reader.moves != moves:  # moved by another thread (or the handler): read anew
            return
        end = start + size
        chunk = decode_entries(topic, partition, entries[start:end])
        entries[start:end] = [None] * len(entries[start:end])
        yield chunk
