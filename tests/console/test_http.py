"""The console over HTTP (no browser): what its pages say, the guard (auth, CSRF, read-only),
errors as pages, and reads that cost a fixed number of round trips whatever the size.

Every test serves the real ASGI app with uvicorn on a free loopback port and talks to it with
http.client, against a real server (the session's valkey-server).
"""

from __future__ import annotations

import base64
import html
import http.client
import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402

import redisq  # noqa: E402
from redisq.console import check_exposure, create_app, is_loopback  # noqa: E402
from redisq.errors import InvalidConfig  # noqa: E402
from redisq.protocol import run_operation  # noqa: E402
from redisq.protocol.overview import namespace_snapshot  # noqa: E402
from tests.conftest import drop_namespace  # noqa: E402
from tests.servers import ServerProcess, free_port  # noqa: E402


# -- helpers (the browser tests use them too) ----------------------------------------------------
@contextmanager
def running_console(broker: redisq.Broker, **options: Any) -> Iterator[str]:
    """The console app served by uvicorn in a thread; yields its base url."""
    options.setdefault("sample_interval_s", 0.3)
    app = create_app(broker, **options)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the console did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


class Client:
    """A tiny HTTP client that keeps cookies and never follows redirects."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.cookies: dict[str, str] = {}

    def request(
        self,
        method: str,
        path: str,
        form: dict[str, str] | list[tuple[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], str]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        sent = dict(headers or {})
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form)
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        text = response.read().decode()
        got = {k.lower(): v for k, v in response.getheaders()}
        for name, value in response.getheaders():
            if name.lower() == "set-cookie":
                cookie = value.split(";", 1)[0]
                key, _, val = cookie.partition("=")
                self.cookies[key] = val
        conn.close()
        return response.status, got, text

    def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], str]:
        return self.request("GET", path, **kw)

    def csrf(self, path: str) -> str:
        status, _, page = self.get(path)
        assert status == 200, page
        found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert found, "no CSRF field on " + path
        return found.group(1)

    def post(self, path: str, form: dict[str, str] | list[tuple[str, str]], **kw: Any) -> Any:
        return self.request("POST", path, form=form, **kw)


def notice_of(client: Client, location: str) -> str:
    status, _, page = client.get(location)
    assert status == 200, page
    found = re.search(r'<div class="notice (\w+)"[^>]*>(.*?)</div>', page, re.S)
    assert found, "no notice on " + location
    return f"{found.group(1)}: {found.group(2)}"


def cells(page: str, table_id: str) -> list[list[str]]:
    """The text of each cell of each body row of a table, as a browser shows it."""
    table = re.search(rf'<table[^>]*id="{table_id}".*?<tbody>(.*?)</tbody>', page, re.S)
    assert table, f"no table {table_id}"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)
    return [
        [
            html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        ]
        for row in rows
    ]


def heads(page: str, table_id: str) -> list[str]:
    """The text of each header cell of a table."""
    table = re.search(rf'<table[^>]*id="{table_id}".*?<thead>(.*?)</thead>', page, re.S)
    assert table, f"no table {table_id}"
    return [
        html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
        for c in re.findall(r"<th[^>]*>(.*?)</th>", table.group(1), re.S)
    ]


@pytest.fixture
def local_broker(valkey_server: ServerProcess, namespace: str) -> Iterator[redisq.Broker]:
    broker = redisq.connect(valkey_server.url, namespace=namespace)
    yield broker
    drop_namespace(broker)
    broker.close()


def fill(broker: redisq.Broker, topic: str, partitions: int, count: int) -> None:
    broker.create_topic(topic, partitions=partitions)
    with broker.producer(name="filler") as producer:
        for i in range(count):
            producer.send_async(topic, f'{{"n": {i}}}'.encode(), key=f"key-{i % 7}")
        producer.flush()


# -- pages ---------------------------------------------------------------------------------------
def test_topic_pages_show_what_redis_holds(local_broker: redisq.Broker) -> None:
    fill(local_broker, "orders", 3, 70)
    lengths = [local_broker.client.xlen(local_broker.keys.log("orders", p)) for p in range(3)]
    with running_console(local_broker) as base:
        client = Client(base)
        status, _, page = client.get("/")
        assert status == 200
        row = [r for r in cells(page, "topics-table") if r[0] == "orders"][0]
        assert row[1:3] == ["3", "70"]
        status, _, page = client.get("/topics/orders")
        rows = cells(page, "partitions-table")
        assert [int(r[1]) for r in rows] == lengths
        status, _, page = client.get("/topics/orders/producers")
        states = cells(page, "producer-states")
        assert {r[2] for r in states} == {"filler"}
        assert sum(int(r[5]) + 1 for r in states) == 70  # last sequences + 1 per partition
        assert all(r[4] == "current" for r in states)


def test_messages_browse_find_and_views(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("events", partitions=2)
    with local_broker.producer(idempotence="message_id") as producer:
        meta = producer.send(
            "events", b'{"a": [1, 2]}', key="k-1", headers={"trace": "t-9"}, message_id="id-42"
        )
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/events/messages?message_id=id-42&view=json")
        assert f'data-offset="{meta.offset}"' in page
        assert "dedup window" in page  # found through the id -> offset buckets, no scan
        assert "&#34;a&#34;: [\n    1," in page  # pretty JSON, escaped
        assert "t-9" in page and "producer" in page
        _, _, page = client.get("/topics/events/messages?key=k-1&view=hex")
        assert f'data-offset="{meta.offset}"' in page
        assert "7b 22 61 22" in page  # hex of '{"a"'
        _, _, page = client.get(f"/topics/events/messages?partition={meta.partition}&start=0")
        assert page.count('class="message ') == 1
        ms = int(meta.offset.split("-")[0])
        at = f"/topics/events/messages?partition={meta.partition}"
        _, _, page = client.get(f"{at}&since={ms}&until={ms}")
        assert f'data-offset="{meta.offset}"' in page
        _, _, page = client.get(f"{at}&since={ms + 1}")
        assert 'class="message ' not in page
        _, _, page = client.get("/topics/events/messages?key=nothing-like-it")
        assert 'class="message ' not in page


def test_test_produce_answers_partition_offset_duplicate(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=4)
    with running_console(local_broker) as base:
        client = Client(base)
        form = {"key": "order-7", "value": "paid", "headers": "v: 2", "message_id": "pay-7"}
        status, headers, _ = client.post(
            "/topics/orders/produce", {**form, "csrf": client.csrf("/topics/orders")}
        )
        assert status == 303
        first = notice_of(client, headers["location"])
        partition = redisq.partition_for_key(b"order-7", 4)
        [(offset, fields)] = local_broker.client.xrange(local_broker.keys.log("orders", partition))
        assert first == f"ok: Sent: partition {partition}, offset {offset.decode()}, duplicate: no"
        _, headers, _ = client.post(
            "/topics/orders/produce", {**form, "csrf": client.csrf("/topics/orders")}
        )
        again = notice_of(client, headers["location"])
        assert again.endswith(f"offset {offset.decode()}, duplicate: yes")


def test_group_page_and_reset_follow_the_cli_rules(local_broker: redisq.Broker) -> None:
    fill(local_broker, "orders", 2, 40)
    with local_broker.consumer("orders", group="billing", name="m1") as consumer:
        consumer.run(lambda m: None, idle_timeout=0.5)
    with running_console(local_broker) as base:
        client = Client(base)
        _, _, page = client.get("/topics/orders/groups/billing")
        assert [r[3] for r in cells(page, "group-partitions")] == ["0", "0"]
        assert re.search(r'id="total-lag">0<', page)
        with local_broker.consumer("orders", group="billing", name="m2") as live:
            live.poll(timeout=0.5)
            _, _, page = client.get("/topics/orders/groups/billing")
            rows = cells(page, "group-partitions")
            assert {r[5] for r in rows} == {"m2"}  # lease holder
            assert all(r[6].isdigit() for r in rows)  # fencing token
            status, headers, _ = client.post(
                "/topics/orders/groups/billing/reset",
                {"target": "earliest", "csrf": client.csrf("/topics/orders/groups/billing")},
            )
            refused = notice_of(client, headers["location"])
            assert refused.startswith("error:") and "live members" in refused
        status, headers, _ = client.post(
            "/topics/orders/groups/billing/reset",
            {"target": "earliest", "csrf": client.csrf("/topics/orders/groups/billing")},
        )
        assert notice_of(client, headers["location"]).startswith("ok: Reset to earliest")
        _, _, page = client.get("/topics/orders/groups/billing")
        lags = [int(r[3].rstrip("*")) for r in cells(page, "group-partitions")]
        assert sum(lags) == 40


def test_dead_letters_replay_and_release(local_broker: redisq.Broker) -> None:
    fill(local_broker, "orders", 1, 5)

    def handle(message: redisq.Message) -> None:
        if message.key == b"key-3":
            raise ValueError("cannot bill")

    options: Any = {"max_attempts": 1, "failure_policy": "park_key", "retry_backoff_ms": 1}
    with local_broker.consumer("orders", group="billing", **options) as consumer:
        consumer.run(handle, idle_timeout=0.5)
    with running_console(local_broker) as base:
        client = Client(base)
        path = "/topics/orders/groups/billing/deadletters"
        _, _, page = client.get(path)
        [letter] = cells(page, "dead-letters")
        assert letter[2] == "key-3" and letter[3] == "1" and "cannot bill" in letter[4]
        assert [r[1] for r in cells(page, "parked-keys")] == ["key-3"]
        _, headers, _ = client.post(path.replace("deadletters", "release"),
                                    {"key": "key-3", "csrf": client.csrf(path)})  # fmt: skip
        assert (
            notice_of(client, headers["location"])
            == "ok: Released key &#39;key-3&#39; on 1 partition(s)"
        )
        _, headers, _ = client.post(path.replace("deadletters", "replay"),
                                    {"offset": letter[0], "csrf": client.csrf(path)})  # fmt: skip
        assert notice_of(client, headers["location"]) == "ok: Replayed 1 dead letter to orders"
        _, _, page = client.get(path)
        assert cells(page, "dead-letters") == [["No dead letters."]]
        # the dead letter is a message of orders again, after the five (messages, not entries)
        keys = [m.key for m in local_broker.read("orders", 0)]
        assert keys == [f"key-{i}".encode() for i in range(5)] + [b"key-3"]


# -- the guard -----------------------------------------------------------------------------------
def test_token_required_and_never_kept_in_the_url(local_broker: redisq.Broker) -> None:
    with running_console(local_broker, token="s3cret-token") as base:
        client = Client(base)
        assert client.get("/")[0] == 401
        assert client.get("/metrics")[0] == 401
        assert client.get("/?token=wrong")[0] == 401
        assert client.get("/", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert client.get("/", headers={"Authorization": "Bearer s3cret-token"})[0] == 200
        status, headers, _ = client.get("/topics?token=s3cret-token&x=1")
        assert status == 303 and headers["location"] == "/topics?x=1"
        assert "s3cret-token" not in client.cookies.get("redisq_session", "s3cret-token")
        assert client.get("/")[0] == 200  # the session cookie
        stranger = Client(base)
        stranger.cookies["redisq_session"] = "0" * 64
        assert stranger.get("/")[0] == 401


def test_basic_auth(local_broker: redisq.Broker) -> None:
    with running_console(local_broker, basic_auth="admin:pa55") as base:
        client = Client(base)
        status, headers, _ = client.get("/")
        assert status == 401 and headers["www-authenticate"].startswith("Basic")
        good = base64.b64encode(b"admin:pa55").decode()
        bad = base64.b64encode(b"admin:nope").decode()
        assert client.get("/", headers={"Authorization": f"Basic {bad}"})[0] == 401
        assert client.get("/", headers={"Authorization": f"Basic {good}"})[0] == 200


def test_post_without_csrf_is_refused_and_does_nothing(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders")
    with running_console(local_broker) as base:
        client = Client(base)
        token = client.csrf("/topics/orders")
        form = {"value": "x"}
        assert client.post("/topics/orders/produce", form)[0] == 403
        assert client.post("/topics/orders/produce", {**form, "csrf": "f" * 64})[0] == 403
        other_origin = {"Origin": "http://evil.example"}
        status = client.post("/topics/orders/produce", {**form, "csrf": token},
                             headers=other_origin)[0]  # fmt: skip
        assert status == 403
        fresh = Client(base)  # a token from another browser's cookie does not fit this one
        fresh.csrf("/topics/orders")
        assert fresh.post("/topics/orders/produce", {**form, "csrf": token})[0] == 403
        assert local_broker.client.xlen(local_broker.keys.log("orders", 0)) == 0
        assert client.post("/topics/orders/produce", {**form, "csrf": token})[0] == 303
        assert local_broker.client.xlen(local_broker.keys.log("orders", 0)) == 1


def test_read_only_shows_and_does_no_action(local_broker: redisq.Broker) -> None:
    fill(local_broker, "orders", 1, 3)
    with local_broker.consumer("orders", group="billing") as consumer:
        consumer.run(lambda m: None, idle_timeout=0.3)
    with running_console(local_broker, read_only=True) as base:
        client = Client(base)
        group = "/topics/orders/groups/billing"
        pages = ("/", "/topics/orders", group, group + "/deadletters", "/topics/orders/messages")
        for path in pages:
            status, _, page = client.get(path)
            assert status == 200
            assert 'method="post"' not in page and 'class="action"' not in page, path
        csrf = client.csrf("/login")  # a valid CSRF token: only read-only refuses the POST
        status, _, page = client.post("/topics/orders/produce", {"value": "x", "csrf": csrf})
        assert status == 403 and "read-only" in page
        assert len(list(local_broker.read("orders", 0))) == 3  # messages: nothing was sent


def test_exposure_beyond_loopback_needs_credentials() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    with pytest.raises(InvalidConfig, match="--token"):
        check_exposure("0.0.0.0", None, None)
    check_exposure("0.0.0.0", "t", None)
    check_exposure("0.0.0.0", None, "u:p")
    check_exposure("127.0.0.1", None, None)
    from redisq.console import main

    assert main(["--host", "0.0.0.0", "--url", "redis://127.0.0.1:1"]) == 2


def test_console_command_help() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "redisq.cli", "console", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--url", "--namespace", "--host", "--port", "--token", "--basic-auth",
                   "--read-only", "--sample-interval"):  # fmt: skip
        assert option in done.stdout


def test_command_serves_and_logs_no_password(valkey_server: ServerProcess) -> None:
    """`redisq console` in its own process: it serves the pages, the log names the server with
    its password redacted, SIGTERM stops it (exit 0); a server that is down at start is a
    one-line error (exit 2, as every command that cannot run), not a traceback."""
    import subprocess
    import sys

    password = "pw-Lq93"
    client = valkey_server.client()
    client.acl_setuser("console-user", enabled=True, passwords=[f"+{password}"], commands=["+@all"],
                       keys=["*"], channels=["*"])  # fmt: skip
    url = f"redis://console-user:{password}@127.0.0.1:{valkey_server.port}/0"
    port = free_port()
    command = [sys.executable, "-m", "redisq.cli", "console"]
    process = subprocess.Popen(
        [*command, "--url", url, "--port", str(port), "--namespace", "cmd", "--read-only"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, page = Client(f"http://127.0.0.1:{port}").get("/")
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert status == 200 and "console-user:***@" in page and password not in page
        assert "read-only" in page
        status, _, page = Client(f"http://127.0.0.1:{port}").get("/transactions")
        assert status == 200 and "Transactions &amp; schedules" in page
    finally:
        process.terminate()
        _, log = process.communicate(timeout=30)
        client.acl_deluser("console-user")
    assert process.returncode == 0, log
    assert "console-user:***@127.0.0.1" in log and password not in log
    assert "Traceback" not in log
    down = subprocess.run(
        [*command, "--url", f"redis://u:{password}@127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 2 and "cannot reach redis://u:***@127.0.0.1:1/0" in down.stderr
    assert "Traceback" not in down.stderr and password not in down.stderr


# -- errors --------------------------------------------------------------------------------------
def test_missing_topic_and_server_down_are_pages_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    password = "pw-Zq81x"
    server = ServerProcess().start()
    server.client().config_set("requirepass", password)
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    broker = redisq.connect(url, namespace="console-errors", socket_timeout=2)
    caplog.set_level(logging.DEBUG)
    try:
        with running_console(broker, url=url) as base:
            client = Client(base)
            status, _, page = client.get("/topics/nope")
            assert status == 404 and "topic &#39;nope&#39; does not exist" in page
            status, _, page = client.get("/topics/orders/groups/g")
            assert status == 404
            _, _, page = client.get("/")
            assert password not in page and "redis://:***@127.0.0.1" in page
            server.stop()
            for path in ("/", "/topics/orders", "/metrics", "/topics/orders?fragment=live"):
                status, _, page = client.get(path)
                assert status == 503, (path, page)
                assert "Cannot reach the server" in page and "Traceback" not in page
                assert password not in page
    finally:
        server.stop()
        broker.close()
    assert password not in caplog.text


# -- reads stay batched --------------------------------------------------------------------------
def count_round_trips(broker: redisq.Broker) -> tuple[Any, list[int]]:
    calls: list[int] = []
    execute = broker.scripts.execute

    def counting(steps: Any) -> Any:
        calls.append(len(steps) if isinstance(steps, list) else 1)
        return execute(steps)

    return counting, calls


def test_snapshot_costs_the_same_round_trips_at_any_size(broker: redisq.Broker) -> None:
    """Every backend (a cluster included): the namespace snapshot is three pipelined round
    trips for 1 topic of 2 partitions and for 6 topics of 16, with their groups."""
    trips = []
    for topics, partitions in ((1, 2), (6, 16)):
        for t in range(topics):
            name = f"t{partitions}-{t}"
            broker.create_topic(name, partitions=partitions)
            broker.client.sadd(broker.keys.groups(name), "g")  # a registered group
        execute, calls = count_round_trips(broker)
        snapshot = run_operation(namespace_snapshot(broker.keys), execute)
        trips.append(len(calls))
        assert len(snapshot.groups) == sum(1 for name in snapshot.topics if "-" in name)
        assert all(len(g.partitions) == partitions or g.topic.startswith("t2-")
                   for g in snapshot.groups.values())  # fmt: skip
    assert trips == [3, 3]


@pytest.mark.cluster
@pytest.mark.parametrize("entry_format", ["batch", "message"])  # a batch topic has one more
def test_topic_page_names_the_cluster_node_of_each_partition(  # column (its messages)
    valkey_cluster3: list[ServerProcess], namespace: str, entry_format: str
) -> None:
    broker = redisq.connect(f"redis://127.0.0.1:{valkey_cluster3[0].port}", namespace=namespace)
    try:
        broker.create_topic("orders", partitions=12, entry_format=entry_format)
        with running_console(broker) as base:
            status, _, page = Client(base).get("/topics/orders")
            assert status == 200
            column = heads(page, "partitions-table").index("Node")
            nodes = [row[column] for row in cells(page, "partitions-table")]
        expected = []
        for p in range(12):
            node = broker.client.get_node_from_key(broker.keys.log("orders", p))
            expected.append(f"{node.host}:{node.port}")
        assert nodes == expected and len(set(nodes)) > 1
    finally:
        drop_namespace(broker)
        broker.close()
