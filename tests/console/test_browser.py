"""The console in a real browser: Debian's chromium driven by Playwright (the python package
only; the browser is /usr/bin/chromium, never one Playwright downloads).

What a user does and sees: a filled topic shows its counts and they move live; a dead letter is
replayed and disappears; a group's lag falls to zero while a consumer runs, without a reload;
the read-only console has no action; a wrong token gets 401; test produce answers; the page's
own script and styles pass its Content-Security-Policy (no console error on any page).

Set REDISQ_SCREENSHOTS=<dir> to keep a screenshot of each main page there (docs/ is made so).
Install: apt-get install -y chromium; pip install playwright (see the README).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import redisq
from tests.servers import ServerProcess

CHROMIUM = os.environ.get("REDISQ_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _unavailable() -> tuple[str | None, bool]:
    """(what is missing, whether the console extra is installed)."""
    try:
        import starlette  # noqa: F401
    except ImportError:
        return "the console extra is not installed", False
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed", True
    if not os.path.exists(CHROMIUM):
        return f"no browser at {CHROMIUM}", True
    return None, True


missing, console_installed = _unavailable()
if missing and console_installed and os.environ.get("CI"):
    # A CI that installs the console must run it in the browser: a skip would hide a failure.
    raise RuntimeError(f"console browser tests cannot run in CI: {missing}")
pytestmark = pytest.mark.skipif(missing is not None, reason=missing or "")

if missing is None:
    from playwright.sync_api import Page, expect, sync_playwright

    from tests.console.test_http import running_console


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture
def allowed_errors() -> list[str]:
    """Browser console errors a test expects (an answer 401 or 403 it asked for)."""
    return []


@pytest.fixture
def page(browser: Any, allowed_errors: list[str]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.set_default_timeout(20_000)
    yield opened
    context.close()
    # A blocked script or style (CSP), a failed fetch, a JS exception: all fail the test.
    assert not [e for e in errors if not any(a in e for a in allowed_errors)], errors


@pytest.fixture
def local_broker(valkey_server: ServerProcess, namespace: str) -> Iterator[redisq.Broker]:
    from tests.conftest import drop_namespace

    broker = redisq.connect(valkey_server.url, namespace=namespace)
    yield broker
    drop_namespace(broker)
    broker.close()


@contextmanager
def console(page: Page, broker: redisq.Broker, **options: Any) -> Iterator[str]:
    """running_console, and the page left before the console stops (its live refresh would
    otherwise fail against a stopped server)."""
    with running_console(broker, **options) as base:
        try:
            yield base
        finally:
            page.goto("about:blank")


def send(broker: redisq.Broker, topic: str, count: int, start: int = 0) -> None:
    with broker.producer(name="browser-test") as producer:
        for i in range(start, start + count):
            producer.send_async(topic, f'{{"order": {i}, "state": "paid"}}', key=f"order-{i % 9}")
        producer.flush()


def mark_page(page: Page) -> None:
    """A value that survives only while the page is not reloaded."""
    page.evaluate("window.__notReloaded = true")


def not_reloaded(page: Page) -> bool:
    return bool(page.evaluate("window.__notReloaded === true"))


def shoot(page: Page, name: str, tmp_path: Path) -> None:
    target = tmp_path / f"console-{name}.png"
    page.screenshot(path=str(target), full_page=True)
    keep = os.environ.get("REDISQ_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(target, Path(keep) / target.name)


def test_topic_counts_appear_and_move_live(
    page: Page, local_broker: redisq.Broker, tmp_path: Path
) -> None:
    """A batch topic (the default): the pages count messages; the topic page shows the stream
    entries (one per producer batch, as XLEN counts them) with the messages beside them."""
    local_broker.create_topic("orders", partitions=3)
    send(local_broker, "orders", 90)

    def entries() -> list[int]:
        return [local_broker.client.xlen(local_broker.keys.log("orders", p)) for p in range(3)]

    with console(page, local_broker, refresh_ms=300) as base:
        page.goto(base + "/")
        row = page.locator('#topics-table tr[data-topic="orders"]')
        expect(row.locator("td.messages")).to_have_text("90")
        row.get_by_role("link", name="orders").click()
        expect(page.locator("#entry-format")).to_contain_text("batch")
        expect(page.locator("#topic-messages")).to_have_text("90")
        expect(page.locator("#topic-total")).to_have_text(str(sum(entries())))
        for p, length in enumerate(entries()):
            row = page.locator(f'#partitions-table tr[data-partition="{p}"]')
            expect(row.locator("td.messages")).to_have_text(str(length))  # entries
            messages = len(list(local_broker.read("orders", p)))
            expect(row.locator("td.counted")).to_have_text(str(messages))
        mark_page(page)
        send(local_broker, "orders", 30, start=90)
        expect(page.locator("#topic-messages")).to_have_text("120")
        expect(page.locator("#topic-total")).to_have_text(str(sum(entries())))
        expect(page.locator("svg.chart")).to_be_visible()  # throughput, from the samples
        assert not_reloaded(page)
        shoot(page, "topic", tmp_path)
        page.goto(base + "/")
        shoot(page, "topics", tmp_path)


def test_dead_letter_is_replayed_and_disappears(
    page: Page, local_broker: redisq.Broker, tmp_path: Path
) -> None:
    local_broker.create_topic("payments", partitions=2)
    send(local_broker, "payments", 12)

    def handle(message: redisq.Message) -> None:
        if message.key == b"order-4":
            raise ValueError("card declined")

    options: Any = {"max_attempts": 2, "retry_backoff_ms": 1}
    with local_broker.consumer("payments", group="billing", **options) as consumer:
        consumer.run(handle, idle_timeout=0.5)
    source = local_broker.keys.log("payments", redisq.partition_for_key(b"order-4", 2))
    before = local_broker.client.xlen(source)
    with console(page, local_broker) as base:
        page.goto(base + "/topics/payments/groups/billing/deadletters")
        rows = page.locator("#dead-letters tbody tr[data-offset]")
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("card declined")
        expect(rows.first.locator("td").nth(3)).to_have_text("2")  # attempts
        shoot(page, "dead-letters", tmp_path)
        rows.first.get_by_role("button", name="Replay").click()
        expect(page.locator("#notice")).to_have_text("Replayed 1 dead letter to payments")
        expect(page.locator("#dead-letters tbody tr[data-offset]")).to_have_count(0)
    assert local_broker.client.xlen(source) == before + 1


def test_group_lag_goes_to_zero_while_a_consumer_runs(
    page: Page, local_broker: redisq.Broker, tmp_path: Path
) -> None:
    local_broker.create_topic("orders", partitions=4)
    send(local_broker, "orders", 400)
    local_broker.consumer("orders", group="billing", name="registrar").close()  # joins only
    with console(page, local_broker, refresh_ms=300) as base:
        page.goto(base + "/topics/orders/groups/billing")
        expect(page.locator("#total-lag")).to_have_text("400")
        mark_page(page)
        stop = threading.Event()
        consumer = local_broker.consumer("orders", group="billing", name="worker-1")

        def work() -> None:
            consumer.run(lambda m: stop.wait(0.002), idle_timeout=3.0)

        runner = threading.Thread(target=work)
        runner.start()
        try:
            expect(page.locator("#total-lag")).not_to_have_text("400", timeout=20_000)
            expect(page.locator("#total-lag")).to_have_text("0", timeout=60_000)
            expect(page.locator("#members-table")).to_contain_text("worker-1")
            assert not_reloaded(page)
            expect(page.locator("svg.chart")).to_be_visible()  # the lag over time
            shoot(page, "group", tmp_path)
        finally:
            stop.set()
            runner.join(30)


def test_test_produce_answers_in_the_page(page: Page, local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders", partitions=4)
    with console(page, local_broker) as base:
        page.goto(base + "/topics/orders")
        form = page.locator("#produce-form")
        form.get_by_label("Key").fill("order-42")
        form.get_by_label("Value").fill('{"state": "shipped"}')
        form.get_by_label("Headers").fill("source: console")
        form.get_by_role("button", name="Send").click()
        partition = redisq.partition_for_key(b"order-42", 4)
        [(offset, _)] = local_broker.client.xrange(local_broker.keys.log("orders", partition))
        expect(page.locator("#notice")).to_have_text(
            f"Sent: partition {partition}, offset {offset.decode()}, duplicate: no"
        )
        page.goto(base + f"/topics/orders/messages?partition={partition}&view=json")
        message = page.locator(f'article[data-offset="{offset.decode()}"]')
        expect(message).to_contain_text("order-42")
        expect(message).to_contain_text("console")
        expect(message.locator("pre.value")).to_contain_text('"state": "shipped"')


def test_read_only_console_has_no_buttons(page: Page, local_broker: redisq.Broker) -> None:
    local_broker.create_topic("orders")
    send(local_broker, "orders", 5)
    with local_broker.consumer("orders", group="billing", max_attempts=1) as consumer:
        consumer.run(lambda m: None, idle_timeout=0.3)
    with console(page, local_broker, read_only=True) as base:
        for path in (
            "/",
            "/topics/orders",
            "/topics/orders/groups/billing",
            "/topics/orders/groups/billing/deadletters",
        ):
            page.goto(base + path)
            expect(page.locator("header.top")).to_contain_text("read-only")
            expect(page.locator("form[method=post]")).to_have_count(0)
            expect(page.locator("button.action")).to_have_count(0)
            for name in ("Send", "Replay", "Release", "Reset offsets"):
                expect(page.get_by_role("button", name=name)).to_have_count(0)


def test_wrong_token_gets_401_and_a_post_without_csrf_403(
    page: Page, local_broker: redisq.Broker, allowed_errors: list[str]
) -> None:
    allowed_errors += ["status of 401", "status of 403"]
    local_broker.create_topic("orders")
    with console(page, local_broker, token="tok-3141") as base:
        response = page.goto(base + "/?token=wrong")
        assert response is not None and response.status == 401
        response = page.goto(base + "/topics/orders?token=tok-3141")
        assert response is not None and response.status == 200
        assert "token" not in page.url  # the redirect dropped it
        status = page.evaluate(
            """url => fetch(url, {method: "POST", body: new URLSearchParams({value: "x"})})
                   .then(r => r.status)""",
            base + "/topics/orders/produce",
        )
        assert status == 403
        assert local_broker.client.xlen(local_broker.keys.log("orders", 0)) == 0


def test_main_pages_render(page: Page, local_broker: redisq.Broker, tmp_path: Path) -> None:
    """Messages, producers and the metrics page as a user opens them (screenshots)."""
    local_broker.create_topic("orders", partitions=2)
    send(local_broker, "orders", 20)
    with local_broker.producer(idempotence="message_id") as producer:
        producer.send("orders", b'{"refund": 7}', key="order-7", message_id="refund-7")
    with console(page, local_broker) as base:
        page.goto(base + "/topics/orders/messages?message_id=refund-7&view=json")
        expect(page.locator("article.message")).to_have_count(1)
        expect(page.locator("article.message")).to_contain_text("refund-7")
        page.goto(base + "/topics/orders/messages?partition=0&view=json&count=5")
        shoot(page, "messages", tmp_path)
        page.goto(base + "/topics/orders/producers")
        expect(page.locator("#producer-states")).to_contain_text("browser-test")
        expect(page.locator("#dedup-buckets")).to_contain_text("current")
        shoot(page, "producers", tmp_path)
        response = page.goto(base + "/metrics")
        assert response is not None and response.status == 200
        assert "redisq_messages_produced_total" in page.content()


def test_transactions_and_schedules_move_live(
    page: Page, valkey_server: ServerProcess, local_broker: redisq.Broker, tmp_path: Path
) -> None:
    """A transaction left open by a killed producer shows up and goes with Sweep now; a delayed
    message shows its due time and disappears once a scheduler delivers it; a half message
    answered UNKNOWN appears, its check count rises, then it moves to the unresolved list. The
    live parts move without a reload."""
    from redisq.model.transactions import TxState
    from redisq.schedule.scheduler import Scheduler
    from tests.console.test_transactions_page import open_transaction_in_killed_process, when

    for topic in ("payments", "reminders", "digests"):
        local_broker.create_topic(topic, partitions=2)
    killed = open_transaction_in_killed_process(valkey_server.url, local_broker.namespace, 1000)
    with local_broker.producer() as producer:  # closed at once: nothing delivers them yet
        meta = producer.send("reminders", b"call back", key="cust-7", delay_ms=1_000)
        producer.send("digests", b"weekly digest", key="cust-7", delay_ms=3_600_000)
    [(_, due)] = local_broker.client.zrange(
        local_broker.keys.scheduled("reminders", meta.partition), 0, -1, withscores=True
    )
    with console(page, local_broker, refresh_ms=300) as base:
        page.goto(base + "/transactions")
        mark_page(page)
        killed_row = page.locator(f'#transactions tr[data-tx="{killed}"]')
        expect(killed_row).to_contain_text("payments-tx")
        expect(killed_row.locator("td").nth(1)).to_have_text("open")
        scheduled = page.locator(
            f'#scheduled-partitions tr[data-topic="reminders"][data-partition="{meta.partition}"]'
        )
        expect(scheduled.locator("td.scheduled")).to_have_text("1")
        expect(scheduled.locator("td.due")).to_have_text(when(int(due)))
        expect(page.locator("#scheduled-messages")).to_contain_text("call back")
        with Scheduler(local_broker, ["reminders"]):
            expect(scheduled).to_have_count(0, timeout=20_000)
        expect(page.locator("#scheduled-messages")).not_to_contain_text("call back")
        expect(page.locator("#scheduled-messages")).to_contain_text("weekly digest")
        expect(killed_row).to_contain_text("past: due for the sweeper", timeout=20_000)
        assert not_reloaded(page)
        page.get_by_role("button", name="Sweep now").click()
        expect(page.locator("#notice")).to_have_text("Swept: 1 transaction due")
        expect(page.locator(f'#transactions tr[data-tx="{killed}"]')).to_have_count(0)

        mark_page(page)
        options: Any = {"check_first_ms": 3_000, "check_interval_ms": 3_000, "max_checks": 2}
        unknown = lambda tx, messages: TxState.UNKNOWN  # noqa: E731
        with local_broker.producer(transactional_group="order-svc", check=unknown, **options) as tx:
            half = tx.send_in_transaction("payments", b"hold 42", key="order-42", local=unknown)
            half_row = page.locator(f'#transactions tr[data-tx="{half.transaction_id}"]')
            expect(half_row).to_contain_text("order-svc")
            expect(half_row.locator("td.checks")).to_have_text("1", timeout=20_000)
            shoot(page, "transactions", tmp_path)
            expect(half_row).to_have_count(0, timeout=20_000)
        moved = page.locator(f'#unresolved tr[data-tx="{half.transaction_id}"]')
        expect(moved).to_contain_text("payments/")
        expect(moved).to_contain_text("hold 42")
        assert not_reloaded(page)
    [delivered] = local_broker.read("reminders", meta.partition)
    assert delivered.value == b"call back"
    assert local_broker.client.hget(local_broker.keys.transaction(killed), "state") == b"aborted"
