"""The console's chart history: kept in Redis (a sorted set per series in the namespace,
trimmed to its newest points, expiring), so the charts survive a console restart; a read-only
console writes none; time without samples is never drawn as a line (throughput is a step per
interval, a silent one is a flat zero, and missing samples break the line)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from redisq.console.charts import line_chart, sparkline  # noqa: E402
from redisq.console.history import ChartStore, History  # noqa: E402
from tests.console import test_http as shared  # noqa: E402
from tests.console.test_http import Client, running_console  # noqa: E402

local_broker = shared.local_broker  # the fixture, under the name the tests ask for


def snapshot(
    at_s: float, added: dict[str, int], lags: dict[tuple[str, str], list] | None = None
) -> Any:
    """What History.record reads of a namespace snapshot: each topic's messages ever appended
    (TopicSnapshot.appended, messages on either entry format), each group's lag."""
    topics = {name: SimpleNamespace(appended=n) for name, n in added.items()}
    groups = {
        ref: SimpleNamespace(
            partitions=[SimpleNamespace(partition=p, lag=lag) for p, lag in enumerate(values)]
        )
        for ref, values in (lags or {}).items()
    }
    return SimpleNamespace(now_ms=int(at_s * 1000), topics=topics, groups=groups)


def test_silent_seconds_are_zero_and_missing_samples_break_the_line() -> None:
    history = History(interval_s=1.0)
    for at, count in ((0, 0), (1, 10), (2, 10), (3, 10), (4, 20)):
        history.record(snapshot(1000 + at, {"orders": count}))
    steps = history.throughput("orders")
    assert [(t - 1000, v) for t, v in steps] == [
        (0, 10), (1, 10), (1, 0), (2, 0), (2, 0), (3, 0), (3, 10), (4, 10),
    ]  # fmt: skip
    history.record(snapshot(1010, {"orders": 20}))  # 6 s without samples, nothing appended
    history.record(snapshot(1020, {"orders": 50}))  # 10 s without samples, 30 appended
    history.record(snapshot(1021, {"orders": 53}))
    tail = [(t - 1000, v) for t, v in history.throughput("orders")[8:]]
    assert tail == [(4, 0), (10, 0), (10, None), (20, 3), (21, 3)]
    assert history.current_rate("orders") == 3
    chart = str(line_chart({"messages/s": history.throughput("orders")}, title="T", unit="m/s"))
    assert chart.count("<polyline") == 2  # no line across the 10 s nobody saw
    assert str(sparkline(history.throughput("orders"))).count("<polyline") == 2

    history.record(snapshot(1000, {}, {("orders", "billing"): [5, None]}))
    history.record(snapshot(1001, {}, {("orders", "billing"): [3, 1]}))
    history.record(snapshot(1009, {}, {("orders", "billing"): [0, 0]}))
    lag = history.lag("orders", "billing")
    assert lag["total"] == [(1001, 4.0), (1001, None), (1009, 0.0)]
    assert lag["p0"] == [(1000, 5.0), (1001, 3.0), (1001, None), (1009, 0.0)]


def test_stored_series_are_bounded_and_expire(local_broker: redisq.Broker) -> None:
    history = History(store=ChartStore(local_broker, write=True, max_points=5), interval_s=1)
    for i in range(12):
        history.record(snapshot(2000 + i, {"orders": i * 3}, {("orders", "g"): [i]}))
    client, keys = local_broker.client, local_broker.keys
    for series in ("added:orders", "lag:orders:g"):
        assert client.zcard(keys.console_series(series)) == 5
        assert 0 < client.pttl(keys.console_series(series)) <= 7 * 24 * 3600 * 1000
    again = History(store=ChartStore(local_broker, write=False, max_points=5), interval_s=1)
    again.record(snapshot(2012, {"orders": 36}, {("orders", "g"): [12]}))
    assert [t for t, _ in again.throughput("orders")][::2] == [2007, 2008, 2009, 2010, 2011]
    assert again.lag("orders", "g")["p0"][-2:] == [(2011, 11.0), (2012, 12.0)]
    assert client.zcard(keys.console_series("added:orders")) == 5  # read-only: nothing written


def chart_of(page: str) -> str:
    found = re.search(r'<div class="chart-box">(.*?)</div>', page, re.S)
    assert found, "no chart box"
    return found.group(1)


def test_charts_survive_a_console_restart(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=2)
    with local_broker.consumer("orders", group="billing") as consumer:
        consumer.poll(timeout=0.2)
    key = local_broker.keys.console_series("added:orders")
    with running_console(local_broker, sample_interval_s=0.2) as base, local_broker.producer() as p:
        deadline = time.monotonic() + 20
        while local_broker.client.zcard(key) < 4:
            p.send("orders", b"x")
            assert time.monotonic() < deadline, "no samples stored"
            time.sleep(0.1)
        assert "<polyline" in chart_of(Client(base).get("/topics/orders")[2])
    stored = local_broker.client.zcard(key)
    # A new console samples once at its start (then not for an hour): its charts come from
    # what the first one stored.
    with running_console(local_broker, sample_interval_s=3600) as base:
        client = Client(base)
        deadline = time.monotonic() + 10
        while local_broker.client.zcard(key) == stored:
            assert time.monotonic() < deadline, "the new console did not sample"
            time.sleep(0.05)
        _, _, page = client.get("/topics/orders")
        assert "<polyline" in chart_of(page)
        _, _, page = client.get("/topics/orders/groups/billing")
        assert "<polyline" in chart_of(page)
        _, _, page = client.get("/")
        row = re.search(r'<tr data-topic="orders">.*?</tr>', page, re.S)
        assert row and '<svg class="spark"' in row.group(0)


def test_a_read_only_console_writes_no_history(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders")
    with running_console(local_broker, read_only=True, sample_interval_s=0.1) as base:
        Client(base).get("/")
        time.sleep(0.6)
    pattern = local_broker.keys.console_series("*")
    assert list(local_broker.client.scan_iter(match=pattern)) == []
