"""`redisq demo` shows what it claims, on every server (issue 36.7): answers really lost make the
producer re-send, and the server answers the copies as duplicates (CLIENT KILL re-sent nothing
on Redis 7.0); the member killed in the consumer group is one of several holding partitions
(it held all 4 in 4 of 4 runs). The demo's steps 1 and 4 run as the demo runs them; the Spark
step is left out (tests/spark/test_jobs.py covers it)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from redisq.cli import demo
from redisq.cli.demo_proxy import AnswerLosingProxy


@pytest.fixture(params=["valkey", "redis"])
def demo_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A private valkey-server (temp dir), or the machine's Redis (REDIS_URL, else one on PATH);
    the demo works in a namespace of its own and removes it."""
    if request.param == "valkey":
        yield request.getfixturevalue("valkey_server").url
    else:
        yield request.getfixturevalue("redis_url")


def test_the_demo_shows_re_sends_deduplicated_and_a_kill_among_several_holders(
    demo_url: str, capsys: Any
) -> None:
    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    level = logging.getLogger("redisq").level
    logging.getLogger("redisq").setLevel(logging.ERROR)  # as run_demo: it counts the retries
    try:
        produced_ok, produced = demo.step_produce(demo_url, namespace, 5000, 50)
        consumed_ok = demo.step_consume(demo_url, namespace, produced["per_key"])
    finally:
        logging.getLogger("redisq").setLevel(level)
        demo._drop_namespace(demo_url, namespace)
    out = capsys.readouterr().out
    assert produced_ok and consumed_ok, out

    resent = re.search(
        r"(\d+) answers lost; (\d+) batches re-sent; ([\d,]+) re-sent messages "
        r"deduplicated",
        out,
    )
    assert resent is not None, out
    lost, batches, deduplicated = (int(g.replace(",", "")) for g in resent.groups())
    assert lost > 0 and batches > 0 and deduplicated > 0, out
    assert "shown: a lost answer makes the producer send again" in out
    assert "NOT SHOWN" not in out, out

    held = re.search(r"leases held at the kill +(.+)", out)
    assert held is not None, out
    holders = dict(part.split(": ") for part in held.group(1).strip().split("; "))
    assert len(holders) > 1 and "member-0" in holders, out
    assert re.search(r"shown: [23] members held partitions when member-0 was killed", out)
    assert "per-key order held and every message handled at least once" in out


def test_the_proxy_says_when_it_cannot_stand_in_front() -> None:
    proxy = AnswerLosingProxy("127.0.0.1", 6379, b"x")
    try:
        assert proxy.url_for("rediss://h:6380/0") is None
        assert proxy.url_for("unix:///tmp/redis.sock") is None
        assert proxy.url_for("redis://u:p@h:6380/2?protocol=3") == (
            f"redis://u:p@127.0.0.1:{proxy.port}/2?protocol=3"
        )
    finally:
        proxy.stop()
