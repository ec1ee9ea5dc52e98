"""Topic administration from the console: create a topic, grow it (add partitions), delete it.

The broker's own methods do the work (Broker.create_topic, add_partitions, delete_topic), as
`redisq topic create / add-partitions / delete` do, so a button and a command can never
disagree. Every form value is checked before the broker is called: a bad number, a missing
confirmation or a name the broker would refuse changes nothing. What the broker refuses
(TopicExists, TopicInUse, InvalidConfig for a shrink) arrives as a typed error that the page
shows as a message (app.action).

Nothing half-done: create_topic validates every setting before it writes; add_partitions
creates the new streams before it raises the count (a failure leaves the topic as it was);
delete_topic checks for live members before it deletes anything (TopicInUse), and a delete
must be confirmed by typing the topic's name.
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.requests import Request

from redisq.console.context import Console
from redisq.console.pages import form_value
from redisq.errors import InvalidConfig
from redisq.model.keys import validate_name
from redisq.model.topic import ENTRY_FORMATS
from redisq.protocol.topics import MAX_PARTITIONS

Form = list[tuple[str, str]]
MAX_SETTING = 2**53 - 1  # the scripts' numbers are doubles (as Broker.create_topic says)


def int_field(
    form: Form, name: str, label: str, *, default: int | None, minimum: int, maximum: int
) -> int | None:
    """A whole number from the form, checked against its range (the value and the range in
    the message); blank gives the default."""
    raw = form_value(form, name).strip().replace("_", "").replace(",", "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidConfig(f"{label}: {raw!r} is not a whole number") from None
    if not minimum <= value <= maximum:
        raise InvalidConfig(f"{label}: {value} is out of range {minimum}..{maximum}")
    return value


def create_topic_action(console: Console, request: Request, form: Form) -> tuple[str, str, str]:
    name = form_value(form, "name").strip()
    validate_name("topic", name)  # a user topic: dead-letter topics are the library's to make
    partitions = int_field(
        form, "partitions", "Partitions", default=1, minimum=1, maximum=MAX_PARTITIONS
    )
    retention_ms = int_field(
        form, "retention_ms", "Retention (ms)", default=0, minimum=0, maximum=MAX_SETTING
    )
    retention_messages = int_field(
        form,
        "retention_messages",
        "Retention (messages)",
        default=0,
        minimum=0,
        maximum=MAX_SETTING,
    )
    dedup_window_ms = int_field(
        form,
        "dedup_window_ms",
        "Dedup window (ms)",
        default=None,
        minimum=1000,
        maximum=MAX_SETTING,
    )
    entry_format = form_value(form, "entry_format").strip() or None
    if entry_format is not None and entry_format not in ENTRY_FORMATS:
        raise InvalidConfig(
            f"Entry format: {entry_format!r} is not one of {', '.join(ENTRY_FORMATS)}"
        )
    config = console.broker.create_topic(
        name,
        partitions or 1,
        retention_ms=retention_ms or 0,
        retention_messages=retention_messages or 0,
        dedup_window_ms=dedup_window_ms,
        entry_format=entry_format,
    )
    plural = "s" if config.partitions != 1 else ""
    shown = f" ({config.entry_format} entries)"
    return (
        f"/topics/{quote(name, safe='')}",
        "ok",
        f"Created topic {name!r} with {config.partitions} partition{plural}{shown}",
    )


def grow_topic_action(console: Console, request: Request, form: Form) -> tuple[str, str, str]:
    topic = request.path_params["topic"]
    partitions = int_field(
        form, "partitions", "Partitions", default=None, minimum=1, maximum=MAX_PARTITIONS
    )
    if partitions is None:
        raise InvalidConfig("Partitions: give the new number of partitions")
    before = console.broker.topic_config(topic, refresh=True).partitions
    config = console.broker.add_partitions(topic, partitions)  # refuses a shrink: InvalidConfig
    return (
        f"/topics/{quote(topic, safe='')}",
        "ok",
        f"Topic {topic!r} grown from {before} to {config.partitions} partitions (keys now hash "
        "over the new count: order per key holds among messages sent with the same count)",
    )


def delete_topic_action(console: Console, request: Request, form: Form) -> tuple[str, str, str]:
    topic = request.path_params["topic"]
    if form_value(form, "confirm").strip() != topic:
        raise InvalidConfig(f"type the topic's name ({topic}) to confirm the delete")
    console.broker.topic_config(topic, refresh=True)  # TopicNotFound before anything else
    force = form_value(form, "force") == "1"
    groups = [group for _, group in console.broker.list_groups(topic)]
    console.broker.delete_topic(topic, force=force)  # TopicInUse while a group has live members
    console.history.forget(topic, groups)
    return (
        "/",
        "ok",
        f"Deleted topic {topic!r} with its consumer groups and their dead-letter topics"
        + (" (by force: its live members find nothing from their next read)" if force else ""),
    )
