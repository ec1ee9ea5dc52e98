"""What every page works with: the `Console` (the broker, the history of numbers, the console's
producers, the notices that actions leave), rendering a template or its live block alone
(``?fragment=live``), and errors described as pages.

Errors are pages, never tracebacks: the server down (503), a missing topic or group (404), a
refused action (409 for a group with live members), bad input (400); anything else is logged
and shown as an internal error (500). No message shows a password from the url.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from redisq.console.actions import Producers
from redisq.console.browse import preview
from redisq.console.history import ChartStore, History, Sampler
from redisq.errors import (
    GroupNotFound,
    ReadFailed,
    RedisqError,
    TopicExists,
    TopicInUse,
    TopicNotFound,
)
from redisq.protocol import Operation, run_operation
from redisq.protocol.overview import NamespaceSnapshot, namespace_snapshot
from redisq.server.connection import redact_url

log = logging.getLogger("redisq.console")

HERE = Path(__file__).parent
MAX_NOTICES = 200

NAV = [
    ("topics", "Topics", "/"),
    ("groups", "Groups", "/groups"),
    ("producers", "Producers", "/producers"),
    ("transactions", "Transactions & schedules", "/transactions"),
    ("metrics", "Metrics", "/metrics"),
]


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
        self.history = History(
            store=ChartStore(broker, write=not read_only), interval_s=sample_interval_s
        )
        self.sampler = Sampler(self.history, self.snapshot, sample_interval_s)
        self.producers = Producers(broker)
        self._notices: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(("html",)),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            when=_when, age=_age, ms=_duration, number=_number, preview=preview, q=_q
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
        """Topics and groups for the overview, the groups page and the charts' samples (the
        schedules are read by the pages that show them)."""
        return self.run(
            namespace_snapshot(self.broker.keys, with_schedules=False, nodes=self.nodes())
        )

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
        if isinstance(exc, ReadFailed):  # a command of the page's read answered an error
            unreachable = isinstance(exc.cause, redis.ConnectionError | redis.TimeoutError)
            title = "Server unreachable" if unreachable else "Server error"
            return 503 if unreachable else 502, title, self.scrub(str(exc))
        if isinstance(exc, TopicNotFound | GroupNotFound):
            return 404, "Not found", self.scrub(str(exc))
        if isinstance(exc, TopicInUse | TopicExists):
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
