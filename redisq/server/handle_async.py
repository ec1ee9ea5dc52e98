"""The broker as producers, consumers, dead letters and the group tools see it.

A Protocol, so that those modules need not import redisq.broker_async (which creates them): the
dependencies point one way, broker -> producer/consumer -> handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from redisq.model.keys import KeySpace
from redisq.model.records import Message
from redisq.model.topic import TopicConfig, TopicDescription
from redisq.protocol import Operation
from redisq.server.scripts_async import AsyncScripts

T = TypeVar("T")


class AsyncBrokerHandle(Protocol):
    keys: KeySpace
    client: Any
    scripts: AsyncScripts
    is_cluster: bool
    server: str

    @property
    def namespace(self) -> str: ...

    async def run(self, operation: Operation[T]) -> T: ...

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
        entry_format: str = ...,
    ) -> TopicConfig: ...

    async def list_topics(self) -> list[str]: ...

    async def describe_topic(self, topic: str) -> TopicDescription: ...

    async def delete_topic(self, topic: str, *, force: bool = False) -> None: ...

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
    ) -> AsyncIterator[Message]: ...
