"""Dead letters: a group's poison messages, kept in an ordinary redisq topic.

The dead-letter topic of group g on topic t is "<t>~dlq~<g>" (`redisq.model.keys.dead_letter_topic`;
one partition, created on demand). Each dead letter keeps the original key, value and headers,
plus headers saying where it came from and why it failed: x-redisq-topic, -partition, -offset,
-group, -error, -attempts, -at-ms. It is written with idempotence="message_id" and message id
"<topic>/<partition>/<offset>", so a crash between the copy and the source ack writes it once.

A malformed entry (records.MalformedMessage: not a redisq message) is dead-lettered with what
could be read as key, value and headers, the reason in x-redisq-error ("MalformedEntry: ..."),
and every raw field of the entry, in order, in x-redisq-raw-fields (model.fields.encode_fields).

Before the "~" names, the dead-letter topic was "<t>.<g>.dlq", which (pay.eu, billing) and
(pay, eu.billing) shared. Letters still in such a topic are listed and replayed with the group
they name in their x-redisq-topic and x-redisq-group headers, never with the other's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redisq.consume.letters import (
    HEADER_PREFIX,
    LETTER_MAX_BYTES,
    LETTER_PRODUCER_OPTIONS,
    MAX_ERROR_CHARS,
    RAW_FIELDS_HEADER,
    DeadLetterWriter,
    letter,
)
from redisq.errors import GroupNotFound, InvalidConfig, InvalidName, TopicNotFound
from redisq.model.fields import decode_fields
from redisq.model.keys import (
    dead_letter_topic,
    parse_dead_letter_topic,
    validate_name,
    validate_topic,
)
from redisq.model.records import Message, parse_id_field
from redisq.produce.producer import Producer
from redisq.protocol.groups import group_exists

if TYPE_CHECKING:
    from redisq.server.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.deadletter")


__all__ = [
    "HEADER_PREFIX",
    "LETTER_PRODUCER_OPTIONS",
    "MAX_ERROR_CHARS",
    "RAW_FIELDS_HEADER",
    "DeadLetter",
    "DeadLetterWriter",
    "dead_letter_topic",
    "letter",
    "list_dead_letters",
    "parse_dead_letter_topic",
    "replay_dead_letters",
]


def _legacy_dead_letter_topic(topic: str, group: str) -> str | None:
    """The pre-"~" name "<t>.<g>.dlq", when it is a valid topic name (else it never existed)."""
    try:
        return validate_topic(f"{topic}.{group}.dlq")
    except InvalidName:
        return None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message in a dead-letter topic, with where it came from and why it failed.

    raw_fields is set for a malformed entry: every field as it was stored, in order.
    stored_in is the dead-letter topic that holds it."""

    message: Message
    topic: str
    partition: int
    offset: str
    group: str
    error: str
    attempts: int
    dead_lettered_ms: int
    raw_fields: list[tuple[bytes, bytes]] | None = None
    stored_in: str = ""

    @property
    def original_headers(self) -> dict[str, bytes]:
        return {k: v for k, v in self.message.headers.items() if not k.startswith(HEADER_PREFIX)}

    @classmethod
    def from_message(cls, message: Message) -> DeadLetter:
        """Lenient: a letter whose x-redisq headers are missing or damaged still lists."""
        h = message.headers

        def text(name: str) -> str:
            return h.get(HEADER_PREFIX + name, b"").decode(errors="replace")

        def number(name: str, default: int) -> int:
            found = parse_id_field(h.get(HEADER_PREFIX + name))
            return default if found is None else found

        raw_fields = None
        if RAW_FIELDS_HEADER in h:
            try:
                raw_fields = decode_fields(h[RAW_FIELDS_HEADER])
            except ValueError:
                raw_fields = None
        return cls(
            message=message,
            topic=text("topic"),
            partition=number("partition", -1),
            offset=text("offset"),
            group=text("group"),
            error=text("error"),
            attempts=number("attempts", 0),
            dead_lettered_ms=number("at-ms", 0),
            raw_fields=raw_fields,
            stored_in=message.topic,
        )


def list_dead_letters(
    broker: Broker, topic: str, group: str, *, count: int | None = None
) -> list[DeadLetter]:
    """The group's dead letters, oldest first (also those still in a pre-"~" dead-letter topic,
    taken only when their headers name this topic and group)."""
    letters = _read_letters(broker, dead_letter_topic(topic, group))
    legacy = _legacy_dead_letter_topic(topic, group)
    if legacy is not None:
        letters += [
            d for d in _read_letters(broker, legacy) if d.topic == topic and d.group == group
        ]
    letters.sort(key=lambda d: d.message.timestamp_ms)
    return letters[:count] if count is not None else letters


def _read_letters(broker: Broker, name: str) -> list[DeadLetter]:
    try:
        config = broker.topic_config(name, refresh=True)
    except TopicNotFound:
        return []
    return [
        DeadLetter.from_message(message)
        for p in range(config.partitions)
        for message in broker.read(name, p)
    ]


def require_dead_letters(broker: Broker, topic: str, group: str) -> None:
    """TopicNotFound / GroupNotFound, unless the group's dead-letter topic exists (it may
    outlive its group: `group delete --keep-dead-letters`). The CLI and the console check this
    before they list, replay or release."""
    broker.topic_config(topic, refresh=True)
    if broker.run(group_exists(broker.keys, topic, group)):
        return
    try:
        broker.topic_config(dead_letter_topic(topic, group), refresh=True)
    except TopicNotFound:
        raise GroupNotFound(topic, group) from None


def replay_dead_letters(
    broker: Broker,
    topic: str,
    group: str,
    *,
    offsets: Iterable[str] | None = None,
    key: bytes | None = None,
    to_topic: str | None = None,
) -> int:
    """Send dead letters back to the topic each came from (its x-redisq-topic header; to_topic
    overrides), then delete them from the dead-letter topic. offsets (dead-letter offsets) or
    key select some; neither selects all.

    A replayed message is appended: it comes after whatever the topic received meanwhile. It
    carries its original key, value and headers (a malformed entry's readable ones: it comes
    back as a well-formed message). The re-send uses message id "replay/<dead-letter
    topic>/<offset>", so replaying twice after a crash between the send and the delete writes
    it once (within the target's dedup window). Returns how many were replayed. An offset that
    is no dead letter of the group is refused (InvalidConfig) before anything is sent.
    """
    if to_topic is not None:
        validate_topic(to_topic)
    wanted = set(offsets) if offsets is not None else None
    every = list_dead_letters(broker, topic, group)
    missing = sorted((wanted or set()) - {d.message.offset for d in every})
    if missing:
        raise InvalidConfig(
            f"no dead letter of group {group!r} at {', '.join(map(repr, missing))}: "
            "nothing replayed"
        )
    letters = [
        d
        for d in every
        if (wanted is None or d.message.offset in wanted) and (key is None or d.message.key == key)
    ]
    if not letters:
        return 0
    replayed = 0
    with Producer(broker, idempotence="message_id", max_message_bytes=LETTER_MAX_BYTES) as producer:
        for letter in letters:
            target = to_topic or _origin(letter)
            producer.send(
                target,
                letter.message.value,
                key=letter.message.key or None,
                headers=letter.original_headers,
                message_id=f"replay/{letter.stored_in}/{letter.message.offset}",
            )
            broker.client.xdel(
                broker.keys.log(letter.stored_in, letter.message.partition), letter.message.offset
            )
            replayed += 1
            log.info(
                "replayed dead letter %s@%s to %s", letter.stored_in, letter.message.offset, target
            )
    return replayed


def _origin(letter: DeadLetter) -> str:
    """The topic a letter came from: its x-redisq-topic header, else the topic its dead-letter
    topic's name was built from (a letter written by another client may lack the header)."""
    try:
        return validate_topic(letter.topic)
    except InvalidName:
        parsed = parse_dead_letter_topic(letter.stored_in)
        if parsed is None:
            raise InvalidName(
                f"dead letter {letter.stored_in}@{letter.message.offset} names no valid source "
                f"topic ({letter.topic!r}): replay it with to_topic"
            ) from None
        return parsed[0]


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
