"""The console's ASGI application: Starlette routes, server-rendered Jinja2 pages, and the guard
(security.py) around everything; the pages themselves are in pages.py.

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
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from redisq.connection import redact_url
from redisq.console import actions, browse
from redisq.console.history import History, Sampler
from redisq.console.security import Credentials, Guard
from redisq.console.snapshot import (
    NamespaceSnapshot,
    namespace_snapshot,
)
from redisq.errors import GroupNotFound, RedisqError, TopicInUse, TopicNotFound
from redisq.protocol import Operation, run_operation

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


def form_value(form: list[tuple[str, str]], name: str, default: str = "") -> str:
    for key, value in form:
        if key == name:
            return value
    return default


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

    from redisq.console.pages import (
        dead_letters_page,
        group_page,
        groups_page,
        login_page,
        messages_page,
        metrics_page,
        overview,
        produce_action,
        producers_page,
        release_action,
        replay_action,
        reset_action,
        topic_page,
        topic_producers_page,
    )

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
