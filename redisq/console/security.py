"""The console's guard: authentication, CSRF, read-only, and headers, in one ASGI middleware
that every request passes, so no route can forget a check.

* Authentication (when a token or basic auth is set): ``Authorization: Bearer <token>`` (what
  Prometheus sends with ``authorization``), ``Authorization: Basic`` (``basic_auth``), or the
  session cookie set by the login form or by one visit with ``?token=`` (redirected at once to
  the same address without it, so the token stays out of history and logs). The cookie holds
  an HMAC of the token under a per-process secret, never the token. Wrong or missing: 401.
* CSRF: every POST must carry the form field ``csrf`` equal to HMAC(secret, the ``redisq_csrf``
  cookie); the cookie is SameSite=Strict, so another site can neither send nor read it. An
  Origin header naming another host is refused too. Failure: 403, nothing done.
* Read-only: every POST other than the login is refused (403); the pages show no actions.
* Headers: a Content-Security-Policy that allows only the console's own script and styles,
  no framing, no referrer to other sites, no caching.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from redisq.errors import InvalidConfig

log = logging.getLogger("redisq.console")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SESSION_COOKIE = "redisq_session"
CSRF_COOKIE = "redisq_csrf"
CSRF_FIELD = "csrf"
MAX_FORM_BYTES = 1 << 20
LOGIN_PATH = "/login"
# The stylesheet and script (the login page needs them) and the icon browsers ask for.
PUBLIC_PATHS = ("/static/", "/favicon.ico")

SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make Origin "null"
    (b"cache-control", b"no-store"),
]


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request must show; both None means open (loopback only, see serve())."""

    token: str | None = None
    basic: tuple[str, str] | None = None  # (user, password)

    @property
    def required(self) -> bool:
        return self.token is not None or self.basic is not None


def parse_basic_auth(value: str) -> tuple[str, str]:
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise InvalidConfig("basic auth must be USER:PASSWORD, both non-empty")
    return user, password


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class Guard:
    """The ASGI middleware (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        credentials: Credentials,
        *,
        read_only: bool,
        secret: bytes | None = None,
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.read_only = read_only
        self._secret = secret or secrets.token_bytes(32)

    # -- tokens ----------------------------------------------------------------------------------
    def _sign(self, purpose: str, value: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}\0{value}".encode(), hashlib.sha256)
        return mac.hexdigest()

    def session_value(self) -> str:
        """The session cookie: it proves the token was shown without being the token."""
        return self._sign("session", self.credentials.token or "basic")

    def csrf_token(self, nonce: str) -> str:
        return self._sign("csrf", nonce)

    def token_ok(self, token: str) -> bool:
        return self.credentials.token is not None and _equal(token, self.credentials.token)

    def _authorized(self, headers: dict[str, str], cookies: dict[str, str]) -> bool:
        if not self.credentials.required:
            return True
        auth = headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and self.token_ok(value.strip()):
            return True
        if scheme.lower() == "basic" and self.credentials.basic is not None:
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
            expected_user, expected_password = self.credentials.basic
            return _equal(user, expected_user) & _equal(password, expected_password)
        session = cookies.get(SESSION_COOKIE)
        return session is not None and _equal(session, self.session_value())

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        cookies = _cookies(headers.get("cookie", ""))
        method = scope["method"]
        path = scope["path"]
        status = {"code": 0}
        new_cookies: list[str] = []

        nonce = cookies.get(CSRF_COOKIE)
        if not nonce or len(nonce) != 32:
            nonce = secrets.token_hex(16)
            new_cookies.append(_cookie(CSRF_COOKIE, nonce, scope))
        scope.setdefault("state", {})
        scope["state"]["csrf"] = self.csrf_token(nonce)
        scope["state"]["read_only"] = self.read_only
        scope["state"]["auth"] = self.credentials.required

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                extra = [(b"set-cookie", c.encode("latin-1")) for c in new_cookies]
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS, *extra]
            await send(message)

        try:
            await self._guarded(
                scope, receive, send_with_headers, headers, cookies, nonce, new_cookies
            )
        finally:
            log.info(
                "%s %s %d %.0f ms",
                method,
                path,
                status["code"],
                (time.perf_counter() - started) * 1000,
            )

    async def _guarded(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        cookies: dict[str, str],
        nonce: str,
        new_cookies: list[str],
    ) -> None:
        method, path = scope["method"], scope["path"]
        host = headers.get("host")
        if not self.credentials.required and host is not None and not _loopback_host(host):
            # A console without credentials listens on loopback; a page under another name
            # that resolves to 127.0.0.1 (DNS rebinding) would be same-origin with it.
            await _plain(
                send, 403, "This console has no credentials: it answers to localhost only."
            )
            return
        if path.startswith(PUBLIC_PATHS):
            await self.app(scope, receive, send)
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if method == "POST" and path == LOGIN_PATH:
            await self._login(scope, receive, send, headers, cookies, nonce, new_cookies)
            return
        if self.credentials.required and method == "GET" and "token" in query:
            if not self.token_ok(query["token"]):
                await self._unauthorized(scope, send)
                return
            new_cookies.append(_cookie(SESSION_COOKIE, self.session_value(), scope))
            rest = urlencode(
                [
                    (k, v)
                    for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"))
                    if k != "token"
                ]
            )
            # The same address, encoded again (scope["path"] is decoded: "%3F" is "?" there),
            # and never "//host", which a browser reads as another site.
            here = "/" + quote(path).lstrip("/")
            await _redirect(send, here + ("?" + rest if rest else ""))
            return
        if path == LOGIN_PATH and method == "GET":
            await self.app(scope, receive, send)
            return
        if not self._authorized(headers, cookies):
            await self._unauthorized(scope, send)
            return
        if method == "POST":
            if self.read_only:
                await _plain(send, 403, "This console is read-only: actions are disabled.")
                return
            body = await _read_body(receive)
            if body is None:
                await _plain(send, 413, "Form too large.")
                return
            if not self._csrf_ok(headers, cookies, body):
                await _plain(send, 403, "CSRF check failed: reload the page and try again.")
                return
            await self.app(scope, _replay(body), send)
            return
        if method not in ("GET", "HEAD"):
            await _plain(send, 405, "Method not allowed.")
            return
        await self.app(scope, receive, send)

    def _csrf_ok(self, headers: dict[str, str], cookies: dict[str, str], body: bytes) -> bool:
        origin = headers.get("origin")
        if origin and origin != "null":
            host = origin.split("://", 1)[-1]
            if host != headers.get("host"):
                return False
        elif origin == "null":
            return False
        nonce = cookies.get(CSRF_COOKIE)
        if not nonce:
            return False
        sent = dict(parse_qsl(body.decode("latin-1"))).get(CSRF_FIELD, "")
        return _equal(sent, self.csrf_token(nonce))

    async def _login(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        cookies: dict[str, str],
        nonce: str,
        new_cookies: list[str],
    ) -> None:
        body = await _read_body(receive)
        if body is None or not self._csrf_ok(headers, cookies, body):
            await _plain(send, 403, "CSRF check failed: reload the page and try again.")
            return
        form = dict(parse_qsl(body.decode("latin-1")))
        if not self.credentials.required:
            await _redirect(send, "/")
            return
        if not self.token_ok(form.get("token", "")):
            await self._unauthorized(scope, send)
            return
        new_cookies.append(_cookie(SESSION_COOKIE, self.session_value(), scope))
        await _redirect(send, _local_path(form.get("next", "/")))

    async def _unauthorized(self, scope: Scope, send: Send) -> None:
        challenge = (
            b'Basic realm="redisq console", charset="UTF-8"'
            if self.credentials.basic is not None
            else b'Bearer realm="redisq console"'
        )
        login = (
            '<p>Sign in with the console token:</p><form method="post" action="/login">'
            f'<input type="hidden" name="{CSRF_FIELD}" value="{scope["state"]["csrf"]}">'
            '<input type="password" name="token" autocomplete="current-password" autofocus> '
            '<button type="submit">Sign in</button></form>'
            if self.credentials.token is not None
            else ""
        )
        await _html(
            send,
            401,
            "<h1>401 Unauthorized</h1><p>This console needs a token or basic auth.</p>" + login,
            [(b"www-authenticate", challenge)],
        )


# -- helpers -------------------------------------------------------------------------------------
def _local_path(target: str) -> str:
    """target if it is a path of this console, else "/": browsers read "/\\host", "/<tab>/host"
    and "//host" as another site (they turn backslashes into slashes and drop tabs and
    newlines), so only printable ASCII without a backslash, one leading slash."""
    if (
        not target.startswith("/")
        or target.startswith("//")
        or "\\" in target
        or any(not 0x21 <= ord(c) <= 0x7E for c in target)
    ):
        return "/"
    return target


def _loopback_host(host: str) -> bool:
    """A Host header naming this machine's loopback: localhost, 127.0.0.0/8, [::1]."""
    name = host.strip()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _cookies(header: str) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # a malformed cookie header: no cookies
        return {}
    return {name: morsel.value for name, morsel in jar.items()}


def _cookie(name: str, value: str, scope: Scope) -> str:
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    return f"{name}={value}; Path=/; HttpOnly; SameSite=Strict{secure}"


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes) -> Receive:
    sent = {"done": False}

    async def receive() -> Message:
        if sent["done"]:
            return {"type": "http.disconnect"}
        sent["done"] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _html(
    send: Send, status: int, body_html: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>redisq console</title>'
        '<link rel="stylesheet" href="/static/console.css"><link rel="icon" href="data:,">'
        '</head><body><main class="narrow">'
        f"{body_html}</main></body></html>"
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-length", str(len(page)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": page})


async def _plain(send: Send, status: int, text: str) -> None:
    from html import escape

    await _html(send, status, f"<h1>{status}</h1><p>{escape(text)}</p><p><a href='/'>Back</a></p>")


async def _redirect(send: Send, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [(b"location", location.encode("latin-1")), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})
