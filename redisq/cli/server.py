"""`redisq server [start|status|stop]`, `redisq demo` and `redisq completion`."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click

from redisq.cli.common import (
    FAILED,
    NOT_FOUND,
    OK,
    USAGE,
    connection_options,
    plural,
    say,
    server_url,
    settings,
    warn,
)


@click.group("server", invoke_without_command=True)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=6380,
    show_default=True,
    help="Foreground server: the port.",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    help="Foreground server: keep its data here (default: keep none).",
)
@click.option("--aof", is_flag=True, help="Foreground server: appendonly yes (with --dir).")
@click.pass_context
def server(ctx: click.Context, port: int, directory: str | None, aof: bool) -> int | None:
    """The embedded valkey-server. Without a subcommand: one in the foreground until Ctrl-C,
    SIGTERM or SIGHUP (a throwaway unless --dir). start / status / stop / wipe manage the
    user's shared one, which every command uses when no --url or REDIS_URL is given."""
    if ctx.invoked_subcommand is not None:
        return None
    return _foreground(port, directory, aof)


def _foreground(port: int, directory: str | None, aof: bool) -> int:
    """The handlers go in before the server starts: with Python's default action a signal that
    lands while valkey-server starts would kill this process mid-way. A requested stop exits 0,
    as valkey-server and redis-server do on SIGTERM and SIGINT; a server that dies on its own
    exits 1. The server is killed by the kernel if this process is (PR_SET_PDEATHSIG)."""
    from redisq.server.embedded import start_child_server

    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop.set()

    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, request_stop) for signum in stop_signals}
    try:
        child = start_child_server(port, directory, appendonly=aof)
        try:
            if not stop.is_set():
                where = f", data in {child.data_dir}" if child.data_dir else ", keeping no data"
                say(
                    f"embedded valkey-server running: REDIS_URL={child.url}{where} (Ctrl-C to stop)"
                )
                click.get_text_stream("stdout").flush()
            while not stop.is_set() and child.running():
                stop.wait(0.2)
        finally:
            child.stop()  # SIGTERM, then SIGKILL after 5 s; waits for the process either way
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not stop.is_set():
        warn("redisq server: valkey-server exited on its own")
        return FAILED
    return OK


@server.command("start")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help="Listen on this port (default: a free one, recorded for every later command).",
)
def start(port: int | None) -> int:
    """Start the shared embedded server (if none runs) and say where it is."""
    from redisq.server.embedded import shared_server

    state, started = shared_server(port=port)
    say(
        f"embedded valkey-server {'started' if started else 'already running'}: "
        f"REDIS_URL={state.url} (pid {state.pid}, data in {state.data_dir})"
    )
    return OK


@server.command("status")
def status() -> int:
    """Whether the shared embedded server runs, where, and where its data lives (exit 3 when
    none runs)."""
    from redisq.server.embedded import home, server_status

    state = server_status()
    if state is None:
        say(f"no embedded valkey-server runs (its home: {home()})")
        return NOT_FOUND
    say(f"embedded valkey-server running: REDIS_URL={state.url}")
    say(f"pid {state.pid}, data in {state.data_dir}, log {state.log_file}")
    return OK


@server.command("stop")
def stop_command() -> int:
    """Stop the shared embedded server (its data stays for the next start)."""
    from redisq.server.embedded import stop_shared_server

    state = stop_shared_server()
    if state is None:
        say("no embedded valkey-server was running")
    else:
        say(f"stopped the embedded valkey-server (pid {state.pid}); data kept in {state.data_dir}")
    return OK


@server.command("wipe")
@click.option("--yes", is_flag=True, help="Wipe without asking (needed when stdin is no terminal).")
def wipe(yes: bool) -> int:
    """Delete every key of the shared embedded server (every namespace), or its data files when
    it is not running. Never touches the server of --url or REDIS_URL."""
    import redis

    from redisq.server.embedded import DATA_DIR, home, server_status

    if settings().url:
        raise click.UsageError(
            "server wipe wipes only the embedded valkey-server: drop --url (a configured "
            "server is never wiped by redisq)"
        )
    state = server_status()
    data = Path(state.data_dir) if state is not None else home() / DATA_DIR
    if state is not None:
        client = redis.Redis.from_url(state.url, socket_timeout=30)
        try:
            keys = _key_count(client)
            what = f"its {plural(keys, 'key')} (every namespace)"
            refused = _refused(yes, f"wipe the embedded valkey-server at {state.url}: {what}?")
            if refused is not None:
                return refused
            client.flushall()
        finally:
            client.close()
        say(f"wiped the embedded valkey-server at {state.url}: {plural(keys, 'key')} deleted")
    else:
        files = sorted(data.iterdir()) if data.is_dir() else []
        if not files:
            say(f"the embedded valkey-server has no data to wipe ({data})")
            return OK
        refused = _refused(yes, f"delete the embedded valkey-server's data files in {data}?")
        if refused is not None:
            return refused
        for path in files:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        say(f"wiped the embedded valkey-server's data in {data} (it was not running)")
    if os.environ.get("REDIS_URL"):
        say("the server of REDIS_URL was not touched")
    return OK


def _key_count(client: Any) -> int:
    keyspace = client.info("keyspace")
    return sum(int(db.get("keys", 0)) for db in keyspace.values() if isinstance(db, dict))


def _interactive() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, AttributeError):
        return False


def _refused(yes: bool, question: str) -> int | None:
    """None to go on: --yes, or a yes typed at a terminal. Else the exit code: 2 when there is
    no terminal to ask on (a script must say --yes), 1 when the answer was no."""
    if yes:
        return None
    if not _interactive():
        warn("redisq: server wipe: stdin is not a terminal: refusing to wipe without --yes")
        return USAGE
    if click.confirm(question, default=False, err=True):
        return None
    warn("redisq: nothing wiped")
    return FAILED


@click.command("demo")
@click.option(
    "--messages",
    type=click.IntRange(min=1),
    default=20_000,
    show_default=True,
    help="Messages to send.",
)
@click.option(
    "--keys", type=click.IntRange(min=1), default=200, show_default=True, help="Distinct keys."
)
@connection_options
def demo(messages: int, keys: int) -> int:
    """The mission end to end: ordered idempotent produce under connection chaos, message-id
    dedup, a consumer group losing a member, a Spark audit."""
    from redisq.cli.demo import run_demo

    return run_demo(server_url(), messages=messages, keys=keys)


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> int:
    """Print the shell completion script: eval "$(redisq completion bash)" (in ~/.bashrc),
    or the same for zsh; fish: redisq completion fish | source."""
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root().command  # the `redisq` group
    cls: Any = get_completion_class(shell)
    say(cls(root, {}, "redisq", "_REDISQ_COMPLETE").source())
    return OK
