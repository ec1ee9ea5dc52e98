"""What every command shares: exit codes, the connection options, tables, progress, output."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import click

import redisq

# Exit codes, documented in `redisq --help` and the README.
OK = 0
FAILED = 1  # the operation ran and failed or found faults
USAGE = 2  # bad arguments, or the command could not run (server unreachable or refusing)
NOT_FOUND = 3  # the topic or group does not exist
INTERRUPTED = 130  # Ctrl-C (SIGINT) stopped a command that has no clean stop of its own
BROKEN_PIPE = 141  # the reader of stdout went away (128 + SIGPIPE, as a Unix tool)

EXIT_CODES = f"""\b
Exit codes:
  {OK}    done (audit order: clean)
  {FAILED}    the operation failed or found faults: audit faults, messages that
       could not be sent, the demo's checks, refused by the data's state
       (topic exists, group has live members)
  {USAGE}    usage error, or could not run: bad arguments or names, server
       unreachable or refusing, Spark missing
  {NOT_FOUND}    not found: the topic or group does not exist (server status: none runs)
  {INTERRUPTED}  interrupted by Ctrl-C (consume and server stop on SIGINT, SIGTERM
       or SIGHUP and exit 0; produce stops on them, says what was written,
       and exits {INTERRUPTED})
  {BROKEN_PIPE}  stdout was closed by its reader (consume | head)"""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Connection:
    """--url / --namespace, given before or after the command name (the later wins)."""

    url: str | None = None
    namespace: str | None = None

    @property
    def resolved_url(self) -> str | None:
        return self.url or os.environ.get("REDIS_URL") or None

    @property
    def resolved_namespace(self) -> str:
        return self.namespace or os.environ.get("REDISQ_NAMESPACE") or "rq"


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is not None:
        connection = ctx.ensure_object(Connection)
        setattr(connection, str(param.name), value)
    return value


def connection_options(command: F) -> F:
    """--url and --namespace on a command (the root group has them too)."""
    command = click.option(
        "--namespace",
        expose_value=False,
        callback=_remember,
        help="Key namespace of the topics (default: REDISQ_NAMESPACE, else rq).",
    )(command)
    return click.option(
        "--url",
        expose_value=False,
        callback=_remember,
        metavar="URL",
        help="redis://, rediss://, redis+cluster://, redis+sentinel:// url (default: "
        "REDIS_URL, else the embedded valkey-server).",
    )(command)


def settings() -> Connection:
    return click.get_current_context().ensure_object(Connection)


def server_url() -> str:
    """The command line's url; with none, the embedded server's, started if none runs. Starting
    it is said in one short line on stderr; using the running one is not said at all (the
    library's longer notice is for programs, which have no `redisq server status`)."""
    chosen = settings().resolved_url
    if chosen:
        check_tls_port(chosen)
        return chosen
    from redisq.server.embedded import shared_server

    state, started = shared_server()
    if started:
        warn(
            f"redisq: started the embedded valkey-server on 127.0.0.1:{state.port}, "
            f"data in {state.data_dir}"
        )
    return state.url


def connect() -> redisq.Broker:
    """A broker for the command line's url (see server_url) and namespace."""
    return redisq.connect(server_url(), namespace=settings().resolved_namespace)


TLS_HANDSHAKE_TIMEOUT_S = 3.0


def check_tls_port(url: str) -> None:
    """A rediss:// url aimed at a plain port: the plain server waits for the end of a command
    line that the TLS hello never sends, so redis-py would wait out its 30 s socket timeout.
    One TLS handshake with a short timeout (certificates not checked: redis-py checks them
    next) says at once whether TLS answers there. Unreachable hosts are left to redis-py's
    own error."""
    scheme = url.partition("://")[0].lower()
    if scheme not in ("rediss", "rediss+cluster"):
        return
    import socket
    import ssl
    from urllib.parse import urlsplit

    from redisq.server.connection import redact_url

    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "localhost", parts.port or 6379
    except ValueError:
        return  # redis-py refuses it, naming only the redacted url
    try:
        raw = socket.create_connection((host, port), timeout=TLS_HANDSHAKE_TIMEOUT_S)
    except OSError:
        return
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(raw, server_hostname=host):
            return
    except (TimeoutError, ssl.SSLError, ConnectionError) as exc:
        import redis

        why = (
            f"none within {TLS_HANDSHAKE_TIMEOUT_S:g} s"
            if isinstance(exc, TimeoutError)
            else type(exc).__name__
        )
        raise redis.ConnectionError(
            f"cannot reach {redact_url(url)}: no TLS handshake at {host}:{port} ({why}): "
            "a plain port? use redis:// for a server without TLS"
        ) from None
    except OSError:
        return
    finally:
        raw.close()


# -- output --------------------------------------------------------------------------------------
def out() -> IO[str] | None:
    """stdout, or None when the process has none (started with stdout closed)."""
    return sys.stdout


def say(text: str = "") -> None:
    """A line on stdout (nothing when stdout is closed)."""
    stream = out()
    if stream is not None:
        stream.write(text + "\n")


def warn(text: str) -> None:
    """A line on stderr."""
    if sys.stderr is not None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class Progress:
    """A one-line progress bar on stderr, redrawn in place, only when stderr is a terminal.
    Elsewhere (a log, a pipe) nothing is drawn: with force, one summary line at the end."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        stream: IO[str] | None = None,
        force: bool = False,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.live = _isatty(self.stream)
        self.summary = force and not self.live
        self.count = 0
        self.start = time.monotonic()
        self._last = 0.0

    @property
    def enabled(self) -> bool:
        return self.live or self.summary

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.live:
            now = time.monotonic()
            if now - self._last >= 0.2:
                self._last = now
                self.stream.write("\r" + self._text(now))
                self.stream.flush()

    def _text(self, now: float) -> str:
        rate = self.count / max(now - self.start, 1e-9)
        if self.total:
            bar = "#" * int(min(self.count / self.total, 1.0) * 30)
            return f"{self.label} [{bar:<30}] {self.count:,}/{self.total:,} {rate:,.0f}/s"
        return f"{self.label} {self.count:,} {rate:,.0f}/s"

    def close(self) -> None:
        now = time.monotonic()
        if self.live:
            self.stream.write("\r" + self._text(now) + "\n")
        elif self.summary:
            self.stream.write(f"{self._text(now)} in {now - self.start:.1f} s\n")
        self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def print_table(
    rows: Sequence[Sequence[Any]], headers: Sequence[str], out: IO[str] | None = None
) -> None:
    """Columns padded to their widest cell, a rule under the headers."""
    out = out or sys.stdout
    if out is None:
        return
    cells = [[str(h) for h in headers]] + [
        ["" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def plural(count: int, noun: str, many: str | None = None) -> str:
    """ "1 partition", "2 partitions", "1,000 entries" (`many` for an irregular plural)."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f}s"
