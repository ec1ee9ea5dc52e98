"""The console's pages (GET) and actions (POST): each reads or acts through the batched
operations and the library calls, and hands a template its values (see app.py for how they are
served, guarded and turned into error pages)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from redis.exceptions import ResponseError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from redisq import metrics
from redisq.console.actions import (
    RESET_TARGETS,
    ResetRequest,
    parse_headers,
    release,
    replay,
    reset,
)
from redisq.console.browse import (
    VIEWS,
    Page,
    Search,
    browse,
    find_by_key,
    find_by_message_id,
    parse_bound,
    render_value,
)
from redisq.console.charts import line_chart, sparkline
from redisq.console.context import Console
from redisq.console.producers import dedup_buckets, named_producers, topic_producers
from redisq.console.search import MAX_COUNT, SCAN_LIMIT, by_key, by_message_id, by_time
from redisq.console.tail import read_tail, start_cursor
from redisq.consume.ownership import assign_partitions
from redisq.errors import InvalidConfig, read_reply
from redisq.model.topic import ENTRY_FORMATS
from redisq.protocol import Command, Operation, text
from redisq.protocol.overview import group_snapshot, topic_snapshot
from redisq.protocol.topics import entry_format_for
from redisq.protocol.transaction_admin import sweep_now
from redisq.protocol.waiting import (
    scheduled_messages,
    schedules,
    transactions_snapshot,
    unresolved_messages,
)

# Rows on the transactions & schedules page: the oldest transactions, the next due messages.
TRANSACTIONS_SHOWN = 500
SCHEDULED_SHOWN = 50
UNRESOLVED_SHOWN = 50
# The live tail: how often the page polls, how many messages it keeps, when it stops polling.
TAIL_INTERVAL_MS = 1000
TAIL_KEEP = 200
TAIL_MAX_MINUTES = 15


def form_value(form: list[tuple[str, str]], name: str, default: str = "") -> str:
    for key, value in form:
        if key == name:
            return value
    return default


# -- pages ---------------------------------------------------------------------------------------
def overview(console: Console, request: Request) -> Response:
    snapshot = console.snapshot()
    user = [t for t in snapshot.topics.values() if t.dead_letter_of is None]
    dead = [t for t in snapshot.topics.values() if t.dead_letter_of is not None]
    rates = {name: console.history.throughput(name) for name in snapshot.topics}
    current = {name: console.history.current_rate(name) for name in snapshot.topics}
    return console.render(
        request,
        "overview.html",
        {
            "active": "topics",
            "snapshot": snapshot,
            "topics": user,
            "dead_letter_topics": dead,
            "rates": rates,
            "current": current,
            "spark": sparkline,
            "entry_formats": ENTRY_FORMATS,
            # what create_topic gives a topic when not told (message entries on fakeredis)
            "default_entry_format": entry_format_for(None, console.broker.server == "fakeredis"),
        },
    )


def groups_page(console: Console, request: Request) -> Response:
    snapshot = console.snapshot()
    return console.render(request, "groups.html", {"active": "groups", "snapshot": snapshot})


def topic_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    snapshot = console.run(topic_snapshot(console.broker.keys, name, nodes=console.nodes()))
    topic = snapshot.topics[name]
    # The throughput is sampled from entries-added: on a batch topic, entries (batches) per second.
    rate = "entries/s" if topic.config.entry_format == "batch" else "messages/s"
    chart = line_chart({rate: console.history.throughput(name)}, title="Throughput", unit=rate)
    groups = [snapshot.groups[(name, g)] for g in topic.groups if (name, g) in snapshot.groups]
    return console.render(
        request,
        "topic.html",
        {"active": "topics", "topic": topic, "groups": groups, "chart": chart},
    )


def messages_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    q = request.query_params
    view = q.get("view", "text") if q.get("view") in VIEWS else "text"
    partition = int(q.get("partition") or 0)
    count = int(q.get("count") or 50)
    result: Page | Search
    title = ""
    if q.get("message_id"):
        result = find_by_message_id(console.broker, name, q["message_id"].encode())
        title = f"Message id {q['message_id']!r}: searched {result.where}"
    elif q.get("key"):
        key_partition = int(q["key_partition"]) if q.get("key_partition") else None
        result = find_by_key(
            console.broker, name, q["key"].encode(), count=count, partition=key_partition
        )
        title = f"Key {q['key']!r}: {len(result.messages)} found in {result.where}"
    else:
        if q.get("since") or q.get("until"):
            since = parse_bound(q.get("since"), time=True)
            until = parse_bound(q.get("until"), time=True)
            if until and not until.startswith("("):
                until = until.split("-")[0] + "-18446744073709551615"  # the whole millisecond
            start, end = since or ("-" if until else None), until
        else:
            start, end = parse_bound(q.get("start")), parse_bound(q.get("end"))
        result = browse(console.broker, name, partition, start=start, end=end, count=count)
    rendered = [(m, render_value(m.value, view)) for m in result.messages]
    return console.render(
        request,
        "messages.html",
        {
            "active": "topics",
            "config": config,
            "q": q,
            "view": view,
            "partition": partition,
            "count": count,
            "result": result,
            "rendered": rendered,
            "title": title,
            "view_query": urlencode(
                [(k, v) for k, v in q.multi_items() if k not in ("view", "notice", "fragment")]
            ),
        },
    )


def search_page(console: Console, request: Request) -> Response:
    """Search every partition by key, message id or time (search.py), bounded."""
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    q = request.query_params
    view = q.get("view", "text") if q.get("view") in VIEWS else "text"
    by = q.get("by", "key") if q.get("by") in ("key", "id", "time") else "key"
    raw_limit = (q.get("limit") or "100").strip()
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_COUNT:
        raise InvalidConfig(f"limit {raw_limit!r}: a whole number 1..{MAX_COUNT}")
    limit = int(raw_limit)
    wanted = q.get("q", "")
    result = None
    if by == "time" and (q.get("since") or q.get("until")):
        result = by_time(console.broker, name, q.get("since"), q.get("until"), limit=limit)
    elif by == "time" and "by" in q:
        raise InvalidConfig("a search by time needs since, until or both")
    elif by == "key" and wanted:
        result = by_key(
            console.broker,
            name,
            wanted.encode(),
            since=q.get("since"),
            until=q.get("until"),
            limit=limit,
        )
    elif by == "id" and wanted:
        result = by_message_id(console.broker, name, wanted.encode())
    rendered = [(m, render_value(m.value, view)) for m in result.messages] if result else []
    return console.render(
        request,
        "search.html",
        {
            "active": "topics",
            "config": config,
            "q": q,
            "by": by,
            "view": view,
            "limit": limit,
            "result": result,
            "rendered": rendered,
            "scan_limit": SCAN_LIMIT,
        },
    )


def tail_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    return console.render(
        request,
        "tail.html",
        {
            "active": "topics",
            "config": config,
            "cursor": start_cursor(console.broker, name),
            "interval_ms": TAIL_INTERVAL_MS,
            "keep": TAIL_KEEP,
            "max_minutes": TAIL_MAX_MINUTES,
        },
    )


def tail_next_page(console: Console, request: Request) -> Response:
    """One poll of the live tail: the messages after the cursor, as HTML to insert."""
    name = request.path_params["topic"]
    batch = read_tail(console.broker, name, request.query_params.get("cursor", ""))
    rendered = [(m, render_value(m.value, "text")) for m in batch.messages]
    return console.render(request, "tail_batch.html", {"batch": batch, "rendered": rendered})


def _pending_entries(
    console: Console, topic: str, group: str, partitions: list[int]
) -> dict[int, list[dict[str, Any]]]:
    """Up to 20 pending entries of each partition that has some (one pipelined round trip,
    through redis-py's xpending_range: a plain XPENDING command is parsed as the summary form)."""
    if not partitions:
        return {}
    pipe = console.broker.client.pipeline(transaction=False)
    for p in partitions:
        pipe.xpending_range(console.broker.keys.log(topic, p), group, "-", "+", 20)
    found = {}
    for p, reply in zip(partitions, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, ResponseError) and str(reply).startswith("NOGROUP"):
            continue  # the group was deleted since the snapshot: nothing is pending
        what = f"topic {topic!r} partition {p}: group {group!r}'s pending entries"
        entries = read_reply(reply, what)
        if entries:
            found[p] = [
                {
                    "offset": text(entry["message_id"]),
                    "consumer": text(entry["consumer"]),
                    "idle_ms": int(entry["time_since_delivered"]),
                    "deliveries": int(entry["times_delivered"]),
                }
                for entry in entries
            ]
    return found


def group_page(console: Console, request: Request) -> Response:
    topic, group = request.path_params["topic"], request.path_params["group"]
    snapshot = console.run(group_snapshot(console.broker.keys, topic, group))
    ordered = sorted(name for name, _ in snapshot.members)
    count = len(snapshot.partitions)
    assignment = {name: assign_partitions(count, ordered, name) for name in ordered}
    holding: dict[str, list[int]] = {}
    for p in snapshot.partitions:
        if p.holder:
            holding.setdefault(p.holder, []).append(p.partition)
    pending = _pending_entries(
        console, topic, group, [p.partition for p in snapshot.partitions if p.pending]
    )
    # A batch topic's lengths are the server's, in stream entries (producer batches): the page
    # says so. Lags are messages on every topic (a batch topic's from its counters, §14.6).
    batch = console.broker.topic_config(topic).entry_format == "batch"
    unit = "entries" if batch else "messages"
    chart = line_chart(console.history.lag(topic, group), title="Lag", unit="messages")
    return console.render(
        request,
        "group.html",
        {
            "active": "groups",
            "unit": unit,
            "g": snapshot,
            "assignment": assignment,
            "holding": holding,
            "pending": pending,
            "chart": chart,
            "reset_targets": RESET_TARGETS,
        },
    )


def _parked_keys(
    keys: Any, topic: str, group: str, partitions: int
) -> Operation[dict[int, dict[bytes, str]]]:
    """partition -> {parked key: offset of the dead letter that parked it}, pipelined (the
    library's deadletter.parked_keys reads one partition per round trip)."""
    replies = yield [
        Command(("HGETALL", keys.parked_keys(topic, p, group))) for p in range(partitions)
    ]
    found = {}
    for p, reply in enumerate(replies):
        if read_reply(reply, f"topic {topic!r} partition {p}: group {group!r}'s parked keys"):
            # Keys stay bytes: a message key need not be UTF-8.
            flat = iter(reply)
            items = reply.items() if isinstance(reply, dict) else zip(flat, flat, strict=True)
            found[p] = {bytes(k): text(v) for k, v in items}
    return found


def dead_letters_page(console: Console, request: Request) -> Response:
    from redisq.consume.deadletter import list_dead_letters

    topic, group = request.path_params["topic"], request.path_params["group"]
    snapshot = console.run(group_snapshot(console.broker.keys, topic, group))
    letters = list_dead_letters(console.broker, topic, group, count=500)
    parked = console.run(_parked_keys(console.broker.keys, topic, group, len(snapshot.partitions)))
    return console.render(
        request,
        "deadletters.html",
        {"active": "groups", "g": snapshot, "letters": letters, "parked": parked},
    )


def producers_page(console: Console, request: Request) -> Response:
    named = named_producers(console.broker)
    return console.render(request, "producers.html", {"active": "producers", "named": named})


def topic_producers_page(console: Console, request: Request) -> Response:
    name = request.path_params["topic"]
    config = console.broker.topic_config(name, refresh=True)
    named = named_producers(console.broker)
    states = topic_producers(console.broker, name, named)
    buckets = dedup_buckets(console.broker, name)
    return console.render(
        request,
        "topic_producers.html",
        {
            "active": "producers",
            "config": config,
            "states": states,
            "buckets": buckets,
            "named": [n for n in named if name in n.topics],
        },
    )


def transactions_page(console: Console, request: Request) -> Response:
    """Open and undone transactions (oldest first) with their check-backs, the half messages
    check-back gave up on, and delayed messages: per partition how many wait and when the next
    is due, and the next ones due. A fixed number of round trips at any size."""
    keys = console.broker.keys
    waiting = console.run(schedules(keys))
    transactions = console.run(transactions_snapshot(keys, limit=TRANSACTIONS_SHOWN))
    unresolved = console.run(unresolved_messages(keys, waiting.topics, UNRESOLVED_SHOWN))
    next_due = {(s.topic, s.partition): s.next_due_ms for s in waiting.partitions if s.next_due_ms}
    upcoming = console.run(scheduled_messages(keys, next_due, SCHEDULED_SHOWN))
    return console.render(
        request,
        "transactions.html",
        {
            "active": "transactions",
            "now_ms": transactions.now_ms,
            "tx": transactions,
            "unresolved": unresolved,
            "schedules": waiting,
            "upcoming": upcoming,
        },
    )


def metrics_page(console: Console, request: Request) -> Response:
    families = metrics.collect(console.broker)
    return PlainTextResponse(metrics.exposition(families), media_type=metrics.CONTENT_TYPE)


def login_page(console: Console, request: Request) -> Response:
    return console.render(
        request, "login.html", {"active": "", "next": request.query_params.get("next", "/")}
    )


# -- actions -------------------------------------------------------------------------------------
def produce_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic = request.path_params["topic"]
    meta = console.producers.send(
        topic,
        form_value(form, "value"),
        key=form_value(form, "key"),
        headers=parse_headers(form_value(form, "headers")),
        message_id=form_value(form, "message_id").strip(),
    )
    answer = (
        f"Sent: partition {meta.partition}, offset {meta.offset or 'unknown'}, "
        f"duplicate: {'yes' if meta.duplicate else 'no'}"
    )
    return f"/topics/{quote(topic)}", "ok", answer


def replay_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    offsets = [v for k, v in form if k == "offset" and v]
    if not offsets and form_value(form, "all") != "1":
        raise ValueError("choose dead letters to replay, or replay all")
    count = replay(console.broker, topic, group, offsets or None)
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}/deadletters",
        "ok" if count else "warn",
        f"Replayed {count} dead letter{'s' if count != 1 else ''} to {topic}"
        if count
        else "No dead letters to replay",
    )


def release_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    key = form_value(form, "key")
    count = release(console.broker, topic, group, key)
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}/deadletters",
        "ok" if count else "warn",
        f"Released key {key!r} on {count} partition(s)" if count else f"Key {key!r} was not parked",
    )


def reset_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    topic, group = request.path_params["topic"], request.path_params["group"]
    raw_partitions = form_value(form, "partitions").replace(" ", "")
    partitions = [int(p) for p in raw_partitions.split(",") if p] if raw_partitions else None
    request_ = ResetRequest(
        target=form_value(form, "target"),
        value=form_value(form, "value"),
        partitions=partitions,
        dry_run=form_value(form, "dry_run") == "1",
    )
    results = reset(console.broker, topic, group, request_)
    lines = "; ".join(
        f"p{r.partition}: {r.before or 'unread'} -> {r.after} (lag {r.lag_before} -> {r.lag_after}"
        + (f", {r.pending_dropped} pending entries dropped" if r.pending_dropped else "")
        + ")"
        for r in results
    )
    verb = "Would reset (dry run)" if request_.dry_run else "Reset"
    return (
        f"/topics/{quote(topic)}/groups/{quote(group)}",
        "ok",
        f"{verb} to {request_.target}: {lines}",
    )


def sweep_action(
    console: Console, request: Request, form: list[tuple[str, str]]
) -> tuple[str, str, str]:
    """What a transactional producer's sweeper does every second, now: abort open transactions
    past their timeout, carry out decided ones (the CLI's `redisq transactions sweep`)."""
    looked = console.run(sweep_now(console.broker.keys))
    return "/transactions", "ok", f"Swept: {looked} transaction{'s' if looked != 1 else ''} due"
