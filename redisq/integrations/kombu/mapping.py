"""What a Kombu message becomes on a topic, and back: the key that orders it, the id that
deduplicates it, the time it is due and the time it expires. No I/O."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kombu.utils.json import dumps, loads

#: The message header that names a message's ordering key (Celery:
#: ``apply_async(..., headers={"ordering_key": "order-42"})``).
ORDERING_HEADER = "ordering_key"
#: A Kombu producer that is not Celery names a message's id for deduplication with this header.
MESSAGE_ID_HEADER = "message_id"
#: redisq header carrying when a message with a per-message TTL (``expiration``) expires.
EXPIRES_AT_HEADER = "kombu-expires-at-ms"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One Kombu message as a redisq send: key, value, headers, message id, due time."""

    value: bytes
    key: str
    headers: dict[str, str]
    message_id: str
    deliver_at: datetime | None
    partition: int | None = None


def task_message_id(headers: dict[str, Any]) -> str | None:
    """The id that deduplicates the message: a Celery task's id, or the message_id header.

    Celery re-publishes a retried task (``self.retry()``) under the same task id with its
    ``retries`` count raised: each retry is a new message, so the count is part of the id (the
    same retry sent twice is still written once)."""
    if "task" in headers and headers.get("id"):
        retries = headers.get("retries") or 0
        task_id = str(headers["id"])
        return task_id if not retries else f"{task_id}.retry-{int(retries)}"
    explicit = headers.get(MESSAGE_ID_HEADER)
    return str(explicit) if explicit else None


def due_time(headers: dict[str, Any], now: datetime | None = None) -> datetime | None:
    """Celery's countdown/eta (protocol 2: the ``eta`` header, ISO 8601): the message is held in
    the topic's schedule until then instead of in a worker's memory. None when due now."""
    eta = headers.get("eta")
    if not eta or not isinstance(eta, str):
        return None
    try:
        due = datetime.fromisoformat(eta)
    except ValueError:
        return None
    if due.tzinfo is None:  # Celery with enable_utc=False sends naive local times
        due = due.astimezone()
    if due <= (now or datetime.now(UTC)):
        return None
    return due


def outgoing(message: dict[str, Any], ordering_header: str = ORDERING_HEADER) -> Outgoing:
    """A Kombu message (the virtual transport's dict: body, headers, properties) as a send."""
    headers = message.get("headers") or {}
    key = headers.get(ordering_header)
    message_id = task_message_id(headers)
    partition = None
    if message_id is None:
        # A plain Kombu message (no task id, no ordering key): Kombu's queues are FIFO, so all
        # of them share partition 0 and go out in send order; a fresh id as key still lets the
        # bridge hand several out at once (they do not wait for each other's acks).
        message_id = uuid.uuid4().hex
        partition = 0 if key in (None, "") else None
    redisq_headers: dict[str, str] = {}
    expiration = (message.get("properties") or {}).get("expiration")
    if expiration is not None:
        expires_at = int(time.time() * 1000) + int(float(expiration))
        redisq_headers[EXPIRES_AT_HEADER] = str(expires_at)
    return Outgoing(
        value=dumps(message).encode("utf-8"),
        # Without an ordering key the message id routes the message: its repeats then reach the
        # partition whose window remembers the id (dedup scope is the partition); Celery tasks
        # without one spread over the partitions, so over the workers.
        key=str(key) if key not in (None, "") else message_id,
        headers=redisq_headers,
        message_id=message_id,
        deliver_at=due_time(headers),
        partition=partition,
    )


def incoming(value: bytes) -> dict[str, Any]:
    return loads(value)


def expired(headers: dict[str, bytes], timestamp_ms: int, queue_ttl_ms: int | None) -> bool:
    """A per-message TTL (``expiration``) or the queue's ``x-message-ttl`` has passed."""
    now_ms = time.time() * 1000
    expires_at = headers.get(EXPIRES_AT_HEADER)
    if expires_at is not None and int(expires_at) <= now_ms:
        return True
    return queue_ttl_ms is not None and timestamp_ms + queue_ttl_ms <= now_ms
