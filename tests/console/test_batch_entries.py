"""The console on a batch topic (DESIGN §14): one stream entry per producer batch, message i of an
entry at offset ms-(s+i). What a user sees: every message of every batch as its own row at its
own offset, pages that count messages (not entries), an offset inside an entry found, searches
and the live tail giving every message, lengths labelled as entries, lags in messages.

Over HTTP against the session's real server, as tests/console/test_http.py does."""

from __future__ import annotations

import html
import re
from urllib.parse import quote, unquote

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from tests.console import test_http as shared  # noqa: E402
from tests.console.test_http import Client, cells, notice_of, running_console  # noqa: E402
from tests.console.test_tail import poll, start_cursor  # noqa: E402

local_broker = shared.local_broker  # the fixture, under the name the tests ask for

BATCHES, SIZE = 3, 5


def produce_batches(
    broker: redisq.Broker, topic: str, batches: int = BATCHES, size: int = SIZE, **send: object
) -> list[tuple[str, str]]:
    """`batches` producer batches of `size` messages to partition 0 (a flush after each, so
    each is one entry); (offset, value) of every message in order."""
    sent = []
    with broker.producer(linger_ms=1000) as producer:
        for j in range(batches):
            futures = [
                (
                    f"b{j}-m{i}",
                    producer.send_async(topic, f"b{j}-m{i}", key=f"k{i}", partition=0, **send),  # type: ignore[arg-type]
                )
                for i in range(size)
            ]
            producer.flush()
            sent += [(future.result().offset, value) for value, future in futures]
    return sent


@pytest.fixture
def batch_topic(local_broker: redisq.Broker) -> list[tuple[str, str]]:
    local_broker.create_topic("bt", partitions=1, entry_format="batch")
    sent = produce_batches(local_broker, "bt")
    # What the test is about: three entries hold the fifteen messages, at consecutive offsets.
    assert local_broker.client.xlen(local_broker.keys.log("bt", 0)) == BATCHES
    ms, seq = sent[SIZE + 2][0].split("-")
    assert sent[SIZE + 1][0] == f"{ms}-{int(seq) - 1}"
    return sent


def shown(page: str) -> list[tuple[str, str]]:
    """(offset, value) of each message on a page, in order."""
    offsets = re.findall(r'<article class="message [^"]*" data-offset="([^"]+)"', page)
    values = [html.unescape(v) for v in re.findall(r'<pre class="value">(.*?)</pre>', page, re.S)]
    assert len(offsets) == len(values), page
    return list(zip(offsets, values, strict=True))


def pager(page: str, name: str) -> str:
    """The bound the page's "older" (end) or "newer" (start) link carries."""
    links = re.search(r'<p class="pager">(.*?)</p>', page, re.S)
    assert links, "no pager"
    found = re.search(rf'href="\?partition=0&(?:amp;)?{name}=([^&"]+)&', links.group(1))
    assert found, f"no {name} link"
    return unquote(html.unescape(found.group(1)))


def test_pages_show_every_message_and_count_messages(
    local_broker: redisq.Broker, batch_topic: list[tuple[str, str]]
) -> None:
    sent = batch_topic
    with running_console(local_broker) as base:
        client = Client(base)
        at = "/topics/bt/messages?partition=0"
        _, _, page = client.get(f"{at}&start=0&count=100")
        assert shown(page) == sent  # each message of each batch, at its own offset
        # Pages of 4 messages from the start: the second crosses the first entry's end.
        _, _, page = client.get(f"{at}&start=0&count=4")
        assert shown(page) == sent[:4]
        _, _, page = client.get(f"{at}&start={quote(pager(page, 'start'))}&count=4")
        assert shown(page) == sent[4:8]
        _, _, page = client.get(f"{at}&start={quote(pager(page, 'start'))}&count=4")
        assert shown(page) == sent[8:12]
        # The newest page, then older pages from it, each of 4 messages.
        _, _, page = client.get(f"{at}&count=4")
        assert shown(page) == sent[-4:]
        _, _, page = client.get(f"{at}&end={quote(pager(page, 'end'))}&count=4")
        assert shown(page) == sent[7:11]
        _, _, page = client.get(f"{at}&end={quote(pager(page, 'end'))}&count=4")
        assert shown(page) == sent[3:7]
        # By time: every message of the batches in the range.
        first_ms, last_ms = sent[0][0].split("-")[0], sent[-1][0].split("-")[0]
        _, _, page = client.get(f"{at}&since={first_ms}&until={last_ms}&count=100")
        assert shown(page) == sent


def test_an_offset_inside_an_entry_is_found(
    local_broker: redisq.Broker, batch_topic: list[tuple[str, str]]
) -> None:
    sent = batch_topic
    middle = sent[SIZE + 2][0]  # the third message of the second batch
    with running_console(local_broker) as base:
        client = Client(base)
        at = "/topics/bt/messages?partition=0"
        _, _, page = client.get(f"{at}&start={middle}&end={middle}")
        assert shown(page) == [sent[SIZE + 2]]
        _, _, page = client.get(f"{at}&start={middle}&count=4")
        assert shown(page) == sent[SIZE + 2 : SIZE + 6]
        _, _, page = client.get(f"{at}&start=({quote(middle)}&count=2")
        assert shown(page) == sent[SIZE + 3 : SIZE + 5]
        _, _, page = client.get(f"{at}&end={middle}&count=3")
        assert shown(page) == sent[SIZE : SIZE + 3]
        _, _, page = client.get(f"{at}&end=({quote(middle)}&count=3")
        assert shown(page) == sent[SIZE - 1 : SIZE + 2]
        # A hole past the last message of an entry is no message.
        last_ms, last_seq = sent[-1][0].split("-")
        _, _, page = client.get(f"{at}&start={last_ms}-{int(last_seq) + 1}&end={last_ms}-99")
        assert shown(page) == []


def test_find_by_key_and_by_message_id_inside_batches(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("bt", partitions=1, entry_format="batch")
    sent = produce_batches(local_broker, "bt")
    with local_broker.producer(idempotence="message_id", linger_ms=1000) as producer:
        futures = [
            producer.send_async("bt", f"id-value-{i}", message_id=f"id-{i}", partition=0)
            for i in range(SIZE)
        ]
        producer.flush()
        by_id = [f.result().offset for f in futures]
    with local_broker.producer(linger_ms=1000) as producer:
        futures = [
            producer.send_async("bt", f"same-{i}", key="same", partition=0) for i in range(SIZE)
        ]
        producer.flush()
        same = [(f.result().offset, f"same-{i}") for i, f in enumerate(futures)]
    assert local_broker.client.xlen(local_broker.keys.log("bt", 0)) == BATCHES + 2
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/bt/messages?message_id=id-3")
        assert shown(page) == [(by_id[3], "id-value-3")]
        assert "dedup window (id -&gt; offset)" in page  # looked up inside its entry, no scan
        # The newest two messages of a key, both in the last entry.
        _, _, page = client.get("/topics/bt/messages?key=same&key_partition=0&count=2")
        assert shown(page) == same[-2:]
        _, _, page = client.get("/topics/bt/messages?key=k3&key_partition=0")
        assert shown(page) == [sent[3], sent[SIZE + 3], sent[2 * SIZE + 3]]
        _, _, page = client.get("/topics/bt/messages?key=k3&key_partition=0&count=2")
        assert shown(page) == [sent[SIZE + 3], sent[2 * SIZE + 3]]  # the newest two
        # The search page: every partition, by key, by id, by time.
        _, _, page = client.get("/topics/bt/search?by=key&q=k2")
        assert shown(page) == [sent[2 * SIZE + 2], sent[SIZE + 2], sent[2]]  # newest first
        _, _, page = client.get("/topics/bt/search?by=id&q=id-1")
        assert shown(page) == [(by_id[1], "id-value-1")]
        first_ms = sent[0][0].split("-")[0]
        _, _, page = client.get(f"/topics/bt/search?by=time&since={first_ms}&limit=500")
        assert shown(page) == sent + [(o, f"id-value-{i}") for i, o in enumerate(by_id)] + same
        _, _, page = client.get(f"/topics/bt/search?by=time&since={first_ms}&limit=7")
        assert shown(page) == sent[:7]
        assert "limit of 7 messages" in page


def test_tail_shows_every_message_of_new_batches(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("bt", partitions=2, entry_format="batch")
    produce_batches(local_broker, "bt", batches=1)  # before the page opened: not shown
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/bt/tail")
        cursor = start_cursor(page)
        assert poll(client, "bt", cursor)[0] == []
        sent = produce_batches(local_broker, "bt", batches=2)
        values, cursor, _ = poll(client, "bt", cursor)
        assert values == [value for _, value in sent]
        assert poll(client, "bt", cursor)[0] == []  # nothing twice
        more = produce_batches(local_broker, "bt", batches=1)
        assert poll(client, "bt", cursor)[0] == [value for _, value in more]


def test_topic_pages_name_the_format_and_count_entries(
    local_broker: redisq.Broker, batch_topic: list[tuple[str, str]]
) -> None:
    local_broker.create_topic("plain", partitions=1, entry_format="message")  # the other one
    for topic in ("bt", "plain"):
        with local_broker.consumer(topic, "billing", start="earliest") as consumer:
            consumer.poll(timeout=0.2)  # the group exists; it reads nothing after this
        local_broker.reset_offsets(topic, "billing", to_earliest=True)
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/bt")
        # lags count messages, from the partitions' counters (DESIGN §14.6); lengths, entries
        assert cells(page, "topic-groups")[0][3] == str(BATCHES * SIZE)  # the lag
        assert re.search(r'<dd id="entry-format">batch\b', page)
        assert '<th class="n">Entries</th>' in page
        # entries, then the messages they hold (the partition's counters, DESIGN §14.6)
        assert [r[1:3] for r in cells(page, "partitions-table")] == [[str(BATCHES), "15"]]
        assert re.search(rf'id="topic-messages">{BATCHES * SIZE}</td>', page)
        _, _, page = client.get("/topics/plain")
        assert re.search(r'<dd id="entry-format">message</dd>', page)
        assert '<th class="n">Messages</th>' in page
        _, _, page = client.get("/")
        rows = {r[0]: r for r in cells(page, "topics-table")}
        # the overview counts messages (held, then appended); the entries are named beside
        assert rows["bt"][2:4] == [str(BATCHES * SIZE)] * 2
        assert f'title="in {BATCHES} stream entries (one per producer batch)"' in page
        assert rows["plain"][2:4] == ["0", "0"]
        lags = {r[0]: r[5] for r in cells(page, "groups-table")}
        assert lags == {"bt": str(BATCHES * SIZE), "plain": "0"}
        _, _, page = client.get("/topics/bt/groups/billing")
        assert re.search(rf'id="total-lag">{BATCHES * SIZE}</b> messages', page)
        assert '<th class="n">Entries</th>' in page and '<th class="n">Lag</th>' in page


def test_create_form_chooses_the_entry_format(local_broker: redisq.Broker) -> None:
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/")
        select = re.search(r'<select name="entry_format"[^>]*>(.*?)</select>', page, re.S)
        assert select
        # The default first and chosen, named for what it gives (batch entries: DESIGN §14.13)
        options = re.findall(r'<option value="([^"]*)"( selected)?>([^<]*)</option>', select[1])
        assert options == [
            ("", " selected", "default (batch)"),
            ("message", "", "message"),
            ("batch", "", "batch"),
        ]
        form = {"name": "plain", "partitions": "2", "entry_format": "message"}
        status, headers, _ = client.post("/topics/create", {**form, "csrf": client.csrf("/")})
        assert status == 303
        assert notice_of(client, headers["location"]) == (
            "ok: Created topic &#39;plain&#39; with 2 partitions (message entries)"
        )
        assert local_broker.topic_config("plain", refresh=True).entry_format == "message"
        form = {"name": "fast", "entry_format": "batch"}
        _, headers, _ = client.post("/topics/create", {**form, "csrf": client.csrf("/")})
        assert local_broker.topic_config("fast", refresh=True).entry_format == "batch"
        form = {"name": "chosen", "entry_format": ""}  # the form's default, as a browser sends it
        _, headers, _ = client.post("/topics/create", {**form, "csrf": client.csrf("/")})
        assert notice_of(client, headers["location"]) == (
            "ok: Created topic &#39;chosen&#39; with 1 partition (batch entries)"
        )
        assert local_broker.topic_config("chosen", refresh=True).entry_format == "batch"
        form = {"name": "odd", "entry_format": "columns"}
        _, headers, _ = client.post("/topics/create", {**form, "csrf": client.csrf("/")})
        assert "Entry format: &#39;columns&#39; is not one of message, batch" in notice_of(
            client, headers["location"]
        )
        assert "odd" not in local_broker.list_topics()


def test_a_tail_poll_reads_few_batches_and_says_more(
    local_broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll of a batch topic reads a few entries per partition (each may hold a big batch),
    says there is more, and the next polls give the rest, every message once, in order."""
    from redisq.console import tail

    local_broker.create_topic("bt", partitions=1, entry_format="batch")
    cursor = tail.start_cursor(local_broker, "bt")
    sent = produce_batches(local_broker, "bt", batches=4)
    monkeypatch.setattr(tail, "BATCH_TOPIC_READ", 1)
    seen: list[tuple[str, str]] = []
    for _ in range(4):
        batch = tail.read_tail(local_broker, "bt", cursor)
        assert len(batch.messages) == SIZE and batch.more
        seen += [(m.offset, (m.value or b"").decode()) for m in batch.messages]
        cursor = batch.cursor
    assert seen == sent
    batch = tail.read_tail(local_broker, "bt", cursor)
    assert batch.messages == [] and not batch.more
