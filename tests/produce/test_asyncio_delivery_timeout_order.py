"""The asyncio producer while its server is stopped (SIGSTOP): send() fails with DeliveryTimeout
within about delivery_timeout_ms, with fresh or stale topic metadata; the sends queued meanwhile
fail likewise; after SIGCONT sending goes on and each key keeps its send order. (The thread API's
sends after a delivery timeout: tests/produce/test_silent_server.py; this scenario is not yet
written once for both APIs.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from tests.servers import ServerProcess, binary_for

TOPIC = "orders"


@pytest.fixture
def fault_namespace() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["valkey", "redis"])
@pytest.mark.parametrize("stale_metadata", [False, True], ids=["fresh-metadata", "stale-metadata"])
def test_delivery_timeout_while_the_server_is_stopped(
    kind: str, stale_metadata: bool, fault_namespace: str
) -> None:
    """SIGSTOP: send() fails with DeliveryTimeout within about delivery_timeout_ms, whether or
    not the topic's metadata is due to be read again (metadata_max_age_ms past); after SIGCONT
    a new send works, and each key's messages are in send order in the log (the timed-out one
    stored before the later ones, or not at all)."""
    server = ServerProcess(binary_for(kind)).start()
    stopped = False

    async def scenario() -> None:
        nonlocal stopped
        async with await rq.connect(server.url, namespace=fault_namespace) as broker:
            await broker.create_topic(TOPIC, partitions=2)
            async with broker.producer(
                delivery_timeout_ms=1500,
                metadata_max_age_ms=200 if stale_metadata else 600_000,
                retry_backoff_ms=10,
            ) as producer:
                before = await producer.send(TOPIC, b"before", key="k")
                early = [producer.send_async(TOPIC, f"e{i}", key="other") for i in range(20)]
                await producer.flush()
                if stale_metadata:
                    await asyncio.sleep(0.25)  # metadata_max_age_ms has passed
                os.kill(server.pid, signal.SIGSTOP)
                stopped = True
                started = time.monotonic()
                pending = [producer.send_async(TOPIC, f"p{i}", key="other") for i in range(5)]
                timed_out: BaseException | None = None
                try:
                    await asyncio.wait_for(producer.send(TOPIC, b"during", key="k"), 4.5)
                except redisq.DeliveryTimeout as exc:
                    timed_out = exc
                except TimeoutError:
                    pass
                finally:
                    elapsed = time.monotonic() - started
                    os.kill(server.pid, signal.SIGCONT)
                    stopped = False
                assert timed_out is not None, (
                    f"send() did not fail with DeliveryTimeout within {elapsed:.1f} s of SIGSTOP "
                    "(delivery_timeout_ms=1500)"
                )
                assert 1.0 <= elapsed <= 4.0, f"DeliveryTimeout after {elapsed:.2f} s"
                for future in pending:
                    assert isinstance(await _exception(future), redisq.DeliveryTimeout)
                after = await producer.send(TOPIC, b"after", key="k")
                assert after.partition == before.partition and not after.duplicate
                also = await producer.send(TOPIC, b"after-other", key="other")
            assert all(f.exception() is None for f in early)
            mine = [m async for m in broker.read(TOPIC, before.partition)]
            values_k = [m.value for m in mine if m.key == b"k"]
            assert values_k in ([b"before", b"after"], [b"before", b"during", b"after"])
            theirs = [m async for m in broker.read(TOPIC, also.partition)]
            others = [m.value for m in theirs if m.key == b"other"]
            assert others[:20] == [f"e{i}".encode() for i in range(20)]
            assert others[-1] == b"after-other"
            stored_pending = others[20:-1]
            assert stored_pending == [f"p{i}".encode() for i in range(len(stored_pending))]
            # The error tells what happened during the stop, not what went wrong before it.
            assert "NOSCRIPT" not in str(timed_out), str(timed_out)

    try:
        asyncio.run(scenario())
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


async def _exception(future: asyncio.Future[Any]) -> BaseException | None:
    try:
        await asyncio.wait_for(asyncio.shield(future), 10)
    except Exception as exc:
        return exc
    return None
