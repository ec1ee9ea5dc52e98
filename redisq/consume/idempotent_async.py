"""Exactly-once effects on top of at-least-once delivery: the idempotent handler helper.

Per message a key holds "processing:<token>" (SET NX, ttl processing_ttl_ms) while a handler
runs, then "done" (ttl done_ttl_ms). A redelivered message that is done is skipped; one whose
handler raised is run again at once (the marker is deleted); one whose handler crashed is run
again once the processing marker expires. The marker lives in the message's partition slot.

The message is identified by its message id when it has one (so a business duplicate written
twice is also skipped), else by its offset. In the asyncio API the handler may be a coroutine
function; a plain one runs in a worker thread (as the consumer's run() runs it).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redisq.errors import check_int
from redisq.model.keys import validate_name
from redisq.model.records import Message
from redisq.model.topic import MAX_TOPIC_SETTING
from redisq.protocol import Command, Operation, ScriptCall
from redisq.runtime import acall_user, asleep, is_coroutine_callable

if TYPE_CHECKING:
    from redisq.server.handle_async import AsyncBrokerHandle as Broker

log = logging.getLogger("redisq.idempotent")

DONE = b"done"


def message_ident(message: Message) -> str:
    if message.message_id is not None:
        try:
            return "m:" + message.message_id.decode()
        except UnicodeDecodeError:
            return "x:" + message.message_id.hex()
    return "o:" + message.offset


class IdempotentSettings:
    """What both drivers' idempotent handlers share: the settings, the marker key, and the
    Redis steps (protocol operations) of claiming, finishing and releasing a message.

    processing_ttl_ms must exceed the handler's longest run: past it, a duplicate delivery may
    start while the first run is still going.
    """

    def __init__(
        self,
        broker: Any,
        handler: Callable[[Message], Any],
        *,
        scope: str,
        done_ttl_ms: int = 24 * 3600 * 1000,
        processing_ttl_ms: int = 60_000,
        wait_poll_s: float = 0.05,
    ) -> None:
        # SET PX takes whole milliseconds; the bound is the topics' (2**53 - 1).
        check_int("done_ttl_ms", done_ttl_ms, 1000, MAX_TOPIC_SETTING)
        check_int("processing_ttl_ms", processing_ttl_ms, 100, MAX_TOPIC_SETTING)
        self._broker = broker
        self._handler = handler
        self._coroutine = is_coroutine_callable(handler)  # asyncio: else run in a worker thread
        self.scope = validate_name("scope", scope)
        self.done_ttl_ms = done_ttl_ms
        self.processing_ttl_ms = processing_ttl_ms
        self._wait_poll_s = wait_poll_s
        self.skipped = 0
        self.ran = 0

    def marker_key(self, message: Message) -> str:
        return self._broker.keys.idempotency(  # type: ignore[no-any-return]
            message.topic, message.partition, self.scope, message_ident(message)
        )

    def claim(self, key: str, marker: str) -> Operation[bool | None]:
        """SET NX processing: True to run; False if the message is done (skip); None while
        another run holds the marker (live, or crashed and not yet expired): ask again."""
        if (yield Command(("SET", key, marker, "NX", "PX", self.processing_ttl_ms))):
            return True
        state = yield Command(("GET", key))
        return False if state == DONE else None

    def finished(self, key: str) -> Command[Any]:
        return Command(("SET", key, DONE, "PX", self.done_ttl_ms))

    @staticmethod
    def released(key: str, marker: str, topic: str) -> ScriptCall[Any]:
        """release_lease.lua: delete the marker only if it is still ours (the handler raised)."""
        return ScriptCall("release_lease", (key,), (marker,), topic=topic)

    def skip(self, message: Message) -> None:
        self.skipped += 1
        log.debug(
            "skipping %s/%d@%s: done before", message.topic, message.partition, message.offset
        )


class AsyncIdempotentHandler(IdempotentSettings):
    """Wraps handler(message) so its effect happens once per message (see the module doc)."""

    async def __call__(self, message: Message) -> Any:
        key = self.marker_key(message)
        marker = "processing:" + secrets.token_hex(8)
        scripts = self._broker.scripts
        while (claimed := await scripts.run_operation(self.claim(key, marker))) is None:
            await asleep(self._wait_poll_s)
        if not claimed:
            self.skip(message)
            return None
        try:
            result = await acall_user(self._handler, self._coroutine, message)
        except BaseException:
            await scripts.execute(self.released(key, marker, message.topic))
            raise
        await scripts.execute(self.finished(key))
        self.ran += 1
        return result


def idempotent(
    broker: Broker, handler: Callable[[Message], Any], *, scope: str, **options: Any
) -> AsyncIdempotentHandler:
    """`IdempotentHandler(broker, handler, scope=...)`; scope is usually the group name."""
    return AsyncIdempotentHandler(broker, handler, scope=scope, **options)
