"""The console's topic administration, search, live tail, stored chart history and tables that
fit, in a real browser (Debian's chromium through Playwright, as tests/console/test_browser.py:
its fixtures, its skip rules, no browser download)."""

from __future__ import annotations

import time

import pytest

import redisq
from tests.console import test_browser as shared

pytestmark = shared.pytestmark
missing, console, send = shared.missing, shared.console, shared.send
mark_page, not_reloaded = shared.mark_page, shared.not_reloaded
# The shared fixtures, under the names the tests ask for.
browser, page, allowed_errors = shared.browser, shared.page, shared.allowed_errors
local_broker = shared.local_broker

if missing is None:
    from playwright.sync_api import Page, expect


def test_topic_created_grown_and_deleted_from_the_page(
    page: Page, local_broker: redisq.Broker
) -> None:
    with console(page, local_broker) as base:
        page.goto(base + "/")
        form = page.locator("#create-topic-form")
        form.get_by_label("Name").fill("payments")
        form.get_by_label("Partitions").fill("2")
        form.get_by_role("button", name="Create topic").click()
        expect(page.locator("#notice")).to_have_text(  # the form's default format, named
            "Created topic 'payments' with 2 partitions (batch entries)"
        )
        expect(page.locator("h1")).to_contain_text("payments")
        expect(page.locator("#partitions-table tbody tr")).to_have_count(2)

        grow = page.locator("#grow-form")
        grow.get_by_label("Partitions").fill("4")
        grow.get_by_role("button", name="Add partitions").click()
        expect(page.locator("#notice")).to_contain_text("grown from 2 to 4 partitions")
        expect(page.locator("#partitions-table tbody tr")).to_have_count(4)

        delete = page.locator("#delete-form")
        delete.get_by_role("button", name="Delete topic").click()  # not confirmed
        expect(page.locator("#notice")).to_contain_text("to confirm the delete")
        assert "payments" in local_broker.list_topics()
        page.locator("#delete-form").get_by_label("Type the topic's name").fill("payments")
        page.locator("#delete-form").get_by_role("button", name="Delete topic").click()
        expect(page.locator("#notice")).to_contain_text("Deleted topic 'payments'")
        expect(page.locator('#topics-table tr[data-topic="payments"]')).to_have_count(0)
        assert "payments" not in local_broker.list_topics()


def test_read_only_console_has_no_topic_admin(page: Page, local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders")
    with console(page, local_broker, read_only=True) as base:
        page.goto(base + "/")
        expect(page.locator("#create-topic-form")).to_have_count(0)
        page.goto(base + "/topics/orders")
        expect(page.locator("#grow-form")).to_have_count(0)
        expect(page.get_by_role("button", name="Delete topic")).to_have_count(0)


def test_search_by_key_and_time_across_partitions(page: Page, local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=3)
    send(local_broker, "orders", 27)  # keys order-0 .. order-8, three messages each
    with local_broker.producer() as producer:
        for p in range(3):
            producer.send("orders", f"moved {p}", key="order-4", partition=p)
    with console(page, local_broker) as base:
        page.goto(base + "/topics/orders")
        page.get_by_role("link", name="Search").click()
        form = page.locator("#search-form")
        form.get_by_label("Search by").select_option("key")
        form.get_by_label("Key or message id").fill("order-4")
        form.get_by_role("button", name="Search").click()
        expect(page.locator("#messages article")).to_have_count(6)
        expect(page.locator("#search-summary")).to_contain_text("all 3 partitions")
        expect(page.locator("#search-summary")).to_contain_text("complete")
        for p in range(3):
            expect(page.locator("#messages .offset").filter(has_text=f"{p}@")).not_to_have_count(0)

        first = local_broker.client.xrange(local_broker.keys.log("orders", 0), count=1)[0][0]
        form = page.locator("#search-form")
        form.get_by_label("Search by").select_option("time")
        form.get_by_label("Key or message id").fill("")
        form.get_by_label("Since").fill(first.decode().split("-")[0])
        form.get_by_label("Limit").fill("5")
        form.get_by_role("button", name="Search").click()
        expect(page.locator("#messages article")).to_have_count(5)
        expect(page.locator("#search-summary")).to_contain_text("stopped at the limit of 5")


def test_live_tail_shows_new_messages_pauses_and_stops(
    page: Page, local_broker: redisq.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redisq.console import pages

    monkeypatch.setattr(pages, "TAIL_INTERVAL_MS", 200)
    local_broker.create_topic("orders", partitions=3)
    send(local_broker, "orders", 5)  # before the tail: not shown
    with console(page, local_broker) as base:
        page.goto(base + "/topics/orders")
        page.get_by_role("link", name="Live tail").click()
        mark_page(page)
        expect(page.locator("#tail-status")).to_contain_text("last checked")
        send(local_broker, "orders", 4, start=100)
        expect(page.locator("#tail-messages article")).to_have_count(4)
        expect(page.locator("#tail-messages article").first).to_contain_text('"order": 103')
        expect(page.locator("#tail-count")).to_have_text("4")

        page.get_by_role("button", name="Pause").click()
        expect(page.locator("#tail-status")).to_have_text("Paused.")
        send(local_broker, "orders", 2, start=200)
        page.wait_for_timeout(800)
        expect(page.locator("#tail-messages article")).to_have_count(4)
        page.get_by_role("button", name="Resume").click()
        expect(page.locator("#tail-messages article")).to_have_count(6)
        assert not_reloaded(page)

        monkeypatch.setattr(pages, "TAIL_MAX_MINUTES", 0.02)  # 1.2 s
        page.reload()
        expect(page.locator("#tail-status")).to_contain_text("Stopped", timeout=10_000)
        expect(page.get_by_role("button", name="Resume")).to_be_visible()


def test_throughput_chart_survives_a_console_restart(
    page: Page, local_broker: redisq.Broker
) -> None:
    local_broker.create_topic("orders", partitions=2)
    key = local_broker.keys.console_series("added:orders")
    with console(page, local_broker, sample_interval_s=0.2):
        deadline = time.monotonic() + 20
        start = 0
        while local_broker.client.zcard(key) < 5:
            send(local_broker, "orders", 3, start=start)
            start += 3
            assert time.monotonic() < deadline, "no samples stored"
            time.sleep(0.1)
    # The new console samples once when it starts, then not for an hour: what it draws at once
    # comes from Redis.
    with console(page, local_broker, sample_interval_s=3600) as base:
        page.goto(base + "/topics/orders")
        chart = page.locator(".chart-box svg.chart")
        expect(chart).to_be_visible()
        expect(chart.locator("polyline").first).to_be_visible()
        page.goto(base + "/")
        expect(page.locator('#topics-table tr[data-topic="orders"] svg.spark')).to_be_visible()


def page_fits(page: Page) -> bool:
    """Nothing makes the page scroll sideways."""
    return bool(
        page.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth + 1"
        )
    )


def test_tables_fit_a_narrow_window(page: Page, local_broker: redisq.Broker) -> None:
    long_topics = [f"orders-of-the-{'very-' * 8}long-region-{i}" for i in range(4)]
    name = "billing-service-" + "x" * 120
    for topic in long_topics:
        local_broker.create_topic(topic, partitions=2)
    with local_broker.producer(name=name) as producer:
        for topic in long_topics:
            producer.send(topic, b"v", key="k" * 150)
    page.set_viewport_size({"width": 720, "height": 900})
    with console(page, local_broker) as base:
        for path in ("/producers", "/", f"/topics/{long_topics[0]}/producers"):
            page.goto(base + path)
            expect(page.locator("table.grid").first).to_be_visible()
            assert page_fits(page), path
            for wrap in page.locator(".table-wrap").all():  # a table scrolls in its box at worst
                box = wrap.bounding_box()
                assert box is not None and box["x"] + box["width"] <= 720, path
        page.goto(base + "/producers")
        expect(page.locator("#named-producers")).to_contain_text(name)
        table = page.locator("#named-producers").bounding_box()
        assert table is not None and table["x"] + table["width"] <= 720  # wrapped: no scroll
