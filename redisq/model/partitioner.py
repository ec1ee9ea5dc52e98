"""Which partition a message goes to.

The key hash is CRC-32 (IEEE 802.3, as zlib.crc32 and java.util.zip.CRC32 compute it) of the key's
bytes (str keys as UTF-8), modulo the number of partitions:

    partition = zlib.crc32(key) % partitions

It is stable across processes, machines and languages, and the Spark writer uses the same
function. Growing a topic's partition count changes where keys go (as in Kafka): order per key
holds only among messages sent with the same partition count.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

Selector = Callable[[str, bytes | None, bytes, int], int]
"""A custom partition selector: (topic, key, value, partitions) -> partition."""


def partition_for_key(key: bytes | str, partitions: int) -> int:
    """The partition of a key: CRC-32 of its bytes (a str as UTF-8) modulo the partition count,
    as the producer and the Spark writer route it."""
    if isinstance(key, str):
        key = key.encode()
    return zlib.crc32(key) % partitions


class StickyPartitioner:
    """Messages without a key stick to one partition until its batch is sealed, then move on
    round-robin (Kafka's sticky partitioner): full batches without giving up spreading."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}
        self._counter = itertools.count()

    def partition(self, topic: str, partitions: int) -> int:
        current = self._current.get(topic)
        if current is None or current >= partitions:
            current = next(self._counter) % partitions
            self._current[topic] = current
        return current

    def batch_sealed(self, topic: str, partition: int, partitions: int) -> None:
        if self._current.get(topic) == partition:
            self._current[topic] = (partition + 1) % partitions
