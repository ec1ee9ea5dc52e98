"""Dead letters: a group's poison messages, kept in an ordinary redisq topic.

The dead-letter topic of group g on topic t is "<t>.<g>.dlq" (one partition, created on demand).
Each dead letter keeps the original key, value and headers, plus headers saying where it came
from and why it failed: x-redisq-topic, -partition, -offset, -group, -error, -attempts, -at-ms.
It is written with idempotence="message_id" and message id "<topic>/<partition>/<offset>", so a
crash between the copy and the source ack writes it once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.errors import TopicNotFound
from redisq.keys import validate_name, validate_topic
from redisq.records import Message

if TYPE_CHECKING:
    from redisq.broker import Broker
    from redisq.producer import Producer

log = logging.getLogger("redisq.deadletter")

HEADER_PREFIX = "x-redisq-"
MAX_ERROR_CHARS = 2000


def dead_letter_topic(topic: str, group: str) -> str:
    return validate_topic(f"{topic}.{validate_name('group', group)}.dlq")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message in a dead-letter topic, with where it came from and why it failed."""

    message: Message
    topic: str
    partition: int
    offset: str
    group: str
    error: str
    attempts: int
    dead_lettered_ms: int

    @property
    def original_headers(self) -> dict[str, bytes]:
        return {k: v for k, v in self.message.headers.items() if not k.startswith(HEADER_PREFIX)}

    @classmethod
    def from_message(cls, message: Message) -> DeadLetter:
        h = message.headers

        def text(name: str, default: str = "") -> str:
            return h.get(HEADER_PREFIX + name, default.encode()).decode(errors="replace")

        return cls(
            message=message,
            topic=text("topic"),
            partition=int(text("partition", "-1")),
            offset=text("offset"),
            group=text("group"),
            error=text("error"),
            attempts=int(text("attempts", "0")),
            dead_lettered_ms=int(text("at-ms", "0")),
        )


class DeadLetterWriter:
    """Copies failed messages to the dead-letter topic through one lazily started producer."""

    def __init__(self, broker: Broker, topic: str, group: str) -> None:
        self._broker = broker
        self.topic = dead_letter_topic(topic, group)
        self._group = group
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> Producer:
        with self._lock:
            if self._producer is None:
                self._broker.create_topic(self.topic, partitions=1, exist_ok=True)
                self._producer = self._broker.producer(idempotence="message_id")
            return self._producer

    def write(self, message: Message, error: BaseException | str, attempts: int) -> None:
        """Blocks until the copy is acknowledged."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        headers: dict[str, str | bytes] = dict(message.headers)
        headers.update(
            {
                HEADER_PREFIX + "topic": message.topic,
                HEADER_PREFIX + "partition": str(message.partition),
                HEADER_PREFIX + "offset": message.offset,
                HEADER_PREFIX + "group": self._group,
                HEADER_PREFIX + "error": text[:MAX_ERROR_CHARS],
                HEADER_PREFIX + "attempts": str(attempts),
                HEADER_PREFIX + "at-ms": str(int(time.time() * 1000)),
            }
        )
        self._ensure().send(
            self.topic,
            message.value,
            key=message.key,
            headers=headers,
            message_id=f"{message.topic}/{message.partition}/{message.offset}",
        )

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close()
                self._producer = None


def list_dead_letters(
    broker: Broker, topic: str, group: str, *, count: int | None = None
) -> list[DeadLetter]:
    """The group's dead letters, oldest first."""
    name = dead_letter_topic(topic, group)
    try:
        config = broker.topic_config(name, refresh=True)
    except TopicNotFound:
        return []
    letters = []
    for p in range(config.partitions):
        for message in broker.read(name, p, count=count):
            letters.append(DeadLetter.from_message(message))
    letters.sort(key=lambda d: d.message.timestamp_ms)
    return letters[:count] if count is not None else letters


def replay_dead_letters(
    broker: Broker,
    topic: str,
    group: str,
    *,
    offsets: Iterable[str] | None = None,
    key: bytes | None = None,
    to_topic: str | None = None,
) -> int:
    """Send dead letters back to their topic (or to_topic), then delete them from the dead-letter
    topic. offsets (dead-letter offsets) or key select some; neither selects all.

    A replayed message is appended: it comes after whatever the topic received meanwhile. The
    re-send uses message id "replay/<dead-letter offset>", so replaying twice after a crash
    between the send and the delete writes it once (within the target's dedup window).
    Returns how many were replayed.
    """
    name = dead_letter_topic(topic, group)
    wanted = set(offsets) if offsets is not None else None
    letters = [
        d
        for d in list_dead_letters(broker, topic, group)
        if (wanted is None or d.message.offset in wanted) and (key is None or d.message.key == key)
    ]
    if not letters:
        return 0
    target = to_topic or topic
    replayed = 0
    with broker.producer(idempotence="message_id") as producer:
        for letter in letters:
            producer.send(
                target,
                letter.message.value,
                key=letter.message.key,
                headers=letter.original_headers,
                message_id=f"replay/{name}/{letter.message.offset}",
            )
            broker.client.xdel(
                broker.keys.log(name, letter.message.partition), letter.message.offset
            )
            replayed += 1
    log.info("replayed %d dead letters of %s/%s to %s", replayed, topic, group, target)
    return replayed


def release_key(broker: Broker, topic: str, group: str, key: bytes | str) -> int:
    """Release a key parked by the park_key policy: its held messages go on. Returns how many
    partitions had it parked (0 or 1 with the default partitioner)."""
    validate_name("group", group)
    raw = key.encode() if isinstance(key, str) else key
    config = broker.topic_config(topic, refresh=True)
    released = 0
    for p in range(config.partitions):
        released += int(broker.client.hdel(broker.keys.parked_keys(topic, p, group), raw))
    return released


def parked_keys(broker: Broker, topic: str, group: str) -> dict[int, dict[bytes, str]]:
    """partition -> {parked key: offset of the dead letter that parked it}."""
    config = broker.topic_config(topic, refresh=True)
    result = {}
    for p in range(config.partitions):
        raw = broker.client.hgetall(broker.keys.parked_keys(topic, p, group))
        if raw:
            result[p] = {k: v.decode() for k, v in raw.items()}
    return result
