"""The console's ASGI application: Starlette routes, server-rendered Jinja2 pages, and the guard
(security.py) around everything.

Each page is one function that reads through the batched operations (snapshot.py, producers.py,
browse.py) in a worker thread (redis-py is synchronous) and renders a template. A page's live
block is the same template block rendered alone (``?fragment=live``), which the page's script
fetches every few seconds: numbers refresh without a reload and without a second code path.

Errors are pages, never tracebacks: the server down (503), a missing topic or group (404), a
refused action (409 for a group with live members), bad input (400); anything else is logged
and shown as an internal error (500). No message shows a password from the url.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from redisq import metrics
from redisq.connection import redact_url
from redisq.console import actions, browse, charts, producers
from redisq.console.history import History, Sampler
from redisq.console.security import Credentials, Guard
from redisq.console.snapshot import (
    NamespaceSnapshot,
    group_snapshot,
    namespace_snapshot,
    topic_snapshot,
)
from redisq.errors import GroupNotFound, RedisqError, TopicInUse, TopicNotFound
from redisq.group import assign_partitions
from redisq.protocol import Command, Operation, run_operation, text

log = logging.getLogger("redisq.console")

HERE = Path(__file__).parent
MAX_NOTICES = 200

# The navigation. "Transactions & schedules" (DESIGN §11, §12) gets its page when those
# features land: its entry is shown as planned, with no route behind it.
NAV = [
    ("topics", "Topics", "/"),
    ("groups", "Groups", "/groups"),
    ("producers", "Producers", "/producers"),
    ("metrics", "Metrics", "/metrics"),
]
PLANNED_NAV = [("transactions", "Transactions & schedules")]


class Console:
    """What the pages share: the broker, the history of numbers, the console's producers, and
    the notices that actions leave for the page they redirect to."""

    def __init__(
        self,
        broker: Any,
        *,
        url: str | None,
        read_only: bool,
        sample_interval_s: float,
        refresh_ms: int,
    ) -> None:
        self.broker = broker
        self.url_shown = redact_url(url) if url else _describe_client(broker.client)
        self._secret_parts = _secret_parts(url)
        self.read_only = read_only
        self.refresh_ms = refresh_ms
        self.history = History()
        self.sampler = Sampler(self.history, self.snapshot, sample_interval_s)
        self.producers = actions.Producers(broker)
        self._notices: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(("html",)),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            when=_when, age=_age, ms=_duration, number=_number, preview=browse.preview, q=_q
        )

    # -- reads -----------------------------------------------------------------------------------
    def run(self, operation: Operation[Any]) -> Any:
        return run_operation(operation, self.broker.scripts.execute)

    def nodes(self) -> Callable[[str], str] | None:
        if not self.broker.is_cluster:
            return None
        client = self.broker.client

        def node(key: str) -> str:
            target = client.get_node_from_key(key)
            return f"{target.host}:{target.port}"

        return node

    def snapshot(self) -> NamespaceSnapshot:
        return self.run(namespace_snapshot(self.broker.keys, nodes=self.nodes()))

    # -- notices ---------------------------------------------------------------------------------
    def notice(self, kind: str, message: str, rows: list[Any] | None = None) -> str:
        key = secrets.token_urlsafe(8)
        with self._lock:
            self._notices[key] = {"kind": kind, "message": self.scrub(message), "rows": rows}
            while len(self._notices) > MAX_NOTICES:
                self._notices.popitem(last=False)
        return key

    def take_notice(self, key: str | None) -> dict[str, Any] | None:
        if not key:
            return None
        with self._lock:
            return self._notices.get(key)

    def scrub(self, message: str) -> str:
        """No secret from the url in anything shown."""
        for part in self._secret_parts:
            message = message.replace(part, "***")
        return message

    # -- rendering -------------------------------------------------------------------------------
    def render(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        template = self.env.get_template(name)
        values = {
            "request": request,
            "read_only": self.read_only,
            "csrf": request.scope.get("state", {}).get("csrf", ""),
            "namespace": self.broker.namespace,
            "server": self.broker.server,
            "url_shown": self.url_shown,
            "nav": NAV,
            "planned_nav": PLANNED_NAV,
            "refresh_ms": self.refresh_ms,
            "notice": self.take_notice(request.query_params.get("notice")),
            "sampling_error": self.history.last_error,
            **context,
        }
        fragment = request.query_params.get("fragment")
        if fragment and fragment in template.blocks:
            ctx = template.new_context(values)
            return HTMLResponse("".join(template.blocks[fragment](ctx)), status_code=status)
        return HTMLResponse(template.render(values), status_code=status)

    def error_page(self, request: Request, exc: BaseException) -> Response:
        status, title, message = self.describe_error(exc)
        if request.query_params.get("fragment"):
            return HTMLResponse(
                f'<p class="error" role="alert">{_escape(message)}</p>', status_code=status
            )
        return self.render(
            request, "error.html", {"title": title, "message": message, "active": ""}, status
        )

    def describe_error(self, exc: BaseException) -> tuple[int, str, str]:
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | ConnectionError):
            return (
                503,
                "Server unreachable",
                self.scrub(
                    f"Cannot reach the server at {self.url_shown}: {type(exc).__name__}: {exc}"
                ),
            )
        if isinstance(exc, TopicNotFound | GroupNotFound):
            return 404, "Not found", self.scrub(str(exc))
        if isinstance(exc, TopicInUse):
            return 409, "Refused", self.scrub(str(exc))
        if isinstance(exc, RedisqError | ValueError | TypeError):
            return 400, "Cannot do that", self.scrub(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, redis.RedisError):
            return 502, "Server error", self.scrub(f"The server answered: {exc}")
        log.error("console page failed", exc_info=exc)
        return 500, "Internal error", "Internal error: the console logged the details."


def _describe_client(client: Any) -> str:
    """Where a client given without a url points: host, port and db only (its connection
    options also hold the password)."""
    options = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if options and "host" in options:
        return f"redis://{options['host']}:{options.get('port', 6379)}/{options.get('db', 0)}"
    nodes = getattr(client, "get_primaries", None)
    if nodes is not None:
        return "cluster " + ", ".join(f"{n.host}:{n.port}" for n in nodes())
    return type(client).__name__


def _secret_parts(url: str | None) -> list[str]:
    if not url:
        return []
    parts = []
    try:
        password = urlsplit(url.split(",")[0]).password
    except ValueError:
        password = None
    if password:
        parts += [password, unquote(password)]
    for name, value in parse_qsl(urlsplit(url).query):
        if name.endswith("password") and value:
            parts.append(value)
    return sorted({p for p in parts if len(p) >= 1}, key=len, reverse=True)


def _escape(value: str) -> str:
    from html import escape

    return escape(value)


# -- template filters ----------------------------------------------------------------------------
def _when(ms: int | None) -> str:
    if not ms:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d} UTC"


def _duration(ms: int | None) -> str:
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms} ms"
    seconds = ms / 1000
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _age(ms: int | None) -> str:
    return "" if ms is None else _duration(ms) + " ago"


def _number(value: float | int | None) -> str:
    if value is None:
        return "?"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _q(value: str) -> str:
    return quote(value, safe="")


# -- routes --------------------------------------------------------------------------------------
Handler = Callable[[Console, Request], Response]


def page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A GET page: the handler runs in a worker thread; any error becomes an error page."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        console: Console = request.app.state.console
        try:
            return await run_in_threadpool(handler, console, request)
        except Exception as exc:
            return console.error_page(request, exc)

    return endpoint


ActionHandler = Callable[[Console, Request, list[tuple[str, str]]], tuple[str, str, str]]


def action(handler: ActionHandler) -> Callable[[Request], Awaitable[Response]]:
    """A POST action (the guard already checked auth, CSRF and read-only): the handler returns
    (where to go, kind, message); the page it redirects to shows the message (POST, redirect,
    GET: a reload never repeats the action). A failure is shown there the same way."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        console: Console = request.app.state.console
        form = parse_qsl((await request.body()).decode(), keep_blank_values=True)
        back = request.headers.get("referer") or "/"
        try:
            target, kind, message = await run_in_threadpool(handler, console, request, form)
            rows = None
        except Exception as exc:
            _status, _title, message = console.describe_error(exc)
            target, kind, rows = _same_site(back, request.url.path), "error", None
        key = console.notice(kind, message, rows)
        sep = "&" if "?" in target else "?"
        return RedirectResponse(f"{target}{sep}notice={key}", status_code=303)

    return endpoint


def _same_site(referer: str, fallback: str) -> str:
    parts = urlsplit(referer)
    path = parts.path or "/"
    query = "&".join(f"{k}={quote(v)}" for k, v in parse_qsl(parts.query) if k != "notice")
    if not path.startswith("/"):
        return fallback
    return path + ("?" + query if query else "")


def _form_value(form: list[tuple[str, str]], name: str, default: str = "") -> str:
    for key, value in form:
        if key == name:
            return value
    return default


# -- pages ---------------------------------------------------------------------------------------
def overview(console: Console, request: Request) -> Response:
    snapshot = console.snapshot()
    user = [t for t in snapshot.topics.values() if t.dead_letter_of is None]
    dead = [t for t in snapshot.topics.values() if t.dead_letter_of is not None]
    rates = {name: console.history.throughput(name) for name in snapshot.topics}
    return console.render(
        request,
        "overview.html",
        {
            "active": "topics",
            "snapshot": snapshot,
            "topics": user,
            "dead_letter_topics": dead,
            "rates": rates,
            "spark": charts.sparkline,
        },
    )


def groups_page(console: Console, request: Request) -> Response:
    snapshot = console.snapshot()
    return console.render(request, "groups.html", {"active": "groups", "snapshot": snapshot})


def topic_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    snapshot = console.run(topic_snapshot(console.broker.keys, name, nodes=console.nodes()))
    topic = snapshot.topics[name]
    chart = charts.line_chart(
        {"messages/s": console.history.throughput(name)}, title="Throughput", unit="messages/s"
    )
    groups = [snapshot.groups[(name, g)] for g in topic.groups if (name, g) in snapshot.groups]
    return console.render(
        request,
        "topic.html",
        {"active": "topics", "topic": topic, "groups": groups, "chart": chart},
    )


def messages_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    q = request.query_params
    view = q.get("view", "text") if q.get("view") in browse.VIEWS else "text"
    partition = int(q.get("partition") or 0)
    count = int(q.get("count") or 50)
    result: browse.Page | browse.Search
    title = ""
    if q.get("message_id"):
        result = browse.find_by_message_id(console.broker, name, q["message_id"].encode())
        title = f"Message id {q['message_id']!r}: searched {result.where}"
    elif q.get("key"):
        key_partition = int(q["key_partition"]) if q.get("key_partition") else None
        result = browse.find_by_key(
            console.broker, name, q["key"].encode(), count=count, partition=key_partition
        )
        title = f"Key {q['key']!r}: {len(result.messages)} found in {result.where}"
    else:
        if q.get("since") or q.get("until"):
            since = browse.parse_bound(q.get("since"), time=True)
            until = browse.parse_bound(q.get("until"), time=True)
            if until and not until.startswith("("):
                until = until.split("-")[0] + "-18446744073709551615"  # the whole millisecond
            start, end = since or ("-" if until else None), until
        else:
            start, end = browse.parse_bound(q.get("start")), browse.parse_bound(q.get("end"))
        result = browse.browse(console.broker, name, partition, start=start, end=end, count=count)
    rendered = [(m, browse.render_value(m.value, view)) for m in result.messages]
    return console.render(
        request,
        "messages.html",
        {
            "active": "topics",
            "config": config,
            "q": q,
            "view": view,
            "partition": partition,
            "count": count,
            "result": result,
            "rendered": rendered,
            "title": title,
            "view_query": urlencode(
                [(k, v) for k, v in q.multi_items() if k not in ("view", "notice", "fragment")]
            ),
        },
    )


def _pending_entries(
    console: Console, topic: str, group: str, partitions: list[int]
) -> dict[int, list[dict[str, Any]]]:
    """Up to 20 pending entries of each partition that has some (one pipelined round trip)."""
    keys = console.broker.keys

    def read() -> Operation[dict[int, list[dict[str, Any]]]]:
        replies = yield [
            Command(("XPENDING", keys.log(topic, p), group, "-", "+", 20)) for p in partitions
        ]
        found = {}
        for p, reply in zip(partitions, replies, strict=True):
            if isinstance(reply, Exception) or not reply:
                continue
            rows = []
            for entry in reply:
                if isinstance(entry, dict):
                    rows.append(
                        {
                            "offset": text(entry.get("message_id")),
                            "consumer": text(entry.get("consumer")),
                            "idle_ms": int(entry.get("time_since_delivered", 0)),
                            "deliveries": int(entry.get("times_delivered", 0)),
                        }
                    )
                else:
                    offset, consumer, idle, deliveries = entry
                    rows.append(
                        {
                            "offset": text(offset),
                            "consumer": text(consumer),
                            "idle_ms": int(idle),
                            "deliveries": int(deliveries),
                        }
                    )
            found[p] = rows
        return found

    return console.run(read()) if partitions else {}


def group_page(console: Console, request: Request) -> Response:
    topic, group = request.path_params["topic"], request.path_params["group"]
    snapshot = console.run(group_snapshot(console.broker.keys, topic, group))
    ordered = sorted(name for name, _ in snapshot.members)
    count = len(snapshot.partitions)
    assignment = {name: assign_partitions(count, ordered, name) for name in ordered}
    holding: dict[str, list[int]] = {}
    for p in snapshot.partitions:
        if p.holder:
            holding.setdefault(p.holder, []).append(p.partition)
    pending = _pending_entries(
        console, topic, group, [p.partition for p in snapshot.partitions if p.pending]
    )
    chart = charts.line_chart(console.history.lag(topic, group), title="Lag", unit="messages")
    return console.render(
        request,
        "group.html",
        {
            "active": "groups",
            "g": snapshot,
            "assignment": assignment,
            "holding": holding,
            "pending": pending,
            "chart": chart,
            "reset_targets": actions.RESET_TARGETS,
        },
    )


def _parked_keys(
    keys: Any, topic: str, group: str, partitions: int
) -> Operation[dict[int, dict[bytes, str]]]:
    """partition -> {parked key: offset of the dead letter that parked it}, pipelined (the
    library's deadletter.parked_keys reads one partition per round trip)."""
    replies = yield [
        Command(("HGETALL", keys.parked_keys(topic, p, group))) for p in range(partitions)
    ]
    found = {}
    for p, reply in enumerate(replies):
        if reply and not isinstance(reply, Exception):
            # Keys stay bytes: a message key need not be UTF-8.
            flat = iter(reply)
            items = reply.items() if isinstance(reply, dict) else zip(flat, flat, strict=True)
            found[p] = {bytes(k): text(v) for k, v in items}
    return found


def dead_letters_page(console: Console, request: Request) -> Response:
    from redisq.deadletter import list_dead_letters

    topic, group = request.path_params["topic"], request.path_params["group"]
    snapshot = console.run(group_snapshot(console.broker.keys, topic, group))
    letters = list_dead_letters(console.broker, topic, group, count=500)
    parked = console.run(_parked_keys(console.broker.keys, topic, group, len(snapshot.partitions)))
    return console.render(
        request,
        "deadletters.html",
        {"active": "groups", "g": snapshot, "letters": letters, "parked": parked},
    )


def producers_page(console: Console, request: Request) -> Response:
    named = producers.named_producers(console.broker)
    return console.render(request, "producers.html", {"active": "producers", "named": named})


def topic_producers_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    named = producers.named_producers(console.broker)
    states = producers.topic_producers(console.broker, name, named)
    buckets = producers.dedup_buckets(console.broker, name)
    return console.render(
        request,
        "topic_producers.html",
        {
            "active": "producers",
            "config": config,
            "states": states,
            "buckets": buckets,
            "named": [n for n in named if name in n.topics],
        },
    )


def metrics_page(console: Console, request: Request) -> Response:
    families = metrics.collect(console.broker)
    return PlainTextResponse(metrics.exposition(families), media_type=metrics.CONTENT_TYPE)


def login_page(console: Console, request: Request) -> Response:
    return console.render(
        request, "login.html", {"active": "", "next": request.query_params.get("next", "/")}
    )


# -- actions -------------------------------------------------------------------------------------
def produce_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic = request.path_params["topic"]
    meta = console.producers.send(
        topic,
        _form_value(form, "value"),
        key=_form_value(form, "key"),
        headers=actions.parse_headers(_form_value(form, "headers")),
        message_id=_form_value(form, "message_id").strip(),
    )
    answer = (
        f"Sent: partition {meta.partition}, offset {meta.offset or 'unknown'}, "
        f"duplicate: {'yes' if meta.duplicate else 'no'}"
    )
    return f"/topics/{quote(topic)}", "ok", answer


def replay_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    offsets = [v for k, v in form if k == "offset" and v]
    if not offsets and _form_value(form, "all") != "1":
        raise ValueError("choose dead letters to replay, or replay all")
    count = actions.replay(console.broker, topic, group, offsets or None)
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}/deadletters",
        "ok",
        f"Replayed {count} dead letter{'s' if count != 1 else ''} to {topic}",
    )


def release_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    key = _form_value(form, "key")
    count = actions.release(console.broker, topic, group, key)
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}/deadletters",
        "ok" if count else "warn",
        f"Released key {key!r} on {count} partition(s)" if count else f"Key {key!r} was not parked",
    )


def reset_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    raw_partitions = _form_value(form, "partitions").replace(" ", "")
    partitions = [int(p) for p in raw_partitions.split(",") if p] if raw_partitions else None
    request_ = actions.ResetRequest(
        target=_form_value(form, "target"),
        value=_form_value(form, "value"),
        partitions=partitions,
        dry_run=_form_value(form, "dry_run") == "1",
    )
    results = actions.reset(console.broker, topic, group, request_)
    lines = "; ".join(
        f"p{r.partition}: {r.before or 'unread'} -> {r.after} (lag {r.lag_before} -> {r.lag_after}"
        + (f", {r.pending_dropped} pending dropped" if r.pending_dropped else "")
        + ")"
        for r in results
    )
    verb = "Would reset (dry run)" if request_.dry_run else "Reset"
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}",
        "ok",
        f"{verb} to {request_.target}: {lines}",
    )


def build_app(console: Console, credentials: Credentials, *, secret: bytes | None = None) -> Guard:
    """The Starlette app behind the guard; the sampler runs while the app is served."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        console.sampler.start()
        try:
            yield
        finally:
            console.sampler.stop()
            await run_in_threadpool(console.producers.close)

    routes = [
        Route("/", page(overview)),
        Route("/groups", page(groups_page)),
        Route("/producers", page(producers_page)),
        Route("/metrics", page(metrics_page)),
        Route("/login", page(login_page)),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Route("/topics/{topic}", page(topic_page)),
        Route("/topics/{topic}/messages", page(messages_page)),
        Route("/topics/{topic}/producers", page(topic_producers_page)),
        Route("/topics/{topic}/groups/{group}", page(group_page)),
        Route("/topics/{topic}/groups/{group}/deadletters", page(dead_letters_page)),
        Route("/topics/{topic}/produce", action(produce_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/replay", action(replay_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/release", action(release_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/reset", action(reset_action), methods=["POST"]),
        # Transactions and schedules (DESIGN §11, §12): their pages are added here when those
        # features land in the library; until then the navigation shows them as planned.
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.console = console

    async def not_found(request: Request, exc: Exception) -> Response:
        return console.render(
            request,
            "error.html",
            {"title": "Not found", "message": f"No page at {request.url.path}", "active": ""},
            404,
        )

    app.add_exception_handler(404, not_found)
    return Guard(app, credentials, read_only=console.read_only, secret=secret)
