"""`redisq group list|describe|delete|reset-offsets` and `redisq dlq list|replay|release`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import click
import redis

from redisq.cli.common import (
    FAILED,
    OK,
    age,
    connect,
    connection_options,
    plural,
    print_table,
    say,
    warn,
)
from redisq.errors import GroupInUse, GroupNotFound, RedisqError, TopicNotFound
from redisq.protocol.groups import group_exists

F = TypeVar("F", bound=Callable[..., Any])


def topic_before_group(command: F) -> F:
    """Every command that names a topic and a group takes TOPIC GROUP, in that order. The other
    order (TOPIC names no topic, GROUP names one) is refused as a usage error that says so,
    not reported as a missing topic or group."""

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (TopicNotFound, GroupNotFound):
            topic, group_name = kwargs.get("topic"), kwargs.get("group_name")
            if topic and group_name and _swapped(topic, group_name):
                path = click.get_current_context().command_path
                raise click.UsageError(
                    f"the arguments are TOPIC GROUP: {topic!r} names no topic and "
                    f"{group_name!r} does ({path} {group_name} {topic} ...)"
                ) from None
            raise

    return checked  # type: ignore[return-value]


def _swapped(topic: str, group_name: str) -> bool:
    """TOPIC names no topic and GROUP names one."""

    def exists(name: str) -> bool:
        try:
            broker.topic_config(name, refresh=True)
        except (RedisqError, ValueError):  # TopicNotFound, or no valid topic name
            return False
        return True

    try:
        with connect() as broker:
            return not exists(topic) and exists(group_name)
    except (RedisqError, redis.RedisError):
        return False


def show(raw: bytes | None, limit: int | None = None) -> str:
    """Bytes for a table cell: UTF-8 text (escaped to one line), else hex; "-" for none."""
    from redisq.cli.messages import escape

    if raw is None:
        return "-"
    try:
        raw.decode()
        text = escape(raw)
    except UnicodeDecodeError:
        text = "0x" + raw.hex()
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


@click.group("group")
def group() -> None:
    """Consumer groups: list, describe, delete, reset offsets."""


@group.command("list")
@click.argument("topic", required=False)
@connection_options
def list_command(topic: str | None) -> int:
    """Groups (of TOPIC, or of every topic) with members, lag and pending."""
    with connect() as broker:
        rows = []
        for name, group_name in broker.list_groups(topic):
            d = broker.describe_group(name, group_name)
            lag = d.total_lag
            rows.append(
                (
                    name,
                    group_name,
                    d.mode,
                    len(d.members),
                    "?" if lag is None else lag,
                    d.total_pending,
                    d.dead_letter_messages,
                )
            )
    print_table(rows, ["topic", "group", "mode", "members", "lag", "pending", "dead letters"])
    return OK


@group.command("describe")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@connection_options
@topic_before_group
def describe(topic: str, group_name: str) -> int:
    """Members of GROUP on TOPIC; per partition: owner, lease, lag, pending, position, dead
    letters, parked keys, held messages, malformed entries and a blocked (poison) message."""
    with connect() as broker:
        d = broker.describe_group(topic, group_name)
    # Lags are messages, on a batch topic too (from its counters, DESIGN §14.6).
    total_lag = "?" if d.total_lag is None else f"{d.total_lag}"
    say(
        f"group {d.group} on {d.topic}: mode={d.mode}, start={d.start}, policy={d.policy}, "
        f"{plural(len(d.members), 'member')}, lag {total_lag}, "
        f"{d.total_held} held, {d.total_malformed} malformed, dead letters waiting: "
        f"{d.dead_letter_messages} in {d.dead_letter_topic or '-'}"
    )
    print_table(
        [(m.name, age(m.last_heartbeat_age_ms)) for m in d.members],
        ["member", "last heartbeat"],
    )
    rows = []
    for p in d.partitions:
        poison = ""
        if p.blocked_offset:
            poison = f"BLOCKED at {p.blocked_offset} ({p.blocked_attempts}x): {p.blocked_error}"
        rows.append(
            (
                p.partition,
                p.owner or "-",
                "-" if p.lease_token is None else p.lease_token,
                age(p.lease_age_ms),
                "?" if p.lag is None else p.lag,
                p.pending,
                p.last_delivered or "-",
                p.dead_letters,
                p.malformed,
                p.parked_keys,
                p.held,
                poison,
            )
        )
    print_table(
        rows,
        [
            "partition",
            "owner",
            "token",
            "lease age",
            "lag",
            "pending",
            "position",
            "dead-lettered",
            "malformed",
            "parked keys",
            "held",
            "poison",
        ],
    )
    return OK


@group.command("delete")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@click.option("--force", is_flag=True, help="Delete even while the group has live members.")
@click.option("--keep-dead-letters", is_flag=True, help="Keep the group's dead-letter topic.")
@connection_options
@topic_before_group
def delete(topic: str, group_name: str, force: bool, keep_dead_letters: bool) -> int:
    """Delete GROUP of TOPIC and everything it owns (positions, pending entries, leases, parked
    keys, its dead-letter topic)."""
    with connect() as broker:
        try:
            broker.delete_group(topic, group_name, force=force, keep_dead_letters=keep_dead_letters)
        except GroupInUse as exc:
            warn(f"redisq: GroupInUse: {exc}; or use --force")
            return FAILED
    say(f"deleted group {group_name} of {topic}")
    return OK


def _parse_datetime(value: str) -> datetime:
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected an ISO 8601 date-time, e.g. 2026-01-31T12:00:00 (local time) "
            "or 2026-01-31T12:00:00+00:00",
            param_hint="--to-datetime",
        ) from None


@group.command("reset-offsets")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@click.option("--to-earliest", is_flag=True, help="Read every retained message again.")
@click.option("--to-latest", is_flag=True, help="Skip to the end of every partition.")
@click.option(
    "--to-datetime",
    metavar="ISO",
    help="Read from the first message appended at or after this time (ISO 8601; without a "
    "zone: local time).",
)
@click.option("--to-offset", metavar="ID", help="Read from this offset (stream ID <ms>-<seq>) on.")
@click.option(
    "--shift-by",
    type=int,
    metavar="N",
    help="Move by N messages: +N skips N, -N reads the last N handled again.",
)
@click.option(
    "--partition",
    "partitions",
    type=click.IntRange(min=0),
    multiple=True,
    help="Only this partition (repeatable; default: all).",
)
@click.option("--dry-run", is_flag=True, help="Show what would change, change nothing.")
@connection_options
@topic_before_group
def reset(
    topic: str,
    group_name: str,
    to_earliest: bool,
    to_latest: bool,
    to_datetime: str | None,
    to_offset: str | None,
    shift_by: int | None,
    partitions: tuple[int, ...],
    dry_run: bool,
) -> int:
    """Move the committed position of GROUP on TOPIC (as kafka-consumer-groups
    --reset-offsets). Refused while the group has live members. The new position is the
    whole truth: a concurrent group's pending entries are dropped (those after it are
    delivered again)."""
    chosen = [to_earliest, to_latest, to_datetime, to_offset, shift_by]
    if sum(1 for c in chosen if c not in (None, False)) != 1:
        raise click.UsageError(
            "choose one of --to-earliest, --to-latest, --to-datetime, --to-offset, --shift-by"
        )
    when = _parse_datetime(to_datetime) if to_datetime is not None else None
    with connect() as broker:
        try:
            results = broker.reset_offsets(
                topic,
                group_name,
                to_earliest=to_earliest,
                to_latest=to_latest,
                to_datetime=when,
                to_offset=to_offset,
                shift_by=shift_by,
                partitions=list(partitions) or None,
                dry_run=dry_run,
            )
        except GroupInUse as exc:
            warn(f"redisq: GroupInUse: {exc}")
            return FAILED
    print_table(
        [
            (
                r.partition,
                "-" if r.before is None else r.before,
                r.after,
                "?" if r.lag_before is None else r.lag_before,
                "?" if r.lag_after is None else r.lag_after,
                r.pending_dropped,
            )
            for r in results
        ],
        [
            "partition",
            "position before",
            "position after",
            "lag before",
            "lag after",
            "pending entries dropped",
        ],
    )
    say(
        f"dry run: nothing changed in group {group_name} of {topic}"
        if dry_run
        else f"reset group {group_name} of {topic} on {plural(len(results), 'partition')}"
    )
    return OK


# -- dead letters --------------------------------------------------------------------------------
@click.group("dlq")
def dlq() -> None:
    """Dead letters: list, replay, release a parked key."""


@dlq.command("list")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@click.option("--max", "limit", type=click.IntRange(min=1), help="Show at most this many.")
@connection_options
@topic_before_group
def dlq_list(topic: str, group_name: str, limit: int | None) -> int:
    """The dead letters of GROUP on TOPIC, oldest first."""
    from redisq.consume.deadletter import list_dead_letters, require_dead_letters

    with connect() as broker:
        require_dead_letters(broker, topic, group_name)
        letters = list_dead_letters(broker, topic, group_name, count=limit)
    rows = [
        (
            d.message.offset,
            f"{d.partition}@{d.offset}",
            show(d.message.key, 40),
            d.attempts,
            show(d.error.encode(), 80),
            show(d.message.value, 40),
        )
        for d in letters
    ]
    print_table(rows, ["dlq offset", "from", "key", "attempts", "error", "value"])
    return OK


@dlq.command("replay")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@click.option("--all", "everything", is_flag=True, help="Replay every dead letter.")
@click.option(
    "--offset", "offsets", multiple=True, help="A dead-letter offset to replay (repeatable)."
)
@click.option("--key", help="Replay the dead letters of this key.")
@click.option("--to", "to_topic", help="Send them to this topic instead of where each came from.")
@connection_options
@topic_before_group
def dlq_replay(
    topic: str,
    group_name: str,
    everything: bool,
    offsets: tuple[str, ...],
    key: str | None,
    to_topic: str | None,
) -> int:
    """Send dead letters of GROUP on TOPIC back to the topic each came from (or --to), then
    drop them from the dead-letter topic."""
    from redisq.consume.deadletter import (
        list_dead_letters,
        replay_dead_letters,
        require_dead_letters,
    )

    if not everything and not offsets and key is None:
        raise click.UsageError("dlq replay needs --all, --offset or --key")
    raw_key = key.encode() if key is not None else None
    with connect() as broker:
        require_dead_letters(broker, topic, group_name)
        if to_topic is not None:
            broker.topic_config(to_topic, refresh=True)
        chosen = [
            d
            for d in list_dead_letters(broker, topic, group_name)
            if (not offsets or d.message.offset in offsets)
            and (raw_key is None or d.message.key == raw_key)
        ]
        count = replay_dead_letters(  # an offset that is no dead letter: InvalidConfig
            broker,
            topic,
            group_name,
            offsets=list(offsets) if offsets else None,
            key=raw_key,
            to_topic=to_topic,
        )
    targets: dict[str, int] = {}
    for d in chosen:
        target = to_topic or d.topic or topic
        targets[target] = targets.get(target, 0) + 1
    where = ", ".join(f"{n} to {t}" for t, n in sorted(targets.items()))
    say(f"replayed {plural(count, 'dead letter')}" + (f": {where}" if where else ""))
    return OK


@dlq.command("release")
@click.argument("topic")
@click.argument("group_name", metavar="GROUP")
@click.argument("key")
@connection_options
@topic_before_group
def dlq_release(topic: str, group_name: str, key: str) -> int:
    """Release KEY, parked by failure_policy=park_key in GROUP on TOPIC: its held messages go
    on."""
    from redisq.consume.deadletter import release_key

    with connect() as broker:
        broker.topic_config(topic, refresh=True)
        if not broker.run(group_exists(broker.keys, topic, group_name)):
            raise GroupNotFound(topic, group_name)
        count = release_key(broker, topic, group_name, key)
    say(f"released key {key!r} on {plural(count, 'partition')}")
    return OK
