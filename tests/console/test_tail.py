"""The console's live tail over HTTP: the page's cursor is every partition's last offset; each
poll answers what came after it, bounded, with the next cursor; a topic grown meanwhile is
tailed on its new partitions too; bad cursors and deleted topics are refused."""

from __future__ import annotations

import html
import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from redisq.console import tail  # noqa: E402
from tests.console import test_http as shared  # noqa: E402
from tests.console.test_http import Client, running_console  # noqa: E402

local_broker = shared.local_broker  # the fixture, under the name the tests ask for


def start_cursor(page: str) -> str:
    found = re.search(r'<section id="tail"[^>]*data-cursor="([^"]*)"', page)
    assert found, "no tail section"
    return html.unescape(found.group(1))


def poll(client: Client, topic: str, cursor: str) -> tuple[list[str], str, bool]:
    status, _, body = client.get(f"/topics/{topic}/tail/next?cursor={cursor}&fragment=batch")
    assert status == 200, body
    batch = re.search(r'class="tail-batch" data-cursor="([^"]*)" data-more="(\d)"', body)
    assert batch
    values = [html.unescape(v) for v in re.findall(r'<pre class="value">(.*?)</pre>', body, re.S)]
    return values, batch.group(1), batch.group(2) == "1"


def test_tail_shows_what_comes_after_the_page_opened(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=3)
    with local_broker.producer() as producer:
        producer.send("orders", "before", key="a")
        with running_console(local_broker) as base:
            client = Client(base)
            status, _, page = client.get("/topics/orders/tail")
            assert status == 200
            cursor = start_cursor(page)
            assert [p.split(":")[0] for p in cursor.split(",")] == ["0", "1", "2"]
            assert poll(client, "orders", cursor)[0] == []
            for i in range(5):
                producer.send("orders", f"<new {i}>", partition=i % 3)
            values, cursor, more = poll(client, "orders", cursor)
            assert sorted(values) == [f"<new {i}>" for i in range(5)] and not more
            assert poll(client, "orders", cursor)[0] == []  # nothing twice

            local_broker.add_partitions("orders", 4)
            with local_broker.producer() as fresh:  # metadata of 4 partitions
                fresh.send("orders", "on the new partition", partition=3)
            values, cursor, _ = poll(client, "orders", cursor)
            assert values == ["on the new partition"]
            assert cursor.split(",")[3].startswith("3:")


@pytest.mark.parametrize("entry_format", ["batch", "message"])
def test_a_poll_is_bounded(
    local_broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch, entry_format: str
) -> None:
    """At most MAX_PER_POLL messages a poll, whatever an entry holds (a batch entry here holds
    a producer batch of ~15), and the polls give every message once."""
    local_broker.create_topic("orders", partitions=2, entry_format=entry_format)
    cursor = tail.start_cursor(local_broker, "orders")
    with local_broker.producer() as producer:
        for i in range(30):
            producer.send_async("orders", f"m{i}", partition=i % 2)
        producer.flush()
    monkeypatch.setattr(tail, "MAX_PER_POLL", 10)
    seen: list[bytes] = []
    batches = 0
    while True:
        batch = tail.read_tail(local_broker, "orders", cursor)
        assert len(batch.messages) <= 10
        seen += [m.value for m in batch.messages if m.value is not None]
        cursor = batch.cursor
        batches += 1
        if not batch.more and not batch.messages:
            break
    assert sorted(seen) == sorted(f"m{i}".encode() for i in range(30)) and batches >= 3


def test_a_poll_stops_inside_a_batch_entry_and_the_next_goes_on_there(
    local_broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch entry holding more messages than a poll gives is given in parts, in order: the
    cursor the page carries names the last message given, inside the entry."""
    local_broker.create_topic("orders", partitions=1, entry_format="batch")
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/orders/tail")
        cursor = start_cursor(page)
        with local_broker.producer(linger_ms=1000) as producer:
            futures = [producer.send_async("orders", f"m{i}", partition=0) for i in range(25)]
            producer.flush()
        offsets = [f.result().offset for f in futures]
        # What the test is about: one entry holds the 25 messages.
        assert local_broker.client.xlen(local_broker.keys.log("orders", 0)) == 1
        monkeypatch.setattr(tail, "MAX_PER_POLL", 10)
        values, cursor, more = poll(client, "orders", cursor)
        assert values == [f"m{i}" for i in range(10)] and more
        assert cursor == f"0:{offsets[9]}~"  # the last message given, inside its entry
        values, cursor, more = poll(client, "orders", cursor)
        assert values == [f"m{i}" for i in range(10, 20)] and more
        with local_broker.producer() as producer:
            producer.send("orders", "later", partition=0)
        values, cursor, more = poll(client, "orders", cursor)
        assert values == [f"m{i}" for i in range(20, 25)] + ["later"] and not more
        assert poll(client, "orders", cursor)[0] == []  # nothing twice


def test_bad_cursor_and_deleted_topic_are_refused(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=2)
    with running_console(local_broker) as base:
        client = Client(base)
        for cursor in ("0:nope", "7:1-0", "x:1-0", "0:1-0<script>", "0:~", "0:1-0~~"):
            status, _, body = client.get(f"/topics/orders/tail/next?cursor={cursor}&fragment=b")
            assert status == 400 and body.startswith('<p class="error"') and "<script>" not in body
        local_broker.delete_topic("orders")
        status, _, body = client.get("/topics/orders/tail/next?cursor=0:1-0&fragment=batch")
        assert status == 404 and "does not exist" in body
