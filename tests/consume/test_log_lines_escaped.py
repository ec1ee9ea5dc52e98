"""What a handler's exception says reaches the consumer's log lines (attempt failed, dead-
lettered) escaped: a newline or a terminal escape in it cannot forge a log line of its own or
clear the operator's screen. Both APIs, every backend."""

from __future__ import annotations

import logging

import pytest

import redisq
import redisq.asyncio as rq
from redisq.errors import log_text
from tests.aio import aio

FORGED = "bad order\nredisq.consumer: all good\x1b[2J"
OPTIONS = {"max_attempts": 2, "retry_backoff_ms": 1, "failure_policy": "dead_letter"}


def fail(message: redisq.Message) -> None:
    raise ValueError(FORGED)


def check(caplog: pytest.LogCaptureFixture) -> None:
    lines = [r.getMessage() for r in caplog.records if FORGED.split("\n")[0] in r.getMessage()]
    assert len(lines) >= 3, lines  # two failed attempts and the dead letter
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, line
        assert "bad order\\nredisq.consumer: all good\\x1b[2J" in line


def test_a_handlers_error_text_is_escaped_in_log_lines(
    broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", b"v", key="k")
    with caplog.at_level(logging.WARNING, logger="redisq"):
        with broker.consumer("orders", "g", **OPTIONS) as consumer:
            consumer.run(fail, idle_timeout=1.0)
    check(caplog)


@aio
async def test_a_handlers_error_text_is_escaped_in_log_lines_asyncio(
    server_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with await rq.connect(server_url, namespace=namespace) as broker:
        await broker.create_topic("orders", partitions=1)
        producer = broker.producer()
        await producer.start()
        await producer.send("orders", b"v", key="k")
        await producer.close()
        with caplog.at_level(logging.WARNING, logger="redisq"):
            async with broker.consumer("orders", "g", **OPTIONS) as consumer:
                await consumer.run(fail, idle_timeout=1.0)
    check(caplog)


def test_log_text_keeps_printable_text_and_cuts_long_text() -> None:
    assert log_text("naïve café: 3 €") == "naïve café: 3 €"
    assert log_text("x" * 600) == "x" * 500 + "..."
    assert log_text(ValueError("a\tb\r\nc")) == "a\\tb\\r\\nc"
