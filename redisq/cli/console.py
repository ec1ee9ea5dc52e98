"""`redisq console`: the web console (redisq.console; pip install 'redisq-broker[console]')."""

from __future__ import annotations

import click

from redisq.cli.common import connection_options, server_url, settings
from redisq.console import BASIC_AUTH_ENV, DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV


@click.command("console")
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="Address to listen on. Beyond loopback a token or basic auth is required.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="Port to listen on.",
)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    metavar="TOKEN",
    help=f"Require this token (Authorization: Bearer, or ?token= once). Env: {TOKEN_ENV}.",
)
@click.option(
    "--basic-auth",
    envvar=BASIC_AUTH_ENV,
    metavar="USER:PASSWORD",
    help=f"Require HTTP basic auth. Env: {BASIC_AUTH_ENV}.",
)
@click.option("--read-only", is_flag=True, help="Show no action; refuse every POST.")
@click.option(
    "--sample-interval",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds between the samples of the throughput and lag charts.",
)
@connection_options
def console(
    host: str,
    port: int,
    token: str | None,
    basic_auth: str | None,
    read_only: bool,
    sample_interval: float,
) -> int:
    """Serve the web console over the namespace until Ctrl-C (SIGINT/SIGTERM): topics,
    messages, groups, dead letters, producers, transactions and schedules, with actions
    (hidden by --read-only) and Prometheus metrics at /metrics."""
    from redisq.console import main

    chosen = settings()
    argv = ["--namespace", chosen.resolved_namespace, "--host", host, "--port", str(port)]
    argv += ["--sample-interval", str(sample_interval)]
    argv += ["--url", server_url()]
    # An empty one is refused (InvalidConfig), not taken for "no authentication".
    if token is not None:
        argv += ["--token", token]
    if basic_auth is not None:
        argv += ["--basic-auth", basic_auth]
    if read_only:
        argv.append("--read-only")
    return main(argv)
