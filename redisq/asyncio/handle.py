"""The asyncio broker handle as asyncio producers and consumers see it (a Protocol, so they
need not import redisq.asyncio.broker, which creates them)."""

from __future__ import annotations

from typing import Any, Protocol

from redisq.asyncio.client import AsyncScripts
from redisq.keys import KeySpace
from redisq.topic import TopicConfig


class AsyncBrokerHandle(Protocol):
    keys: KeySpace
    client: Any
    scripts: AsyncScripts
    is_cluster: bool
    server: str

    async def run(self, operation: Any) -> Any: ...

    async def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig: ...

    def forget_topic(self, topic: str) -> None: ...

    async def create_topic(
        self,
        topic: str,
        partitions: int = 1,
        *,
        retention_ms: int = 0,
        retention_messages: int = 0,
        dedup_window_ms: int | None = None,
        producer_state_ttl_ms: int = ...,
        exist_ok: bool = False,
    ) -> TopicConfig: ...

    async def list_topics(self) -> list[str]: ...
