"""`redisq topic create|describe|list|add-partitions|trim|delete`."""

from __future__ import annotations

from datetime import UTC, datetime

import click
from click.core import ParameterSource

from redisq.cli.common import (
    FAILED,
    OK,
    connect,
    connection_options,
    plural,
    print_table,
    say,
    warn,
)
from redisq.errors import TopicInUse
from redisq.model.topic import DEFAULT_ENTRY_FORMAT, ENTRY_FORMATS, TopicConfig


@click.group("topic")
def topic() -> None:
    """Create, describe, list, grow, trim and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option(
    "--partitions", type=click.IntRange(min=1), default=1, show_default=True, help="Partitions."
)
@click.option(
    "--retention-ms", type=click.IntRange(min=0), default=0, help="Trim by age (0: keep)."
)
@click.option(
    "--retention-messages",
    type=click.IntRange(min=0),
    default=0,
    help="Trim by count per partition (0: keep).",
)
@click.option(
    "--dedup-window-ms",
    type=click.IntRange(min=1000),
    help="How long message ids are remembered (default: the retention age, else 24 h).",
)
@click.option(
    "--entry-format",
    type=click.Choice(ENTRY_FORMATS),
    help=f"batch (default: {DEFAULT_ENTRY_FORMAT}): one stream entry per producer batch, each "
    "message at its own offset ms-(s+i) (DESIGN §14); message: one entry per message (any "
    "Redis client reads it).",
)
@click.option(
    "--exist-ok",
    is_flag=True,
    help="An existing topic with the same partition count (and the other options given) is not "
    "an error.",
)
@connection_options
def create(
    name: str,
    partitions: int,
    retention_ms: int,
    retention_messages: int,
    dedup_window_ms: int | None,
    entry_format: str | None,
    exist_ok: bool,
) -> int:
    """Create topic NAME."""
    with connect() as broker:
        config = broker.create_topic(
            name,
            partitions=partitions,
            retention_ms=retention_ms,
            retention_messages=retention_messages,
            dedup_window_ms=dedup_window_ms,
            entry_format=entry_format,
            exist_ok=exist_ok,
        )
    if exist_ok:
        differences = _differences(config, partitions, retention_ms, retention_messages)
        if differences:
            warn(
                f"redisq: TopicExists: topic {name!r} exists with {', '.join(differences)}: "
                "nothing changed (topic add-partitions grows it)"
            )
            return FAILED
    shown = f"entry_format={config.entry_format}"
    say(f"topic {config.name}: {plural(config.partitions, 'partition')}, {shown}")
    return OK


def _differences(
    config: TopicConfig, partitions: int, retention_ms: int, retention_messages: int
) -> list[str]:
    """What an existing topic has other than asked: the partition count always, the retention
    and dedup window when given on the command line (their defaults ask nothing)."""
    ctx = click.get_current_context()
    given = {
        name
        for name in ("retention_ms", "retention_messages", "dedup_window_ms", "entry_format")
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT
    }
    differences = []
    if config.partitions != partitions:
        differences.append(f"{plural(config.partitions, 'partition')}, not {partitions}")
    if "retention_ms" in given and config.retention_ms != retention_ms:
        differences.append(f"retention_ms={config.retention_ms}, not {retention_ms}")
    if "retention_messages" in given and config.retention_messages != retention_messages:
        differences.append(
            f"retention_messages={config.retention_messages}, not {retention_messages}"
        )
    dedup = ctx.params["dedup_window_ms"]
    if "dedup_window_ms" in given and config.dedup_window_ms != dedup:
        differences.append(f"dedup_window_ms={config.dedup_window_ms}, not {dedup}")
    entry_format = ctx.params["entry_format"]
    if "entry_format" in given and config.entry_format != entry_format:
        differences.append(f"entry_format={config.entry_format}, not {entry_format}")
    return differences


@topic.command("describe")
@click.argument("name")
@connection_options
def describe(name: str) -> int:
    """Partitions of topic NAME: lengths, first and last offsets, delayed messages scheduled
    and when the next is due (and nodes of a cluster). A length is the stream's entries (XLEN):
    on a batch topic an entry holds a producer batch, so the messages are shown beside it (as
    its counters tell; "?" where they cannot, DESIGN §14.6)."""
    with connect() as broker:
        description = broker.describe_topic(name)
        cluster = broker.is_cluster
    c = description.config
    batch = c.entry_format == "batch"
    total = f"{description.total_messages:,} messages"
    if batch:
        unknown = any(p.messages is None for p in description.partitions)
        total = (
            f"{'at least ' if unknown else ''}{total} in "
            f"{plural(description.total_entries, 'entry', 'entries')}"
        )
    say(
        f"topic {c.name} (id {c.topic_id}): {plural(c.partitions, 'partition')}, "
        f"entry_format={c.entry_format}, "
        f"retention_ms={c.retention_ms or 'none'}, "
        f"retention_messages={c.retention_messages or 'none'}, "
        f"dedup_window_ms={c.dedup_window_ms}, {total}, "
        f"{description.total_scheduled:,} scheduled"
    )
    rows = [
        (p.partition, p.length)
        + (("?" if p.messages is None else p.messages,) if batch else ())
        + (p.first_offset, p.last_offset, p.scheduled, _utc(p.next_due_ms))
        + ((p.node,) if cluster else ())
        for p in description.partitions
    ]
    headers = ["partition", "length (entries)", "messages"] if batch else ["partition", "length"]
    headers += ["first offset", "last offset", "scheduled", "next due"]
    headers += ["node"] if cluster else []
    print_table(rows, headers)
    return OK


def _utc(ms: int | None) -> str:
    """A due time (server clock, ms) as an ISO-8601 UTC time to the millisecond."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


@topic.command("list")
@connection_options
def list_topics() -> int:
    """Topic names, one per line (dead-letter topics too: <topic>~dlq~<group>)."""
    with connect() as broker:
        names = broker.list_topics()
    for name in names:
        say(name)
    return OK


@topic.command("add-partitions")
@click.argument("name")
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    required=True,
    help="The new partition count (grow only).",
)
@connection_options
def add_partitions(name: str, partitions: int) -> int:
    """Grow topic NAME to --partitions partitions (keys then route differently)."""
    with connect() as broker:
        config = broker.add_partitions(name, partitions)
    say(
        f"topic {config.name}: {plural(config.partitions, 'partition')} "
        "(keys now route differently)"
    )
    return OK


@topic.command("trim")
@click.argument("name")
@connection_options
def trim(name: str) -> int:
    """Apply topic NAME's retention to every partition now."""
    with connect() as broker:
        before = broker.describe_topic(name)
        removed = broker.trim(name)
        after = broker.describe_topic(name) if before.config.entry_format == "batch" else None
    entries = plural(removed, "entry", "entries")
    if after is None:
        say(f"topic {name}: {entries} past retention removed")
        return OK
    # batch entries: the messages are told by the counters (trimmed before and after)
    counts = [
        (b.trimmed, a.trimmed) for b, a in zip(before.partitions, after.partitions, strict=False)
    ]
    if any(b is None or a is None for b, a in counts):
        say(f"topic {name}: {entries} past retention removed (messages not counted)")
        return OK
    messages = sum((a or 0) - (b or 0) for b, a in counts)
    say(f"topic {name}: {plural(messages, 'message')} in {entries} past retention removed")
    return OK


@topic.command("delete")
@click.argument("name")
@click.option(
    "--force", is_flag=True, help="Delete even while a group of the topic has live members."
)
@connection_options
def delete(name: str, force: bool) -> int:
    """Delete topic NAME and everything it owns (groups, positions, dead-letter topics)."""
    with connect() as broker:
        try:
            broker.delete_topic(name, force=force)
        except TopicInUse as exc:
            shown = ", ".join(exc.members[:5]) + (" ..." if len(exc.members) > 5 else "")
            warn(
                f"redisq: TopicInUse: group {exc.group!r} of topic {name!r} has live members "
                f"({shown}): stop them, or use --force"
            )
            return FAILED
    say(f"deleted topic {name}")
    return OK
