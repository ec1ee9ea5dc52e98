"""The asyncio producer's close() on a silent server (SIGSTOP), and close() itself cancelled:
every send's future is settled (ProducerClosed), no task is left running, a later send_async is
refused. Cancellation of an awaited close() is the asyncio API's alone; the uncancelled close is
its control here (the thread API's close on a silent server: tests/produce/test_silent_server.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

import redisq
import redisq.asyncio as rq
from tests.servers import ServerProcess, binary_for

TOPIC = "orders"


@pytest.fixture
def fault_namespace() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


@pytest.mark.fault
@pytest.mark.parametrize("cancelled", [False, True], ids=["close", "close-cancelled"])
@pytest.mark.parametrize("delay_ms", [None, 60_000], ids=["plain", "delayed"])
def test_close_on_a_silent_server_settles_every_future(
    delay_ms: int | None, cancelled: bool, fault_namespace: str
) -> None:
    """The server SIGSTOPped while a send is on its way: close(timeout=0.5) returns (its
    flush gives up with TimeoutError; the sender gets 5 s, then is stopped) and the send's
    future fails with ProducerClosed (its batch may or may not be stored) instead of staying
    pending for ever; a delayed send too. close-cancelled: the close() itself is cancelled
    within those 5 s (wait_for of 1.5 s): the sender is stopped all the same, no task is left
    running and the future fails."""
    server = ServerProcess(binary_for("redis")).start()
    stopped = False

    async def scenario() -> None:
        nonlocal stopped
        broker = await rq.connect(server.url, namespace=fault_namespace)
        try:
            await broker.create_topic(TOPIC, partitions=1)
            producer = broker.producer(delivery_timeout_ms=60_000)
            await producer.send(TOPIC, b"warm-up", delay_ms=delay_ms)
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
            future = producer.send_async(TOPIC, b"x", delay_ms=delay_ms)
            await asyncio.sleep(0.2)  # linger is over: the batch is sent, no answer comes
            if cancelled:
                with pytest.raises(TimeoutError):  # close() cancelled in the sender's grace
                    await asyncio.wait_for(producer.close(timeout=0.5), 1.5)
                others = asyncio.all_tasks() - {asyncio.current_task()}
                done, running = await asyncio.wait(others, timeout=3) if others else ((), ())
                assert not running, f"tasks left running: {running}"
            else:
                with pytest.raises(TimeoutError, match="unacknowledged"):  # the flush gave up
                    await asyncio.wait_for(producer.close(timeout=0.5), 30)  # it returns
            assert future.done(), "a send's future left pending after close()"
            assert isinstance(future.exception(), redisq.ProducerClosed)
            with pytest.raises(redisq.ProducerClosed, match="send after close"):
                producer.send_async(TOPIC, b"y")
        finally:
            if stopped:
                os.kill(server.pid, signal.SIGCONT)
                stopped = False
            await broker.close()

    try:
        asyncio.run(scenario())
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
