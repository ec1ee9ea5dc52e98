"""What a handler's exception says reaches the consumer's log lines (attempt failed, dead-
lettered) escaped: a newline or a terminal escape in it cannot forge a log line of its own or
clear the operator's screen. One test through both APIs (the `api` fixture), every backend."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import redisq
from redisq.errors import log_text
from tests.apis import coroutine_on_asyncio

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
    api: Any, broker: redisq.Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """On the asyncio API the failing handler is a coroutine function awaited on the loop."""
    broker.create_topic("orders", partitions=1)
    with api.broker.producer() as producer:
        producer.send("orders", b"v", key="k")
    with caplog.at_level(logging.WARNING, logger="redisq"):
        with api.broker.consumer("orders", "g", **OPTIONS) as consumer:
            consumer.run(coroutine_on_asyncio(api, fail), idle_timeout=1.0)
    check(caplog)


def test_log_text_keeps_printable_text_and_cuts_long_text() -> None:
    assert log_text("naïve café: 3 €") == "naïve café: 3 €"
    assert log_text("x" * 600) == "x" * 500 + "..."
    assert log_text(ValueError("a\tb\r\nc")) == "a\\tb\\r\\nc"
