"""The broker handle as producers, consumers, dead letters and group tools see it.

A Protocol, so that those modules need not import redisq.broker (which creates them): the
dependencies point one way, broker -> producer/consumer -> handle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from redisq.keys import KeySpace
from redisq.records import Message
from redisq.scripts import Scripts
from redisq.topic import TopicConfig, TopicDescription


class BrokerHandle(Protocol):
    keys: KeySpace
    client: Any
    scripts: Scripts
    is_cluster: bool
    server: str

    @property
    def namespace(self) -> str: ...

    def topic_config(
        self, topic: str, *, refresh: bool = False, max_age_s: float = 30.0
    ) -> TopicConfig: ...

    def forget_topic(self, topic: str) -> None: ...

    def create_topic(
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

    def list_topics(self) -> list[str]: ...

    def describe_topic(self, topic: str) -> TopicDescription: ...

    def delete_topic(self, topic: str, *, force: bool = False) -> None: ...

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
    ) -> Iterator[Message]: ...
