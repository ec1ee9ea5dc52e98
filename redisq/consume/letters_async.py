"""Writing dead letters: what a letter holds (`letter`) and the writer a consumer copies its
group's poison messages with (`AsyncDeadLetterWriter`). Listing, replaying and releasing them:
redisq.consume.deadletter, where the dead-letter topic's layout is described.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from redisq.model.fields import encode_fields
from redisq.model.keys import dead_letter_topic
from redisq.model.records import MalformedMessage, Message
from redisq.produce.producer_async import Producer
from redisq.runtime import ALock

if TYPE_CHECKING:
    from redisq.server.handle_async import AsyncBrokerHandle as Broker

HEADER_PREFIX = "x-redisq-"
RAW_FIELDS_HEADER = HEADER_PREFIX + "raw-fields"
MAX_ERROR_CHARS = 2000
# A letter holds what Redis already stored (plus headers), so it must never be refused for size.
LETTER_MAX_BYTES = 512 << 20

LETTER_PRODUCER_OPTIONS = {
    "idempotence": "message_id",
    "max_message_bytes": LETTER_MAX_BYTES,
    "max_batch_bytes": 64 << 20,
}


def letter(
    message: Message, error: BaseException | str, attempts: int, group: str
) -> tuple[bytes, bytes | None, dict[str, str | bytes], str]:
    """(value, key, headers, message id) of the dead letter of `message`: written with this
    message id, a repeated copy (a crash before the source moved on) is stored once."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    headers: dict[str, str | bytes] = dict(message.headers)
    if isinstance(message, MalformedMessage):
        headers[RAW_FIELDS_HEADER] = encode_fields(message.raw_fields)
    headers.update(
        {
            HEADER_PREFIX + "topic": message.topic,
            HEADER_PREFIX + "partition": str(message.partition),
            HEADER_PREFIX + "offset": message.offset,
            HEADER_PREFIX + "group": group,
            HEADER_PREFIX + "error": text[:MAX_ERROR_CHARS],
            HEADER_PREFIX + "attempts": str(attempts),
            HEADER_PREFIX + "at-ms": str(int(time.time() * 1000)),
        }
    )
    key = message.key or None  # a foreign entry may hold an empty k
    return message.value, key, headers, f"{message.topic}/{message.partition}/{message.offset}"


class AsyncDeadLetterWriter:
    """Copies failed messages to the dead-letter topic through one lazily started producer.

    The topic name is checked here, eagerly (InvalidName past its length limit, which only a
    deeply nested dead-letter topic can reach)."""

    def __init__(self, broker: Broker, topic: str, group: str) -> None:
        self._broker = broker
        self.topic = dead_letter_topic(topic, group)
        self._group = group
        self._producer: Producer | None = None
        self._lock = ALock()  # held across the topic's creation

    async def _ensure(self) -> Producer:
        async with self._lock:
            if self._producer is None:
                await self._broker.create_topic(self.topic, partitions=1, exist_ok=True)
                self._producer = Producer(self._broker, **LETTER_PRODUCER_OPTIONS)  # type: ignore[arg-type]
            return self._producer

    async def write(self, message: Message, error: BaseException | str, attempts: int) -> None:
        """Blocks until the copy is acknowledged."""
        value, key, headers, message_id = letter(message, error, attempts, self._group)
        producer = await self._ensure()
        await producer.send(self.topic, value, key=key, headers=headers, message_id=message_id)

    async def close(self) -> None:
        async with self._lock:
            if self._producer is not None:
                await self._producer.close()
                self._producer = None
