"""Searching a topic from the console over HTTP: by key, message id or time across every
partition, bounded (a limit, and the page says when it stopped there), values escaped."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from redisq.console import search  # noqa: E402
from redisq.model.offsets import offset_parts  # noqa: E402
from tests.console import test_http as shared  # noqa: E402
from tests.console.test_http import Client, running_console  # noqa: E402

local_broker = shared.local_broker  # the fixture, under the name the tests ask for


def offsets(page: str) -> list[str]:
    return re.findall(r'<article class="message [^"]*" data-offset="([^"]+)"', page)


def summary(page: str) -> str:
    found = re.search(r'<p id="search-summary"[^>]*>(.*?)</p>', page, re.S)
    assert found, "no search summary"
    return found.group(1)


def send_to_every_partition(broker: redisq.Broker, topic: str, key: str, partitions: int) -> list:
    """One message with `key` in each partition (explicit partitions: a custom partitioner)."""
    with broker.producer() as producer:
        return [producer.send(topic, f"v{p}", key=key, partition=p) for p in range(partitions)]


def test_key_is_found_in_every_partition(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=3)
    with local_broker.producer() as producer:
        for i in range(30):
            producer.send_async("orders", f"noise {i}", key=f"other-{i}")
        producer.flush()
    sent = send_to_every_partition(local_broker, "orders", "cust-1", 3)
    with running_console(local_broker) as base:
        client = Client(base)
        status, _, page = client.get("/topics/orders/search?by=key&q=cust-1")
        assert status == 200
        assert sorted(offsets(page)) == sorted(m.offset for m in sent)
        assert "complete" in summary(page) and "all 3 partitions" in summary(page)
        _, _, page = client.get("/topics/orders/search?by=key&q=cust-1&limit=2")
        assert len(offsets(page)) == 2
        assert "stopped at the limit of 2 messages" in summary(page)


@pytest.mark.parametrize("entry_format", ["batch", "message"])
def test_key_search_stops_at_the_scan_limit(local_broker: redisq.Broker, entry_format: str) -> None:
    """The scan limit counts entries read (a batch entry, one producer batch, is one): 20
    entries, 10 of each partition, do not reach the needle, under 15 or 45 newer entries."""
    local_broker.create_topic("orders", partitions=2, entry_format=entry_format)
    with local_broker.producer() as producer:
        producer.send("orders", "old", key="needle", partition=0)
        for i in range(30):  # 30 batches of 3 (a flush ends each)
            for j in range(3):
                producer.send_async("orders", f"noise {i}.{j}", key=f"hay-{i}", partition=i % 2)
            producer.flush()
    result = search.by_key(local_broker, "orders", b"needle", scan_limit=20)
    assert result.messages == [] and result.scanned == 20
    assert result.stopped == "the scan limit of 20 entries"
    assert [m.value for m in search.by_key(local_broker, "orders", b"needle").messages] == [b"old"]


def test_time_range_over_all_partitions(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("events", partitions=4)
    sent = send_to_every_partition(local_broker, "events", "k", 4)
    times = sorted(int(m.offset.split("-")[0]) for m in sent)
    with running_console(local_broker) as base:
        client = Client(base)
        at = f"/topics/events/search?by=time&since={times[0]}&until={times[-1]}"
        _, _, page = client.get(at)
        assert sorted(offsets(page)) == sorted(m.offset for m in sent)
        assert "complete" in summary(page)
        _, _, page = client.get(at + "&limit=3")
        assert len(offsets(page)) == 3 and "stopped at the limit of 3" in summary(page)
        in_time_order = sorted(sent, key=lambda m: (offset_parts(m.offset), m.partition))
        assert offsets(page) == [m.offset for m in in_time_order[:3]]
        _, _, page = client.get(f"/topics/events/search?by=time&since={times[-1] + 1}")
        assert offsets(page) == [] and "No message matches" in page
        status, _, page = client.get(
            f"/topics/events/search?by=time&since={times[-1]}&until={times[0] - 1}"
        )
        assert status == 400 and "before it starts" in page
        status, _, page = client.get("/topics/events/search?by=time&since=yesterday")
        assert status == 400 and "neither a date-time nor epoch milliseconds" in page
        status, _, page = client.get("/topics/events/search?by=key&q=k&limit=0")
        assert status == 400


def test_message_id_and_escaping(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("events", partitions=3)
    with local_broker.producer(idempotence="message_id") as producer:
        meta = producer.send(
            "events", b"<img src=x onerror=alert(1)>", key="<b>k</b>", message_id="id-7"
        )
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/events/search?by=id&q=id-7")
        assert offsets(page) == [meta.offset]
        assert "dedup window" in summary(page)
        assert "<img src=x" not in page and "&lt;img src=x" in page
        assert "<b>k</b>" not in page
        _, _, page = client.get("/topics/events/search?by=key&q=%3Cscript%3E")
        assert "<script>" not in page and 'value="&lt;script&gt;"' in page
        status, _, _ = client.get("/topics/nothing/search?by=key&q=x")
        assert status == 404
