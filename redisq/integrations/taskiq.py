"""A taskiq broker on redisq.asyncio (extra ``[taskiq]``): ordered, deduplicated tasks.

    from redisq.integrations.taskiq import RedisqBroker

    broker = RedisqBroker("redis://localhost:6379/0")

    @broker.task
    async def charge(order_id: str) -> None: ...

    await charge.kicker().with_labels(ordering_key="order-42").kiq("order-42")

- The tasks are one topic (``topic``); a worker is a member of its orderly consumer group.
- The label ``ordering_key`` is the message key: one key's tasks reach the worker one at a time
  in send order, across every worker process; other keys, and tasks without one, in parallel.
- The task id is the message id: the same task kicked twice within the topic's dedup window is
  stored once (a retry of SimpleRetryMiddleware, same id and a higher ``_retries``, is new).
- The label ``delay`` (seconds, as taskiq's brokers read it) sends a delayed message.
- A message is committed when taskiq acks it (by default once the result is saved): a worker
  killed before that hands it to the next one, after its lease runs out (``lease_ttl_ms``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from taskiq import AckableMessage, AsyncBroker, AsyncResultBackend, BrokerMessage

import redisq.asyncio as rq
from redisq.integrations.handoff import HandoffPolicy, Released

log = logging.getLogger("redisq.integrations.taskiq")

ORDERING_LABEL = "ordering_key"
DELAY_LABEL = "delay"


class RedisqBroker(AsyncBroker):
    """taskiq's AsyncBroker on a redisq topic; see the module doc."""

    def __init__(
        self,
        url: str | None = None,
        *,
        topic: str = "taskiq",
        namespace: str = "taskiq",
        group: str = "taskiq",
        partitions: int = 8,
        ordering_label: str = ORDERING_LABEL,
        lease_ttl_ms: int = 30_000,
        key_concurrency: int = 1,
        max_attempts: int = 5,
        result_backend: AsyncResultBackend[Any] | None = None,
        task_id_generator: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(result_backend, task_id_generator)
        for name, value in (
            ("partitions", partitions),
            ("key_concurrency", key_concurrency),
            ("max_attempts", max_attempts),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: a positive int")
        self.url = url
        self.topic = topic
        self.namespace = namespace
        self.group = group
        self.partitions = partitions
        self.ordering_label = ordering_label
        self.lease_ttl_ms = lease_ttl_ms
        self.key_concurrency = key_concurrency
        self.max_attempts = max_attempts
        self._broker: rq.Broker | None = None
        self._producer: rq.Producer | None = None
        self._consumer: rq.Consumer | None = None
        self._runner: asyncio.Task[int] | None = None
        self._ready: asyncio.Queue[AckableMessage] | None = None
        self._waiting: set[asyncio.Future[bool]] = set()

    async def startup(self) -> None:
        await super().startup()
        self._broker = await rq.connect(self.url, namespace=self.namespace)
        await self._broker.create_topic(self.topic, self.partitions, exist_ok=True)
        self._producer = self._broker.producer(idempotence="message_id")
        await self._producer.start()

    async def shutdown(self) -> None:
        for settled in list(self._waiting):  # held, not acked: the group hands them out again
            if not settled.done():
                settled.set_result(False)
        if self._consumer is not None:
            await self._consumer.close(10.0)
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
        if self._producer is not None:
            await self._producer.close(10.0)
        if self._broker is not None:
            await self._broker.close()
        self._consumer = self._runner = self._producer = self._broker = None
        await super().shutdown()

    async def kick(self, message: BrokerMessage) -> None:
        if self._producer is None:
            raise RuntimeError("RedisqBroker.kick before startup()")
        labels = message.labels
        ordering_key = labels.get(self.ordering_label)
        retries = int(labels.get("_retries", 0) or 0)
        message_id = message.task_id if not retries else f"{message.task_id}.retry-{retries}"
        delay = labels.get(DELAY_LABEL)
        delay_ms = int(float(delay) * 1000) if delay not in (None, "", 0, "0") else None
        await self._producer.send(
            self.topic,
            message.message,
            # Without an ordering key the task id routes the message: a repeat reaches the
            # partition whose window remembers the id (dedup scope is the partition).
            key=str(ordering_key) if ordering_key not in (None, "") else message_id,
            message_id=message_id,
            delay_ms=delay_ms if delay_ms and delay_ms > 0 else None,
        )

    async def listen(self) -> AsyncGenerator[bytes | AckableMessage, None]:
        if self._broker is None:
            raise RuntimeError("RedisqBroker.listen before startup()")
        self._ready = asyncio.Queue()
        self._consumer = self._broker.consumer(
            self.topic,
            self.group,
            mode="orderly",
            key_concurrency=self.key_concurrency,
            lease_ttl_ms=self.lease_ttl_ms,
            failure_policy=HandoffPolicy(max_attempts=self.max_attempts),
        )
        self._runner = asyncio.create_task(self._consumer.run(self._handle))
        while True:
            yield await self._ready.get()

    async def _handle(self, message: rq.Message) -> None:
        """Hand the message to taskiq and wait for its ack: the next message of the key is not
        handed out before (so it is not run before), and the position is committed after."""
        assert self._ready is not None
        settled: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def ack() -> None:
            if not settled.done():
                settled.set_result(True)

        self._waiting.add(settled)
        try:
            await self._ready.put(AckableMessage(data=message.value, ack=ack))
            if not await settled:
                raise Released("the broker shut down before taskiq acked the task")
        finally:
            self._waiting.discard(settled)
