"""The asyncio broker: one redis.asyncio connection, one namespace, topic administration.

The same operations as the sync Broker, driven by the asyncio executor: each one is written
once (redisq.admin) and run by both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Unpack

from redis.asyncio.cluster import RedisCluster

from redisq import admin, connection, transaction_admin
from redisq.asyncio.client import AsyncScripts, open_client, resolve_url, run_operation
from redisq.errors import (
    InvalidName,
    PartitionOutOfRange,
    TopicNotFound,
)
from redisq.keys import KeySpace, dead_letter_topic, validate_topic
from redisq.records import MalformedMessage, Message, decode_entries, offset_after
from redisq.scripts import is_fake
from redisq.settings import ProducerOptions
from redisq.topic import DEFAULT_PRODUCER_STATE_TTL_MS, TopicConfig, TopicDescription
from redisq.transaction_admin import TransactionInfo

if TYPE_CHECKING:
    from redisq.asyncio.consumer import Consumer
    from redisq.asyncio.producer import Producer

log = logging.getLogger("redisq.asyncio.broker")


class Broker:
    """A redis.asyncio connection to one deployment and one namespace. `await connect()`."""

    def __init__(
        self, client: Any, namespace: str = "rq", *, url: str | None = None, embedded: bool = False
    ) -> None:
        self.keys = KeySpace(namespace)
        self.client = client
        self.embedded = embedded
        self._url = url
        self.is_cluster = isinstance(client, RedisCluster)
        self.server = "fakeredis"
        self.scripts = AsyncScripts(client)
        self._topic_cache: dict[str, tuple[float, TopicConfig]] = {}

    async def _check_server(self) -> None:
        if not is_fake(self.client):
            self.server = connection.server_description(await self.client.info("server"))

    @property
    def namespace(self) -> str:
        return self.keys.namespace

    def __repr__(self) -> str:
        where = connection.redact_url(self._url) if self._url else type(self.client).__name__
        return (
            f"<redisq.asyncio.Broker {where} namespace={self.namespace!r} server={self.server!r}>"
        )

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, operation: Any) -> Any:
        """Drive a protocol operation (redisq.admin, redisq.identity) on this connection."""
        return await run_operation(operation, self.scripts)

    # -- topics ------------------------------------------------------------------------------
    async def create_topic(
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
        """See redisq.Broker.create_topic."""
        config: TopicConfig = await self.run(
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
        return config

    async def add_partitions(self, topic: str, partitions: int) -> TopicConfig:
        """See redisq.Broker.add_partitions."""
        config: TopicConfig = await self.run(admin.add_partitions(self.keys, topic, partitions))
        self._topic_cache[topic] = (time.monotonic(), config)
        return config

    async def trim(self, topic: str) -> int:
        """See redisq.Broker.trim."""
        return int(await self.run(admin.trim(self.keys, topic)))

    async def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig:
        """The topic's metadata, cached for max_age_s. TopicNotFound if it does not exist."""
        validate_topic(topic)
        cached = self._topic_cache.get(topic)
        if cached and not refresh and time.monotonic() - cached[0] < max_age_s:
            return cached[1]
        try:
            config: TopicConfig = await self.run(admin.topic_config(self.keys, topic))
        except TopicNotFound:
            self._topic_cache.pop(topic, None)
            raise
        self._topic_cache[topic] = (time.monotonic(), config)
        return config

    def forget_topic(self, topic: str) -> None:
        self._topic_cache.pop(topic, None)

    async def check_partition(self, topic: str, partition: object) -> int:
        config = await self.topic_config(topic)
        if isinstance(partition, bool) or not isinstance(partition, int):
            raise TypeError(f"partition must be an int, not {type(partition).__name__}")
        if not 0 <= partition < config.partitions:
            raise PartitionOutOfRange(topic, partition, config.partitions)
        return partition

    async def list_topics(self) -> list[str]:
        return list(await self.run(admin.list_topics(self.keys)))

    async def list_transactions(self, limit: int = 1000) -> list[TransactionInfo]:
        """Open transactions, and decided ones not yet carried out, oldest first."""
        return list(await self.run(transaction_admin.list_transactions(self.keys, limit)))

    async def sweep_transactions(self) -> int:
        """Abort expired open transactions and finish decided ones now; how many were due."""
        return int(await self.run(transaction_admin.sweep_now(self.keys)))

    async def describe_topic(self, topic: str) -> TopicDescription:
        """See redisq.Broker.describe_topic."""
        nodes = None
        if self.is_cluster:
            config = await self.topic_config(topic, refresh=True)
            nodes = {}
            for p in range(config.partitions):
                target = self.client.get_node_from_key(self.keys.log(topic, p))
                nodes[p] = f"{target.host}:{target.port}"
        description: TopicDescription = await self.run(
            admin.describe_topic(self.keys, topic, nodes)
        )
        return description

    async def delete_topic(self, topic: str, *, force: bool = False) -> None:
        """See redisq.Broker.delete_topic."""
        partitions, groups = await self.run(admin.delete_topic(self.keys, topic, force=force))
        self._topic_cache.pop(topic, None)
        for p in range(partitions):
            doomed = [
                key
                async for key in self.client.scan_iter(
                    match=self.keys.partition_pattern(topic, p), count=1000
                )
            ]
            for start in range(0, len(doomed), 500):
                await self.client.delete(*doomed[start : start + 500])
        for group in groups:
            try:
                await self.delete_topic(dead_letter_topic(topic, group), force=True)
            except (TopicNotFound, InvalidName):
                pass
        log.info("deleted topic %s", topic)

    # -- reading ---------------------------------------------------------------------------------
    async def read(
        self,
        topic: str,
        partition: int,
        *,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        batch: int = 1000,
        on_malformed: str = "yield",
    ) -> AsyncIterator[Message]:
        """See redisq.Broker.read: messages of one partition in offset order (XRANGE)."""
        admin.check_read(start, end, count, batch, on_malformed)
        await self.check_partition(topic, partition)
        key = self.keys.log(topic, partition)
        returned = 0
        cursor = start
        while count is None or returned < count:
            size = batch if count is None else min(batch, count - returned)
            entries = await self.client.xrange(key, min=cursor, max=end, count=size)
            if not entries:
                return
            for message in decode_entries(topic, partition, entries):
                if on_malformed == "raise" and isinstance(message, MalformedMessage):
                    raise message.error()
                yield message
            returned += len(entries)
            last = entries[-1][0]
            after = offset_after(last.decode() if isinstance(last, bytes) else str(last))
            if after is None or len(entries) < size:
                return
            cursor = after

    # -- clients ---------------------------------------------------------------------------------
    def producer(self, name: str | None = None, **options: Unpack[ProducerOptions]) -> Producer:
        """An asyncio producer (`async with broker.producer(...) as producer`); the options of
        redisq.Producer."""
        from redisq.asyncio.producer import Producer

        return Producer(self, name=name, **options)

    def consumer(self, topic: str, group: str, name: str | None = None, **options: Any) -> Consumer:
        """An asyncio member of consumer group `group` (`async with broker.consumer(...)`)."""
        from redisq.asyncio.consumer import Consumer

        return Consumer(self, topic, group, name, **options)


async def connect(
    url: str | None = None, namespace: str = "rq", *, client: Any = None, **options: Any
) -> Broker:
    """Connect to url, else REDIS_URL, else the embedded valkey-server (see redisq.connect)."""
    if client is not None:
        broker = Broker(client, namespace)
    else:
        resolved, embedded = await resolve_url(url)
        options.setdefault("socket_timeout", 30)
        options.setdefault("socket_connect_timeout", 10)
        broker = Broker(
            await open_client(resolved, **options), namespace, url=resolved, embedded=embedded
        )
    try:
        await broker._check_server()
    except Exception:
        await broker.close()
        raise
    return broker
