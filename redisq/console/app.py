"""The console's ASGI application: Starlette routes and the guard (security.py) around
everything. The pages and actions are in pages.py, what they share (rendering, notices, errors
as pages) in context.py.

Each page is one function that reads through the batched operations (redisq.protocol.overview,
producers.py, browse.py, schedules.py) in a worker thread (redis-py is synchronous) and renders
a template. A page's live block is the same template block rendered alone
(``?fragment=live``), which the page's script fetches every few seconds: numbers refresh without
a reload and without a second code path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from redisq.console.admin import create_topic_action, delete_topic_action, grow_topic_action
from redisq.console.context import HERE, Console
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
    search_page,
    sweep_action,
    tail_next_page,
    tail_page,
    topic_page,
    topic_producers_page,
    transactions_page,
)
from redisq.console.security import Credentials, Guard

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


def build_app(console: Console, credentials: Credentials, *, secret: bytes | None = None) -> Guard:
    """The Starlette app behind the guard; the sampler runs while the app is served."""

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
        Route("/topics/create", action(create_topic_action), methods=["POST"]),
        Route("/topics/{topic}", page(topic_page)),
        Route("/topics/{topic}/partitions", action(grow_topic_action), methods=["POST"]),
        Route("/topics/{topic}/delete", action(delete_topic_action), methods=["POST"]),
        Route("/topics/{topic}/messages", page(messages_page)),
        Route("/topics/{topic}/search", page(search_page)),
        Route("/topics/{topic}/tail", page(tail_page)),
        Route("/topics/{topic}/tail/next", page(tail_next_page)),
        Route("/topics/{topic}/producers", page(topic_producers_page)),
        Route("/topics/{topic}/groups/{group}", page(group_page)),
        Route("/topics/{topic}/groups/{group}/deadletters", page(dead_letters_page)),
        Route("/topics/{topic}/produce", action(produce_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/replay", action(replay_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/release", action(release_action), methods=["POST"]),
        Route("/topics/{topic}/groups/{group}/reset", action(reset_action), methods=["POST"]),
        Route("/transactions", page(transactions_page)),
        Route("/transactions/sweep", action(sweep_action), methods=["POST"]),
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
