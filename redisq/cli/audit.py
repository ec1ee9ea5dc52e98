"""`redisq audit order|skew|throughput|lag TOPIC`: the Spark analysis jobs (the [spark] extra);
spark_connector.commands runs them."""

from __future__ import annotations

import argparse

import click

from redisq.cli.common import USAGE, connection_options, print_table, server_url, settings, warn
from redisq.cli.spark_output import spark_log

# Imports no pyspark: the kinds and their help come from the connector.
from spark_connector.commands import AUDIT_KINDS


@click.group("audit")
def audit() -> None:
    """Spark analysis jobs: order, skew, throughput, lag, content (need the [spark] extra and
    Java 17). Each prints a table and writes a PNG; the topic and the server are checked before
    Spark starts. Exit 0: clean, 1: faults found (order, content), 2: could not run."""


def _make(kind: str, text: str) -> click.Command:
    @click.command(kind, help=f"{text[0].upper()}{text[1:]}, of TOPIC.")
    @click.argument("topic")
    @click.option("--group", help="lag: only this consumer group.")
    @click.option(
        "--plot",
        type=click.Path(dir_okay=False),
        help="The PNG to write (default: redisq-<kind>-<topic>.png).",
    )
    @click.option("--master", help="Spark master (default: local[*]; or SPARK_REMOTE).")
    @click.option(
        "--top",
        type=click.IntRange(min=1),
        default=10,
        show_default=True,
        help="skew: how many hot keys.",
    )
    @click.option(
        "--bucket-ms",
        type=click.IntRange(min=1),
        default=1000,
        show_default=True,
        help="throughput: bucket width in ms.",
    )
    @click.option(
        "--by",
        type=click.Choice(["hash", "message_id"]),
        default="hash",
        show_default=True,
        help="content: what makes two messages the same (key and value, or message id).",
    )
    @click.option(
        "--against",
        help="content: a source table (name, or parquet/csv/json path) to compare.",
    )
    @connection_options
    def command(
        topic: str,
        group: str | None,
        plot: str | None,
        master: str | None,
        top: int,
        bucket_ms: int,
        by: str,
        against: str | None,
    ) -> int:
        from spark_connector.commands import run_audit

        chosen = settings()
        args = argparse.Namespace(
            audit_kind=kind,
            topic=topic,
            group=group,
            plot=plot,
            master=master,
            top=top,
            bucket_ms=bucket_ms,
            by=by,
            against=against,
            url=server_url(),
            namespace=chosen.resolved_namespace,
        )
        with spark_log() as log:
            code = run_audit(args, print_table)
            if code == USAGE and (path := log.kept_when_written()) is not None:
                warn(f"redisq audit: Spark's own output is in {path}")
        return code

    return command


for _kind, _text in AUDIT_KINDS.items():
    audit.add_command(_make(_kind, _text))
