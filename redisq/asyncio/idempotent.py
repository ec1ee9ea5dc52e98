"""The asyncio consumer's idempotent handler: redisq.idempotent's markers and Redis steps, run
by the asyncio executor; a plain handler function runs in a worker thread (as run() does)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from redisq.asyncio.client import run_operation
from redisq.asyncio.worker import is_async_handler
from redisq.idempotent import IdempotentSettings
from redisq.records import Message


class AsyncIdempotentHandler(IdempotentSettings):
    """Wraps handler(message) (a coroutine function or a plain one) so its effect happens once
    per message: see redisq.idempotent.IdempotentHandler."""

    async def __call__(self, message: Message) -> Any:
        key = self.marker_key(message)
        marker = "processing:" + secrets.token_hex(8)
        scripts = self._broker.scripts
        while (claimed := await run_operation(self.claim(key, marker), scripts)) is None:
            await asyncio.sleep(self._wait_poll_s)
        if not claimed:
            self.skip(message)
            return None
        try:
            if is_async_handler(self._handler):
                result = await self._handler(message)
            else:
                result = await asyncio.to_thread(self._handler, message)
        except BaseException:
            await scripts.execute(self.released(key, marker, message.topic))
            raise
        await scripts.execute(self.finished(key))
        self.ran += 1
        return result
