"""redisq's numbers as Prometheus metrics, with no dependency on the console or a client library.

    import redisq, redisq.metrics
    broker = redisq.connect()
    text = redisq.metrics.exposition(redisq.metrics.collect(broker))   # Prometheus text format

`collect(broker)` reads what Redis already counts for the namespace, in a few pipelined round
trips (redisq.protocol.overview, redisq.protocol.waiting): every partition's appended-entries
counter and length,
its delayed messages and when the next is due, every group's committed entries, lag and pending
entries per partition, each lease (holder, time left) and how many times it was granted (its
fencing counter), the dead letters, malformed entries, blocked messages, parked keys and held
messages the commits record, the dead-letter topics' lengths, the transactions in the registry
by state and the half messages check-back gave up on. These are the truth shared by every
process, so one scrape of one console is enough.

Numbers only a client knows (what a producer sent, had acknowledged, was answered as
duplicates, retried, was fenced on, committed and aborted; what a consumer was given, handled,
failed, retried, dead-lettered, its lease grants and losses and fenced commits) come from the
producers and consumers of this process: each one is tracked from its start (held weakly, so
tracking never keeps one alive), or pass `collect(clients=...)`. They carry the labels group
and member (consumers) or producer (its name, else its producer id).

Names follow Prometheus conventions: a `redisq_` prefix, `_total` on counters, base units
(seconds), one label set per series, label values escaped as the text format requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redisq.model.keys import parse_unresolved_topic
from redisq.model.stats import track, tracked, untrack
from redisq.protocol import run_operation
from redisq.protocol.overview import NamespaceSnapshot, namespace_snapshot
from redisq.protocol.waiting import TransactionsSnapshot, transactions_snapshot
from redisq.server.handle import BrokerHandle

# Transactions read per scrape (their states); the registry's size is reported whatever it is.
TRANSACTIONS_READ = 1000

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


# ConsumerStats field -> (metric name, help). The library counts these (redisq.model.stats).
CONSUMER_COUNTERS = {
    "consumed": (
        "redisq_consumer_messages_consumed_total",
        "Messages given to the application (poll, or run's handler), each delivery.",
    ),
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
# ProducerStats field -> (metric name, help): counted by the producer's core and transactions.
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
    broker: BrokerHandle, *, clients: Sequence[Any] | None = None, server: bool = True
) -> list[MetricFamily]:
    """Every metric of the broker's namespace (server=True: read from Redis, pipelined) and of
    the given clients (default: the tracked ones). Raises redis errors when the server is down
    (a scrape should fail, not report zeros)."""
    families = _Families()
    if server:
        snapshot = run_operation(namespace_snapshot(broker.keys), broker.scripts.execute)
        transactions = run_operation(
            transactions_snapshot(broker.keys, TRANSACTIONS_READ), broker.scripts.execute
        )
        _server_families(families, snapshot)
        _waiting_families(families, snapshot, transactions)
    if clients is None:
        clients = tracked()
    _client_families(families, clients)
    return [f for f in families.all() if f.samples]


def _waiting_families(
    families: _Families, snapshot: NamespaceSnapshot, transactions: TransactionsSnapshot
) -> None:
    scheduled = families(
        "redisq_scheduled_messages",
        "gauge",
        "Delayed messages waiting in the partition's schedule.",
    )
    next_due = families(
        "redisq_scheduled_next_due_timestamp_seconds",
        "gauge",
        "When the partition's next delayed message is due (Unix time, the server's clock).",
    )
    unresolved = families(
        "redisq_unresolved_messages",
        "gauge",
        "Half messages check-back gave up on, in the transactional group's unresolved topic.",
    )
    for name, topic in snapshot.topics.items():
        group = parse_unresolved_topic(name)
        if group is not None:
            unresolved.add(topic.length, group=group)
            continue
        for p in topic.partitions:
            scheduled.add(p.scheduled, topic=name, partition=p.partition)
            if p.next_due_ms is not None:
                next_due.add(p.next_due_ms / 1000, topic=name, partition=p.partition)
    registered = families(
        "redisq_transactions_registered",
        "gauge",
        "Transactions in the registry: open, or decided and not yet carried out.",
    )
    registered.add(transactions.total)
    states = families(
        "redisq_transactions",
        "gauge",
        f"Transactions in the registry by state (of the first {TRANSACTIONS_READ} read).",
    )
    for state in ("open", "committed", "aborted"):
        states.add(transactions.count(state), state=state)
    oldest = families(
        "redisq_transaction_open_oldest_age_seconds", "gauge", "Age of the oldest open transaction."
    )
    ages = [t.info.age_ms for t in transactions.transactions if t.info.state == "open"]
    oldest.add(max(ages) / 1000 if ages else None)


def _server_families(families: _Families, snapshot: NamespaceSnapshot) -> None:
    partitions = families("redisq_topic_partitions", "gauge", "Partitions of the topic.")
    length = families(
        "redisq_partition_messages", "gauge", "Messages in the partition now (after retention)."
    )
    produced = families(
        "redisq_messages_produced_total",
        "counter",
        "Messages appended to the partition (entries-added; a batch topic's counters).",
    )
    for name, topic in snapshot.topics.items():
        partitions.add(topic.config.partitions, topic=name)
        for stream in topic.partitions:
            # A batch topic's stream counts entries: its messages come from the partition's
            # counters (DESIGN §14.6), and a partition that cannot tell has no sample.
            batch = topic.config.entry_format == "batch"
            holds = stream.messages if batch else stream.length
            appended = stream.counted if batch else stream.entries_added
            if holds is not None:
                length.add(holds, topic=name, partition=stream.partition)
            if appended is not None:
                produced.add(appended, topic=name, partition=stream.partition)

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
    for (topic_name, group), g in snapshot.groups.items():
        labels = {"topic": topic_name, "group": group}
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
    return "".join(line + "\n" for line in lines)
