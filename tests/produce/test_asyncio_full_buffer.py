"""A full buffer refuses the asyncio producer's send_async() at once (the thread API's waits
for room up to max_block_ms instead, so this behaviour is the asyncio API's alone): every
message it accepted is delivered, and send() waits for room. Each backend.
"""

from __future__ import annotations

import asyncio

import pytest

import redisq
import redisq.asyncio as rq
from tests.aio import Env, aio


@pytest.mark.parametrize("loaded", [True, False], ids=["topic-loaded", "first-use"])
@aio
async def test_full_buffer_refuses_send_async_at_once_and_send_waits(
    env: Env, loaded: bool
) -> None:
    """max_buffered_messages waiting: send_async() raises at once (whether or not the topic's
    metadata is loaded yet), so every message it accepted is delivered; send() waits for room."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        async with broker.producer(max_buffered_messages=10, linger_ms=300) as producer:
            if loaded:
                await producer.send("t", b"warm-up")
            accepted: list[asyncio.Future[rq.RecordMetadata]] = []
            refused = 0
            for i in range(15):
                try:
                    accepted.append(producer.send_async("t", b"%d" % i))
                except redisq.RedisqError as exc:
                    assert "buffer full" in str(exc)
                    refused += 1
            waited = await producer.send("t", b"waited")
            await producer.flush()
        failures = [f.exception() for f in accepted if f.exception() is not None]
        stored = [m.value async for m in broker.read("t", 0)]
    assert failures == [], f"{len(failures)} accepted messages failed: {failures[:1]}"
    assert (len(accepted), refused) == (10, 5)
    assert stored[-1] == b"waited" and not waited.duplicate
    assert [v for v in stored if v not in (b"warm-up", b"waited")] == [b"%d" % i for i in range(10)]
