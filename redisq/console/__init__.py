"""`redisq console`: a web console over one namespace (pip install 'redisq-broker[console]').

Server-rendered pages (Starlette + Jinja2, served by uvicorn) for topics, messages, consumer
groups, dead letters, producers, and transactions & schedules, with live numbers, charts whose
history is kept in Redis (history.py), a search across partitions (search.py), a live tail
(tail.py), topic create / grow / delete (admin.py), test produce, dead-letter replay and
release, offset reset, sweeping transactions, and Prometheus metrics at /metrics
(redisq.metrics).

Safety: it binds to 127.0.0.1 by default; any other address needs a token or basic auth
(refused otherwise). --read-only shows no action, refuses every POST and writes nothing.
Actions are POSTs checked for CSRF. No password from the url appears on a page or in a log.

Embedding: `create_app(broker, ...)` returns the ASGI application; `serve(...)` runs it;
`main(argv)` is the command line (`redisq console`). Nothing here imports the web stack until
it is used: `import redisq.console` works without the extra, and the library never imports
this package (redisq.metrics reads through redisq.protocol.overview).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from redisq.errors import InvalidConfig

if TYPE_CHECKING:
    from redisq.broker import Broker

log = logging.getLogger("redisq.console")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
TOKEN_ENV = "REDISQ_CONSOLE_TOKEN"
BASIC_AUTH_ENV = "REDISQ_CONSOLE_BASIC_AUTH"

__all__ = ["create_app", "is_loopback", "main", "serve"]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; everything else (0.0.0.0 included) is reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _missing_extra(exc: ImportError) -> SystemExit:
    return SystemExit(
        f"redisq console needs the console extra: pip install 'redisq-broker[console]' ({exc})"
    )


def create_app(
    broker: Broker,
    *,
    token: str | None = None,
    basic_auth: str | tuple[str, str] | None = None,
    read_only: bool = False,
    url: str | None = None,
    sample_interval_s: float = 5.0,
    refresh_ms: int = 2000,
) -> Any:
    """The console as an ASGI application over `broker` (serve it with any ASGI server; the
    sampler of the charts runs during its lifespan). basic_auth: "user:password" or a pair.
    url: the server's url, shown redacted."""
    from redisq.console.app import Console, build_app
    from redisq.console.security import Credentials, parse_basic_auth

    basic = parse_basic_auth(basic_auth) if isinstance(basic_auth, str) else basic_auth
    if token is not None and not token:
        raise InvalidConfig("token must not be empty")
    console = Console(
        broker,
        url=url,
        read_only=read_only,
        sample_interval_s=sample_interval_s,
        refresh_ms=refresh_ms,
    )
    return build_app(console, Credentials(token=token, basic=basic))


def check_exposure(host: str, token: str | None, basic_auth: object) -> None:
    """Beyond loopback, a console without credentials would hand the broker to the network."""
    if not is_loopback(host) and not token and not basic_auth:
        raise InvalidConfig(
            f"--host {host} is reachable beyond this machine: set --token (or {TOKEN_ENV}) or "
            f"--basic-auth USER:PASSWORD (or {BASIC_AUTH_ENV})"
        )


def serve(
    url: str | None = None,
    namespace: str = "rq",
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    basic_auth: str | None = None,
    read_only: bool = False,
    *,
    sample_interval_s: float = 5.0,
) -> None:
    """Run the console until interrupted: url (else REDIS_URL, else the embedded server),
    namespace, where to listen, credentials (required beyond loopback), read-only."""
    import redisq
    from redisq.server.connection import redact_url, resolve_url

    check_exposure(host, token, basic_auth)
    try:
        import uvicorn
    except ImportError as exc:
        raise _missing_extra(exc) from None
    shown, _embedded = resolve_url(url)  # REDIS_URL or the embedded server's when None
    broker = redisq.connect(shown, namespace=namespace)
    try:
        app = create_app(
            broker,
            token=token,
            basic_auth=basic_auth,
            read_only=read_only,
            url=shown,
            sample_interval_s=sample_interval_s,
        )
    except ImportError as exc:
        raise _missing_extra(exc) from None
    where = f"[{host}]" if ":" in host else host
    log.warning(
        "redisq console on http://%s:%d for %s, namespace %s%s%s",
        where,
        port,
        redact_url(shown),
        namespace,
        " (read-only)" if read_only else "",
        " (auth required)" if token or basic_auth else "",
    )
    previous = _sigterm_as_interrupt()
    try:
        # access_log off: uvicorn would log query strings (a ?token= visit); the guard logs
        # method, path and status of every request instead.
        try:
            uvicorn.run(app, host=host, port=port, access_log=False, log_level="warning")
        except SystemExit as exc:  # uvicorn could not start (port in use, unknown host): it
            # logged why and exits 3, which the CLI documents as "not found"
            raise InvalidConfig(
                f"could not serve on {where}:{port} (uvicorn exited {exc.code})"
            ) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        broker.close()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _sigterm_as_interrupt() -> Any:
    """SIGTERM stops the console as Ctrl-C does, and it exits 0 as every redisq command. uvicorn
    shuts down gracefully on SIGTERM, restores the handler it found and raises the signal again:
    this handler turns that into KeyboardInterrupt (as it does a SIGTERM before uvicorn runs).
    Returns the previous handler (None off the main thread, where signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redisq console", description="A web console over a redisq namespace."
    )
    parser.add_argument("--url", default=None, help="server url (default: REDIS_URL or embedded)")
    parser.add_argument("--namespace", default="rq")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"require this token (or {TOKEN_ENV})"
    )
    parser.add_argument(
        "--basic-auth",
        default=os.environ.get(BASIC_AUTH_ENV),
        metavar="USER:PASSWORD",
        help=f"require basic auth (or {BASIC_AUTH_ENV})",
    )
    parser.add_argument("--read-only", action="store_true", help="show no actions")
    parser.add_argument(
        "--sample-interval", type=float, default=5.0, help="seconds between chart samples"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`redisq console [options]`; returns the exit status, as the CLI's: 0 stopped (Ctrl-C,
    SIGTERM), 2 could not run (bad options, exposure without credentials, server down)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        serve(
            args.url,
            args.namespace,
            args.host,
            args.port,
            args.token,
            args.basic_auth,
            args.read_only,
            sample_interval_s=args.sample_interval,
        )
    except InvalidConfig as exc:
        print(f"redisq console: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:  # the server is down
        from redisq.server.connection import redact_url

        shown = redact_url(args.url) if args.url else "REDIS_URL / the embedded server"
        print(f"redisq console: cannot reach {shown}: {type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
