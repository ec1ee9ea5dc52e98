"""What the console's buttons do, each through the library call the CLI uses, so a button and
a command can never disagree: test produce (an ordinary idempotent producer), dead-letter replay
and release (redisq.consume.deadletter), offset reset (Broker.reset_offsets: refused with
GroupInUse while the group has live members or a held lease, as the CLI refuses it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from redisq.consume.deadletter import release_key, replay_dead_letters, require_dead_letters
from redisq.errors import GroupNotFound, InvalidConfig
from redisq.model.groups import OffsetReset
from redisq.model.records import RecordMetadata
from redisq.protocol.groups import group_exists

if TYPE_CHECKING:
    from redisq.broker import Broker
    from redisq.produce.producer import Producer

log = logging.getLogger("redisq.console")

RESET_TARGETS = ("earliest", "latest", "datetime", "offset", "shift")


def parse_headers(raw: str) -> dict[str, str]:
    """ "name: value" per line (or name=value); blank lines are skipped."""
    headers = {}
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        sep = ":" if ":" in line else "="
        name, found, value = line.partition(sep)
        if not found or not name.strip():
            raise InvalidConfig(f"header line {number}: expected 'name: value'")
        headers[name.strip()] = value.strip()
    return headers


class Producers:
    """The console's own producers (anonymous, started on first use and kept: a producer per
    click would draw a new identity and leave a producer state behind every time)."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._lock = threading.Lock()
        self._producers: dict[str, Producer] = {}

    def _get(self, mode: str) -> Producer:
        with self._lock:
            producer = self._producers.get(mode)
            if producer is None:
                producer = self._broker.producer(idempotence=mode)  # type: ignore[arg-type]
                self._producers[mode] = producer
            return producer

    def send(
        self,
        topic: str,
        value: str,
        *,
        key: str = "",
        headers: dict[str, str] | None = None,
        message_id: str = "",
    ) -> RecordMetadata:
        """Blocks until acknowledged; an id sends through a message-id producer (a second send
        of the same id answers duplicate with the first offset)."""
        producer = self._get("message_id" if message_id else "sequence")
        meta = producer.send(
            topic,
            value.encode(),
            key=key.encode() if key else None,
            headers=headers or None,
            message_id=message_id.encode() if message_id else None,
        )
        log.info("test produce to %s: partition %d offset %s", topic, meta.partition, meta.offset)
        return meta

    def close(self) -> None:
        with self._lock:
            producers, self._producers = list(self._producers.values()), {}
        for producer in producers:
            producer.close(timeout=5)


def replay(broker: Broker, topic: str, group: str, offsets: list[str] | None) -> int:
    """offsets (dead-letter offsets) or all of them; returns how many were replayed. A missing
    group, or an offset that is no dead letter of the group, is refused before anything is
    sent (as `redisq dlq replay`)."""
    require_dead_letters(broker, topic, group)
    return replay_dead_letters(broker, topic, group, offsets=offsets or None)


def release(broker: Broker, topic: str, group: str, key: str) -> int:
    """As `redisq dlq release`: TopicNotFound / GroupNotFound first."""
    if not key:
        raise InvalidConfig("release needs the parked key")
    broker.topic_config(topic, refresh=True)
    if not broker.run(group_exists(broker.keys, topic, group)):
        raise GroupNotFound(topic, group)
    return release_key(broker, topic, group, key.encode())


@dataclass(frozen=True, slots=True)
class ResetRequest:
    target: str
    value: str = ""
    partitions: list[int] | None = None
    dry_run: bool = False


def reset(broker: Broker, topic: str, group: str, request: ResetRequest) -> list[OffsetReset]:
    """The CLI's `group reset-offsets` through the same library call (see module docstring)."""
    target, value = request.target, request.value.strip()
    if target not in RESET_TARGETS:
        raise InvalidConfig(f"reset target {target!r}: one of {', '.join(RESET_TARGETS)}")
    options: dict[str, object] = {}
    if target == "earliest":
        options["to_earliest"] = True
    elif target == "latest":
        options["to_latest"] = True
    elif target == "datetime":
        if value.isdigit():
            options["to_datetime"] = int(value)
        else:
            try:
                options["to_datetime"] = datetime.fromisoformat(value)
            except ValueError:
                raise InvalidConfig(f"{value!r}: a date-time (ISO 8601) or epoch ms") from None
    elif target == "offset":
        options["to_offset"] = value
    else:
        try:
            options["shift_by"] = int(value)
        except ValueError:
            raise InvalidConfig(f"shift by {value!r}: an integer (+N skips, -N re-reads)") from None
    return broker.reset_offsets(
        topic,
        group,
        partitions=request.partitions,
        dry_run=request.dry_run,
        **options,  # type: ignore[arg-type]
    )
