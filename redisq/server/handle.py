# WARNING: generated from handle_async.py by tools/async_to_sync.py; do not edit.
# Change handle_async.py and run `python tools/async_to_sync.py`.
"""The broker as producers, consumers, dead letters and the group tools see it.

A Protocol, so that those modules need not import redisq.broker (which creates them): the
dependencies point one way, broker -> producer/consumer -> handle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

from redisq.model.keys import KeySpace
from redisq.model.records import Message
from redisq.model.topic import TopicConfig, TopicDescription
from redisq.protocol import Operation
from redisq.server.scripts import Scripts

T = TypeVar("T")


class BrokerHandle(Protocol):
    keys: KeySpace
    client: Any
    scripts: Scripts
    is_cluster: bool
    server: str

    @property
    def namespace(self) -> str: ...

    def run(self, operation: Operation[T]) -> T: ...

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
        entry_format: str = ...,
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
