"""redisq's numbers as Prometheus metrics, with no dependency on the console or a client library.

    import redisq, redisq.metrics
    broker = redisq.connect()
    text = redisq.metrics.exposition(redisq.metrics.collect(broker))   # Prometheus text format

`collect(broker)` reads what Redis already counts for the namespace, in a few pipelined round
trips (redisq.inspect): every partition's appended-entries counter and length, every
group's committed entries, lag and pending entries per partition, each lease (holder, time left)
and how many times it was granted (its fencing counter), the dead letters, malformed entries,
blocked messages, parked keys and held messages the commits record, and the dead-letter topics'
lengths. These are the truth shared by every process, so one scrape of one console is enough.

Numbers only a client knows (a consumer's handler failures and retries, its lease losses, its
fenced commits) come from the consumers and producers passed to `collect(clients=...)` or
registered with `track()`; they carry the labels group and member (consumers) or producer.

Names follow Prometheus conventions: a `redisq_` prefix, `_total` on counters, base units
(seconds), one label set per series, label values escaped as the text format requires.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redisq.protocol import run_operation

if TYPE_CHECKING:
    from redisq.broker import Broker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

__all__ = [
    "CONTENT_TYPE",
    "MetricFamily",
    "collect",
    "exposition",
    "track",
    "untrack",
]


@dataclass(slots=True)
class MetricFamily:
    """One metric: name, type ("counter" or "gauge"), help, and samples (labels, value)."""

    name: str
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float | None, **labels: Any) -> None:
        if value is not None:
            self.samples.append(({k: str(v) for k, v in labels.items()}, float(value)))


class _Families:
    def __init__(self) -> None:
        self._by_name: dict[str, MetricFamily] = {}

    def __call__(self, name: str, kind: str, help_text: str) -> MetricFamily:
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = MetricFamily(name, kind, help_text)
        return family

    def all(self) -> list[MetricFamily]:
        return list(self._by_name.values())


# -- clients registered by those who embed redisq ------------------------------------------------
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_tracked_lock = threading.Lock()


def track(client: Any) -> None:
    """Include a Consumer's (or Producer's) own counters in every collect() of this process.
    Held weakly: a closed, dropped client disappears from the metrics."""
    with _tracked_lock:
        _tracked.add(client)


def untrack(client: Any) -> None:
    with _tracked_lock:
        _tracked.discard(client)


# ConsumerStats field -> (metric name, help). The library counts these (redisq.stats).
CONSUMER_COUNTERS = {
    "handled": ("redisq_consumer_messages_handled_total", "Messages handled (handler returned)."),
    "failures": ("redisq_consumer_handler_failures_total", "Handler calls that raised."),
    "retries": ("redisq_consumer_retries_total", "Messages retried after a failure."),
    "dead_letters": ("redisq_consumer_dead_letters_total", "Messages this member dead-lettered."),
    "malformed": ("redisq_consumer_malformed_total", "Foreign entries handed to the policy."),
    "leases_acquired": ("redisq_consumer_lease_grants_total", "Partition leases granted."),
    "leases_lost": ("redisq_consumer_lease_losses_total", "Partition leases lost (not released)."),
    "fenced_commits": ("redisq_consumer_fenced_commits_total", "Commits refused: lease lost."),
    "commits": ("redisq_consumer_commits_total", "Positions committed."),
    "rebalances": ("redisq_consumer_rebalances_total", "Assignment changes seen."),
}
# Producer counters, read when the producer has a `stats` object with these fields (the
# library does not count them yet: see the console's report).
PRODUCER_COUNTERS = {
    "sent": ("redisq_producer_messages_sent_total", "Messages accepted by send/send_async."),
    "acknowledged": ("redisq_producer_messages_acknowledged_total", "Messages acknowledged."),
    "duplicates": ("redisq_producer_duplicates_total", "Messages answered as duplicates."),
    "retries": ("redisq_producer_batch_retries_total", "Batches sent again."),
    "fenced": ("redisq_producer_fenced_total", "Batches refused: ProducerFenced."),
    "failed": ("redisq_producer_messages_failed_total", "Messages failed (delivery timeout...)."),
    "transactions_committed": (
        "redisq_producer_transactions_committed_total",
        "Transactions committed.",
    ),
    "transactions_aborted": ("redisq_producer_transactions_aborted_total", "Transactions aborted."),
}


def _client_families(families: _Families, clients: Iterable[Any]) -> None:
    for client in clients:
        stats = getattr(client, "stats", None)
        if stats is None:
            continue
        group = getattr(client, "group", None)
        if group is not None:  # a consumer
            labels = {"group": group, "member": getattr(client, "name", "")}
            for attribute, (name, help_text) in CONSUMER_COUNTERS.items():
                families(name, "counter", help_text).add(getattr(stats, attribute, None), **labels)
        else:
            producer = getattr(client, "name", None) or str(getattr(client, "producer_id", ""))
            for attribute, (name, help_text) in PRODUCER_COUNTERS.items():
                families(name, "counter", help_text).add(
                    getattr(stats, attribute, None), producer=producer
                )


# -- what Redis counts ---------------------------------------------------------------------------
def collect(
    broker: Broker, *, clients: Sequence[Any] | None = None, server: bool = True
) -> list[MetricFamily]:
    """Every metric of the broker's namespace (server=True: read from Redis, pipelined) and of
    the given clients (default: the tracked ones). Raises redis errors when the server is down
    (a scrape should fail, not report zeros)."""
    from redisq.inspect import namespace_snapshot

    families = _Families()
    if server:
        snapshot = run_operation(namespace_snapshot(broker.keys), broker.scripts.execute)
        _server_families(families, snapshot)
    if clients is None:
        with _tracked_lock:
            clients = list(_tracked)
    _client_families(families, clients)
    return [f for f in families.all() if f.samples]


def _server_families(families: _Families, snapshot: Any) -> None:
    partitions = families("redisq_topic_partitions", "gauge", "Partitions of the topic.")
    length = families(
        "redisq_partition_messages", "gauge", "Messages in the partition now (after retention)."
    )
    produced = families(
        "redisq_messages_produced_total",
        "counter",
        "Messages appended to the partition (XINFO STREAM entries-added).",
    )
    for name, topic in snapshot.topics.items():
        partitions.add(topic.config.partitions, topic=name)
        for p in topic.partitions:
            length.add(p.length, topic=name, partition=p.partition)
            produced.add(p.entries_added, topic=name, partition=p.partition)

    consumed = families(
        "redisq_messages_consumed_total",
        "counter",
        "Entries the group has passed on the partition (committed position's entries-read).",
    )
    lag = families("redisq_consumer_lag", "gauge", "Messages after the group's committed position.")
    pending = families(
        "redisq_consumer_pending", "gauge", "Entries delivered, not acknowledged (concurrent)."
    )
    members = families("redisq_group_members", "gauge", "Members in the group's registry.")
    grants = families(
        "redisq_lease_grants_total",
        "counter",
        "Times the group's lease on the partition was granted (its fencing token).",
    )
    held = families(
        "redisq_lease_held", "gauge", "1 while a member holds the lease (label holder)."
    )
    left = families("redisq_lease_remaining_seconds", "gauge", "Time until the held lease expires.")
    dead = families(
        "redisq_dead_letters_total",
        "counter",
        "Messages the group dead-lettered from the partition.",
    )
    malformed = families(
        "redisq_malformed_entries_total", "counter", "Foreign entries the group dead-lettered."
    )
    waiting = families(
        "redisq_dead_letter_messages", "gauge", "Messages waiting in the group's dead-letter topic."
    )
    blocked = families(
        "redisq_partition_blocked",
        "gauge",
        "1 while a message blocks the partition (policy block).",
    )
    attempts = families(
        "redisq_blocked_attempts", "gauge", "Attempts of the message blocking the partition."
    )
    parked = families("redisq_parked_keys", "gauge", "Keys parked by the park_key policy.")
    held_messages = families(
        "redisq_held_messages", "gauge", "Messages held back behind parked keys."
    )
    for (topic, group), g in snapshot.groups.items():
        labels = {"topic": topic, "group": group}
        members.add(len(g.members), **labels)
        waiting.add(g.dead_letters_waiting, **labels)
        for p in g.partitions:
            at = {**labels, "partition": p.partition}
            consumed.add(p.entries_read, **at)
            lag.add(p.lag, **at)
            pending.add(p.pending, **at)
            grants.add(p.grants, **at)
            if p.holder is not None:
                held.add(1, **at, holder=p.holder)
                left.add(None if p.lease_left_ms is None else p.lease_left_ms / 1000, **at)
            dead.add(p.dead_letters, **at)
            malformed.add(p.malformed, **at)
            blocked.add(1 if p.blocked_offset else 0, **at)
            attempts.add(p.blocked_attempts, **at)
            parked.add(p.parked, **at)
            held_messages.add(p.held, **at)


# -- the text format -----------------------------------------------------------------------------
def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) and abs(value) < 2**63 else repr(value)


def exposition(families: Iterable[MetricFamily]) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    lines = []
    for family in families:
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {family.name} {help_text}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for labels, value in family.samples:
            if labels:
                shown = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
                lines.append(f"{family.name}{{{shown}}} {_value(value)}")
            else:
                lines.append(f"{family.name} {_value(value)}")
    return "\n".join(lines) + "\n"
