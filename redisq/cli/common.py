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
       or SIGHUP and exit 0)
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
        return self.namespace or "rq"


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
        help="Key namespace of the topics (default: rq).",
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


def connect() -> redisq.Broker:
    """A broker for the command line's url and namespace. With neither, the embedded server;
    its one-line notice (which server, where its data lives) is logged by redisq.embedded."""
    chosen = settings()
    return redisq.connect(chosen.resolved_url, namespace=chosen.resolved_namespace)


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
    """A one-line progress display on stderr (only when stderr is a terminal, or forced)."""

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
        self.enabled = force or self.stream.isatty()
        self.count = 0
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if self.enabled and now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.count / max(now - self.start, 1e-9)
        if self.total:
            done = self.count / self.total
            bar = "#" * int(done * 30)
            text = f"\r{self.label} [{bar:<30}] {self.count:,}/{self.total:,} {rate:,.0f}/s"
        else:
            text = f"\r{self.label} {self.count:,} {rate:,.0f}/s"
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        now = time.monotonic()
        if self.enabled:
            self._draw(now)
            self.stream.write("\n")
        self.stream.flush()


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


def age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f}s"
