"""`redisq transactions list|sweep|unresolved`: open and unfinished transactions, sweeping
now, and the half messages check-back gave up on."""

from __future__ import annotations

import click

from redisq.cli.common import OK, age, connect, connection_options, print_table, say
from redisq.model.keys import unresolved_topic


@click.group("transactions")
def transactions() -> None:
    """Open and unfinished transactions; unresolved half messages."""


@transactions.command("list")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Show at most this many.",
)
@connection_options
def list_transactions(limit: int) -> int:
    """Open transactions and decided ones not yet carried out, oldest first."""
    with connect() as broker:
        infos = broker.list_transactions(limit)
    rows = [
        (
            i.transaction_id,
            i.state,
            i.producer,
            i.group or "-",
            i.batches,
            age(i.age_ms),
            i.checks if i.group else "-",
        )
        for i in infos
    ]
    print_table(rows, ["transaction", "state", "producer", "group", "batches", "age", "checks"])
    say(f"{len(infos)} transactions")
    return OK


@transactions.command("sweep")
@connection_options
def sweep() -> int:
    """Abort open transactions past their timeout and finish decided ones, now (every
    transactional producer does this in the background)."""
    with connect() as broker:
        looked = broker.sweep_transactions()
    say(f"{looked} transactions were due")
    return OK


@transactions.command("unresolved")
@click.argument("group")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Show at most this many.",
)
@connection_options
def unresolved(group: str, limit: int) -> int:
    """The half messages of transactional group GROUP that check-back gave up on (the topic
    GROUP~unresolved), with where they were headed."""
    topic = unresolved_topic(group)
    with connect() as broker:
        if topic not in broker.list_topics():
            say(f"nothing unresolved in group {group}")
            return OK
        messages = list(broker.read(topic, 0, count=limit))
    rows = [
        (
            m.headers.get("redisq.tx", b"").decode(),
            m.headers.get("redisq.topic", b"").decode(),
            m.headers.get("redisq.partition", b"").decode(),
            m.key.decode(errors="replace") if m.key else "",
            m.value[:40].decode(errors="replace"),
            m.offset,
        )
        for m in messages
    ]
    print_table(rows, ["transaction", "topic", "partition", "key", "value", "offset"])
    return OK
