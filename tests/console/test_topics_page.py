"""Topic administration from the console over HTTP: create, grow (add partitions) and delete
through the broker's own methods; refused in read-only mode and without the CSRF token; what
the broker refuses shown as a message, with nothing changed."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import redisq  # noqa: E402
from tests.console import test_http as shared  # noqa: E402
from tests.console.test_http import Client, notice_of, running_console  # noqa: E402

local_broker = shared.local_broker  # the fixture, under the name the tests ask for


def test_create_grow_delete(local_broker: redisq.Broker) -> None:
    with running_console(local_broker) as base:
        client = Client(base)
        form = {
            "name": "payments",
            "partitions": "3",
            "retention_ms": "3600000",
            "retention_messages": "",
            "dedup_window_ms": "",
            "csrf": client.csrf("/"),
        }
        status, headers, _ = client.post("/topics/create", form)
        assert status == 303 and headers["location"].startswith("/topics/payments?notice=")
        assert notice_of(client, headers["location"]) == (
            "ok: Created topic &#39;payments&#39; with 3 partitions (batch entries)"
        )  # the format the topic got, named (batch entries, the default)
        config = local_broker.topic_config("payments", refresh=True)
        assert (config.partitions, config.retention_ms, config.dedup_window_ms) == (
            3,
            3600000,
            3600000,
        )

        _, headers, _ = client.post(
            "/topics/payments/partitions",
            {"partitions": "5", "csrf": client.csrf("/topics/payments")},
        )
        assert notice_of(client, headers["location"]).startswith(
            "ok: Topic &#39;payments&#39; grown from 3 to 5 partitions"
        )
        assert local_broker.topic_config("payments", refresh=True).partitions == 5
        assert local_broker.client.exists(local_broker.keys.log("payments", 4))

        with local_broker.producer() as producer:
            producer.send("payments", b"x", key="k")
        series = local_broker.keys.console_series("added:payments")
        deadline = time.monotonic() + 10
        while not local_broker.client.exists(series):  # sampled every 0.3 s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _, headers, _ = client.post(
            "/topics/payments/delete", {"confirm": "payments", "csrf": client.csrf("/")}
        )
        assert headers["location"].startswith("/?notice=")
        assert notice_of(client, headers["location"]).startswith(
            "ok: Deleted topic &#39;payments&#39;"
        )
        assert "payments" not in local_broker.list_topics()
        assert not local_broker.client.exists(local_broker.keys.log("payments", 0))
        # Its chart history went with it (a topic created again starts a chart of its own).
        time.sleep(0.7)  # two more samples: neither brings it back
        assert not local_broker.client.exists(series)


def test_refusals_are_messages_and_change_nothing(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=2)
    with running_console(local_broker) as base:
        client = Client(base)
        topic_page = "/topics/orders"

        def refused(path: str, form: dict[str, str], page: str = topic_page) -> str:
            status, headers, _ = client.post(
                path, {**form, "csrf": client.csrf(page)}, headers={"Referer": base + page}
            )
            assert status == 303
            return notice_of(client, headers["location"])

        assert refused("/topics/create", {"name": "orders"}, "/") == (
            "error: topic &#39;orders&#39; already exists"
        )
        assert "invalid topic name" in refused("/topics/create", {"name": "bad name!"}, "/")
        assert "invalid topic name" in refused("/topics/create", {"name": "orders~dlq~g"}, "/")
        assert "Partitions: 0 is out of range 1..4096" in refused(
            "/topics/create", {"name": "fresh", "partitions": "0"}, "/"
        )
        assert "not a whole number" in refused(
            "/topics/create", {"name": "fresh", "retention_ms": "soon"}, "/"
        )
        assert "fresh" not in local_broker.list_topics()

        assert "partitions can only be added" in refused(
            "/topics/orders/partitions", {"partitions": "1"}
        )
        assert "Partitions: 5000 is out of range" in refused(
            "/topics/orders/partitions", {"partitions": "5000"}
        )
        assert local_broker.topic_config("orders", refresh=True).partitions == 2

        assert "to confirm the delete" in refused("/topics/orders/delete", {"confirm": "order"})
        with local_broker.consumer("orders", group="billing") as live:
            live.poll(timeout=0.3)
            message = refused("/topics/orders/delete", {"confirm": "orders"})
            assert message.startswith("error:") and "live members" in message
            assert "orders" in local_broker.list_topics()
            _, headers, _ = client.post(
                "/topics/orders/delete",
                {"confirm": "orders", "force": "1", "csrf": client.csrf(topic_page)},
            )
            assert notice_of(client, headers["location"]).startswith("ok: Deleted topic")
        assert "orders" not in local_broker.list_topics()
        assert refused("/topics/orders/partitions", {"partitions": "3"}, "/").startswith(
            "error: topic &#39;orders&#39; does not exist"
        )


def test_read_only_and_csrf_refuse_topic_admin(local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=2)
    with running_console(local_broker, read_only=True) as base:
        client = Client(base)
        _, _, page = client.get("/")
        assert "create-topic-form" not in page
        _, _, page = client.get("/topics/orders")
        assert "grow-form" not in page and "delete-form" not in page
        for path, form in (
            ("/topics/create", {"name": "x"}),
            ("/topics/orders/partitions", {"partitions": "4"}),
            ("/topics/orders/delete", {"confirm": "orders"}),
        ):
            status, _, body = client.post(path, form)
            assert status == 403 and "read-only" in body
    with running_console(local_broker) as base:
        client = Client(base)
        client.get("/")  # the CSRF cookie, but no token in the form
        for path, form in (
            ("/topics/create", {"name": "x"}),
            ("/topics/orders/partitions", {"partitions": "4"}),
            ("/topics/orders/delete", {"confirm": "orders"}),
        ):
            status, _, body = client.post(path, form)
            assert status == 403 and "CSRF" in body
            status, _, body = client.post(path, {**form, "csrf": "0" * 64})
            assert status == 403
    assert local_broker.list_topics() == ["orders"]
    assert local_broker.topic_config("orders", refresh=True).partitions == 2


def test_topic_names_are_escaped_in_messages(local_broker: redisq.Broker) -> None:
    with running_console(local_broker) as base:
        client = Client(base)
        status, headers, _ = client.post(
            "/topics/create",
            {"name": "<script>alert(1)</script>", "csrf": client.csrf("/")},
            headers={"Referer": base + "/"},
        )
        text = notice_of(client, headers["location"])
        assert "<script>" not in text and "&lt;script&gt;" in text


def test_every_table_sits_in_a_box_that_scrolls(local_broker: redisq.Broker) -> None:
    """Tables fit the window: each grid is wrapped in a .table-wrap (overflow-x: auto), so a
    table too wide scrolls inside it and never the page (the browser test measures it)."""
    local_broker.create_topic("orders", partitions=2)
    with local_broker.producer(name="p-" + "x" * 150) as producer:
        producer.send("orders", b"v", key="k")
    with local_broker.consumer("orders", group="billing") as consumer:
        consumer.poll(timeout=0.3)
    with running_console(local_broker) as base:
        client = Client(base)
        for path in (
            "/",
            "/groups",
            "/producers",
            "/transactions",
            "/topics/orders",
            "/topics/orders/producers",
            "/topics/orders/groups/billing",
            "/topics/orders/groups/billing/deadletters",
        ):
            status, _, page = client.get(path)
            assert status == 200, path
            tables = page.count('<table class="grid"')
            assert tables and page.count('<div class="table-wrap"><table class="grid"') == tables
        _, _, css = client.get("/static/console.css")
        assert ".table-wrap { max-width: 100%; overflow-x: auto; }" in css
