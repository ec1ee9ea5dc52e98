"""The `redisq` command line (click): topics, produce, consume, groups, lag, dead letters, the
embedded server, the demo and the Spark audits.

Every command takes --url (else REDIS_URL, else the user's embedded valkey-server) and
--namespace, before or after its name. Errors are one line on stderr and a documented exit
code (common.EXIT_CODES, shown by `redisq --help`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import click
import redis

from redisq.cli import (
    audit,
    console,
    groups,
    lag,
    messages,
    produce,
    scheduler,
    server,
    topics,
    transactions,
)
from redisq.cli.common import (
    BROKEN_PIPE,
    EXIT_CODES,
    FAILED,
    INTERRUPTED,
    NOT_FOUND,
    USAGE,
    Connection,
    Progress,
    connection_options,
    print_table,
    settings,
)
from redisq.errors import GroupNotFound, RedisqError, TopicExists, TopicInUse, TopicNotFound
from redisq.server.connection import redact_url

__all__ = ["Progress", "build_parser", "cli", "main", "print_table"]

_NOT_FOUND = (TopicNotFound, GroupNotFound)
_REFUSED = (TopicExists, TopicInUse)  # refused by the state of the data (GroupInUse is one)


class RedisqGroup(click.Group):
    """The root group: every error of a command becomes one line on stderr and its exit code
    (click's own usage errors are raised before and shown by main)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except click.exceptions.Exit:
            raise
        except _NOT_FOUND as exc:
            return _fail(NOT_FOUND, f"{type(exc).__name__}: {exc}")
        except _REFUSED as exc:
            return _fail(FAILED, f"{type(exc).__name__}: {exc}")
        except RedisqError as exc:
            return _fail(USAGE, f"{type(exc).__name__}: {exc}")
        except (redis.ConnectionError, redis.TimeoutError, ConnectionRefusedError) as exc:
            # redis-py's messages name host and port, never the password; ours are redacted.
            url = settings().resolved_url
            detail = str(exc)
            if not detail.startswith("cannot reach"):  # connect() names the redacted url
                where = redact_url(url) if url else "the server"
                detail = f"cannot reach {where}: {type(exc).__name__}: {detail}"
            return _fail(USAGE, detail)
        except redis.ResponseError as exc:  # e.g. NOPERM from an ACL user confined elsewhere
            return _fail(USAGE, f"the server refused: {type(exc).__name__}: {exc}")
        except BrokenPipeError:  # only stdout is a pipe we write to
            return _stdout_gone()
        except KeyboardInterrupt:
            return INTERRUPTED


def _fail(code: int, text: str) -> int:
    if sys.stderr is not None:
        sys.stderr.write(f"redisq: {text}\n")
    return code


def _stdout_gone() -> int:
    """The reader of stdout went away (consume | head): stop quietly; what is still buffered
    goes nowhere instead of raising again when Python flushes at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass
    return BROKEN_PIPE


@click.group(
    cls=RedisqGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES,
)
@click.version_option(package_name="redisq-broker", prog_name="redisq")
@connection_options
def cli() -> None:
    """redisq: an ordered, idempotent, partitioned message broker on Redis and Valkey.

    Without --url or REDIS_URL every command uses the user's embedded valkey-server (started
    on first use, its data kept; see `redisq server status`). Shell completion:
    eval "$(redisq completion bash)"."""
    click.get_current_context().ensure_object(Connection)


for _command in (
    topics.topic,
    produce.produce,
    messages.consume,
    groups.group,
    lag.lag,
    groups.dlq,
    transactions.transactions,
    audit.audit,
    scheduler.scheduler,
    console.console,
    server.server,
    server.demo,
    server.completion,
):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit code (see common.EXIT_CODES)."""
    logging.basicConfig(level=logging.WARNING, format="redisq: %(message)s")
    try:
        code = cli.main(args=argv, prog_name="redisq", standalone_mode=False)
    except click.ClickException as exc:  # usage errors: bad or missing arguments
        exc.show()
        return USAGE if isinstance(exc, click.UsageError) else exc.exit_code
    except click.exceptions.Abort:  # Ctrl-C outside a command
        return INTERRUPTED
    return code if isinstance(code, int) else 0


class _Parser:
    """Checks a command line without running it (argparse's parse_args shape: SystemExit(2) on
    a usage error); the tests check the docker compose commands with it."""

    def parse_args(self, argv: Sequence[str]) -> click.Context:
        try:
            ctx = cli.make_context("redisq", list(argv))
            command: click.Command = cli
            while isinstance(command, click.Group):
                rest = [*ctx._protected_args, *ctx.args]
                if not rest:
                    break
                _name, found, rest = command.resolve_command(ctx, rest)
                if found is None:
                    break
                command = found
                ctx = command.make_context(_name or "", rest, parent=ctx)
            return ctx
        except click.ClickException as exc:
            exc.show()
            raise SystemExit(USAGE) from None


def build_parser() -> _Parser:
    return _Parser()
