"""Adversarial tests of the console (HTTP level, no browser): searches that hit an empty
partition, actions that must not look like success when nothing happened, the guard's
redirects (token visit, login's `next`) and a console without credentials addressed under a
foreign host name (DNS rebinding).

Every test serves the real app with uvicorn (tests/console/test_http.py's helpers) over the
machine's Redis (REDIS_URL, else a redis-server) in a namespace of its own.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from tests.conftest import broker_in  # noqa: E402
from tests.console.test_http import Client, cells, running_console  # noqa: E402


@pytest.fixture
def shared_broker(redis_url: str, namespace: str) -> Iterator[redisq.Broker]:
    with broker_in(redis_url, f"adv{namespace}") as broker:
        yield broker


def notice(client: Client, location: str) -> tuple[int, str, str]:
    """(status of the page the action redirected to, notice kind, notice text)."""
    status, _, page = client.get(location)
    found = re.search(r'<div class="notice (\w+)"[^>]*>(.*?)</div>', page, re.S)
    assert found, page
    return status, found.group(1), found.group(2)


def raw_request(
    base: str, method: str, path: str, headers: dict[str, str], body: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A request sent as given (the path not re-encoded, the Host header ours)."""
    host, port = base.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    if body is not None:
        conn.putheader("Content-Type", "application/x-www-form-urlencoded")
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body.encode() if body is not None else None)
    response = conn.getresponse()
    data = response.read()
    got = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return response.status, got, data


# -- searches ------------------------------------------------------------------------------------
def test_find_by_key_or_id_in_an_empty_partition_is_not_an_internal_error(
    shared_broker: redisq.Broker,
) -> None:
    """A key whose partition holds nothing, and a message id found nowhere, on a topic with an
    empty partition: "nothing found", never a 500 (browse.py's scan read entries[-1] of an
    empty reply: IndexError)."""
    shared_broker.create_topic("orders", partitions=2)
    key = next(f"k{i}" for i in range(100) if redisq.partition_for_key(f"k{i}".encode(), 2) == 1)
    other = next(f"k{i}" for i in range(100) if redisq.partition_for_key(f"k{i}".encode(), 2) == 0)
    with shared_broker.producer() as producer:
        producer.send("orders", b"only in partition 0", key=other)
    with running_console(shared_broker) as base:
        client = Client(base)
        for path in (
            f"/topics/orders/messages?key={key}",
            "/topics/orders/messages?message_id=never-sent",
            "/topics/orders/messages?key=x&key_partition=1",
        ):
            status, _, page = client.get(path)
            assert status == 200, (path, page[-400:])
            assert 'class="message ' not in page


# -- actions -------------------------------------------------------------------------------------
def dead_lettered(broker: redisq.Broker, policy: str = "park_key") -> None:
    """One message on orders/0 whose handler fails: dead-lettered by group billing (policy
    park_key parks its key)."""
    broker.create_topic("orders", partitions=1)
    with broker.producer() as producer:
        producer.send("orders", b"v", key="k")

    def fail(message: redisq.Message) -> None:
        raise ValueError("no")

    options: Any = {"max_attempts": 1, "failure_policy": policy, "retry_backoff_ms": 1}
    with broker.consumer("orders", group="billing", **options) as consumer:
        consumer.run(fail, idle_timeout=0.5)


def test_replay_for_a_missing_group_or_unknown_offsets_is_not_reported_as_done(
    shared_broker: redisq.Broker,
) -> None:
    """Replay on a group that does not exist said "ok: Replayed 0 dead letters" (and sent the
    browser to a 404); replay of offsets that are no dead letter (or not even offsets) said the
    same. The CLI refuses the first (GroupNotFound); neither is a success."""
    dead_lettered(shared_broker)
    dead_letter_log = shared_broker.keys.log("orders~dlq~billing", 0)
    with running_console(shared_broker) as base:
        client = Client(base)
        csrf = client.csrf("/topics/orders/groups/billing/deadletters")
        for group, form in (
            ("nobody", {"all": "1"}),
            ("nobody", {"offset": "1-1"}),
            ("billing", {"offset": "1-1"}),
            ("billing", {"offset": "not-an-offset"}),
        ):
            _, headers, _ = client.post(
                f"/topics/orders/groups/{group}/replay", {**form, "csrf": csrf}
            )
            status, kind, text = notice(client, headers["location"])
            assert kind != "ok", (group, form, kind, text)
            assert status == 200, (group, form, status)  # the notice is shown on a real page
        assert shared_broker.client.xlen(dead_letter_log) == 1  # nothing replayed
        assert shared_broker.client.xlen(shared_broker.keys.log("orders", 0)) == 1


def test_release_on_a_missing_group_says_not_found(shared_broker: redisq.Broker) -> None:
    """As `redisq dlq release` (GroupNotFound, exit 3): the console said "Key 'k' was not
    parked" and redirected to a 404 page."""
    dead_lettered(shared_broker)
    with running_console(shared_broker) as base:
        client = Client(base)
        csrf = client.csrf("/topics/orders/groups/billing/deadletters")
        _, headers, _ = client.post("/topics/orders/groups/nobody/release",
                                    {"key": "k", "csrf": csrf})  # fmt: skip
        status, kind, text = notice(client, headers["location"])
        assert (status, kind) == (200, "error") and "does not exist" in text, (status, kind, text)


def test_reset_to_a_datetime_before_1970_is_a_clear_error(shared_broker: redisq.Broker) -> None:
    """The library's reset_offsets refuses negative epoch ms with InvalidConfig, but a datetime
    before 1970 went through and failed deep inside ("'-31536000000-0' is not a stream ID")."""
    dead_lettered(shared_broker)
    with running_console(shared_broker) as base:
        client = Client(base)
        path = "/topics/orders/groups/billing"
        form = {"target": "datetime", "value": "1969-01-01T00:00:00+00:00"}
        _, headers, _ = client.post(path + "/reset", {**form, "csrf": client.csrf(path)})
        _, kind, text = notice(client, headers["location"])
        assert kind == "error" and "InvalidConfig" in text and "stream ID" not in text, text


# -- the guard -----------------------------------------------------------------------------------
def test_token_visit_redirects_to_the_same_address(shared_broker: redisq.Broker) -> None:
    """`?token=` is dropped by a redirect to the same address. The Location was built from the
    decoded path: %3F became a query ("/topics/a?b"), a space went out raw, a character beyond
    Latin-1 was a 500 with a traceback in the log, and "//host/?token=" sent the browser to
    another site."""
    shared_broker.create_topic("orders")
    with running_console(shared_broker, token="tok-123") as base:
        for sent, expected in (
            ("/topics/a%3Fb?token=tok-123&x=1", "/topics/a%3Fb?x=1"),
            ("/topics/a%20b?token=tok-123", "/topics/a%20b"),
            ("/topics/%E2%82%AC?token=tok-123", "/topics/%E2%82%AC"),
        ):
            status, headers, _ = raw_request(base, "GET", sent, {})
            assert (status, headers.get("location")) == (303, expected), sent
        status, headers, _ = raw_request(base, "GET", "//evil.example/?token=tok-123", {})
        assert status == 303 and not headers["location"].startswith("//"), headers["location"]


@pytest.mark.parametrize("target", ["/\\evil.example", "/\t/evil.example", "/\\/evil.example"])
def test_login_next_never_leaves_the_console(shared_broker: redisq.Broker, target: str) -> None:
    """/login?next=... is put in the sign-in form; after sign-in the console redirected to any
    `next` starting with one "/": browsers read "/\\evil.example" (and "/<tab>/evil.example") as
    "//evil.example", another site (an open redirect)."""
    with running_console(shared_broker, token="tok-123") as base:
        client = Client(base)
        _, _, page = client.get("/login?next=" + target.replace("\\", "%5C").replace("\t", "%09"))
        assert 'name="next"' in page
        csrf = client.csrf("/login")
        form = {"csrf": csrf, "token": "tok-123", "next": target}
        status, headers, _ = client.post("/login", form)
        assert status == 303
        location = headers["location"]
        assert "\\" not in location and "\t" not in location and not location.startswith("//")


def test_open_console_refuses_a_foreign_host_name(shared_broker: redisq.Broker) -> None:
    """A console without credentials listens on loopback only. A web page under another name
    that resolves to 127.0.0.1 (DNS rebinding) is same-origin with it: it could read every page
    and, with the CSRF token read from a form and Origin equal to Host, post actions. The
    console must answer only to loopback host names when it has no credentials."""
    shared_broker.create_topic("orders")
    with running_console(shared_broker) as base:
        port = base.rsplit(":", 1)[1]
        foreign = {"Host": f"evil.example:{port}"}
        status, headers, page = raw_request(base, "GET", "/topics/orders", foreign)
        assert status in (400, 403, 421), status
        assert b"orders" not in page
        # what a rebinding page could do with a form it read
        status, headers, page = raw_request(base, "GET", "/topics/orders", {})
        assert status == 200
        csrf = re.search(rb'name="csrf" value="([0-9a-f]+)"', page).group(1).decode()  # type: ignore[union-attr]
        cookie = headers["set-cookie"].split(";")[0]
        status, _, _ = raw_request(
            base,
            "POST",
            "/topics/orders/produce",
            {**foreign, "Origin": f"http://evil.example:{port}", "Cookie": cookie},
            f"value=pwned&csrf={csrf}",
        )
        assert status in (400, 403, 421)
        assert shared_broker.client.xlen(shared_broker.keys.log("orders", 0)) == 0
        # loopback names still work
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert raw_request(base, "GET", "/", {"Host": host})[0] == 200


def test_console_with_credentials_still_answers_any_host_name(
    shared_broker: redisq.Broker,
) -> None:
    """Behind a reverse proxy (README) the Host is the proxy's name: with a token the console
    keeps answering it."""
    with running_console(shared_broker, token="tok-123") as base:
        status, _, _ = raw_request(
            base, "GET", "/", {"Host": "console.example", "Authorization": "Bearer tok-123"}
        )
        assert status == 200


def test_dead_letter_page_shows_a_foreign_letter(shared_broker: redisq.Broker) -> None:
    """An entry written into the dead-letter topic by something else (no x-redisq headers)
    lists, escaped, and the page stays a page."""
    dead_lettered(shared_broker)
    shared_broker.client.xadd(
        shared_broker.keys.log("orders~dlq~billing", 0), {b"x\xff": b"<script>alert(1)</script>"}
    )
    with running_console(shared_broker) as base:
        status, _, page = Client(base).get("/topics/orders/groups/billing/deadletters")
        assert status == 200 and "<script>alert" not in page
        assert len(cells(page, "dead-letters")) == 2
