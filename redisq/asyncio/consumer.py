"""The asyncio consumer: the same cores as the thread consumer (ownership.py, dispatch.py,
policies.py) driven by tasks on redis.asyncio.

    async with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        async for message in consumer:
            ...
            await consumer.ack(message)
        # or: await consumer.run(handler, idle_timeout=2.0)

Handlers may be coroutine functions, or plain functions (run in a worker thread, so a slow one
does not stall the event loop). The guarantees and options are those of redisq.Consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import redis

from redisq.asyncio.client import stop_task
from redisq.asyncio.idempotent import AsyncIdempotentHandler
from redisq.dispatch import (
    OrderlyPartition,
    messages_by_partition,
    still_given,
    transaction_inputs,
)
from redisq.errors import ConsumerClosed, InvalidConfig, LeaseLost, check_int
from redisq.futures import check_timeout
from redisq.ownership import TopicPartition, held_partition, topic_partition
from redisq.partition import PartitionIO
from redisq.policies import DeadLetter
from redisq.protocol.group import Lease
from redisq.protocol.transactions import InputPosition
from redisq.records import MalformedMessage, Message, decode_entries

from .coordinator import Coordinator
from .worker import handle_partition, is_async_handler

log = logging.getLogger("redisq.consumer")


class Consumer(Coordinator):
    """An asyncio member of consumer group `group` of `topics`; see redisq.Consumer."""

    @property
    def topic(self) -> str:
        return self.topics[0]

    def __repr__(self) -> str:
        return (
            f"<redisq.asyncio.Consumer topics={self.topics!r} group={self.group!r} "
            f"name={self.name!r} mode={self.mode!r}>"
        )

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- public API ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once close() was called (while it finishes what is in flight, and after)."""
        return self._closed

    @property
    def assignment(self) -> list[int] | list[TopicPartition]:
        held = self.ownership.held()
        if len(self.topics) == 1 and self._pattern is None:
            return [p for _, p in held]
        return held

    def idempotent(
        self, handler: Callable[[Message], Any], **options: Any
    ) -> AsyncIdempotentHandler:
        """handler (a coroutine function or a plain one) wrapped so that a redelivered message
        whose handling finished is skipped (scope: this group). See redisq.Consumer.idempotent
        and `redisq.idempotent.IdempotentHandler`."""
        return AsyncIdempotentHandler(self.broker, handler, scope=self.group, **options)

    async def run(
        self,
        handler: Callable[[Message], Any],
        *,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_messages: int | None = None,
    ) -> int:
        """See redisq.Consumer.run; handler may be a coroutine function."""
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        self._start_use("run")
        await self.start()
        if max_messages is not None:
            check_int("max_messages", max_messages, 1)
        self._handler = handler
        self._handler_is_async = is_async_handler(handler)
        self._budget = max_messages
        started = time.monotonic()
        handled_before = self.stats.handled
        self._last_handled = started
        for tp, owned in list(self.ownership.owned.items()):
            if owned.announced:
                self._start_worker(tp)
        await self._announce()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if timeout is not None and now - started >= timeout:
                    break
                if idle_timeout is not None and now - self._last_handled >= idle_timeout:
                    break
                if max_messages is not None and (
                    self.stats.handled - handled_before >= max_messages or self._budget == 0
                ):  # every message it may take was taken: the handlers under way finish
                    break
                try:
                    await asyncio.wait_for(self._stopping.wait(), 0.05)
                except TimeoutError:
                    pass
        finally:
            await self.close()
        return self.stats.handled - handled_before

    async def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        """See redisq.Consumer.poll."""
        self._start_use("poll")
        await self.start()
        check_int("max_messages", max_messages, 1, 100_000)
        if timeout != timeout:  # NaN: no deadline would ever pass
            raise InvalidConfig("timeout is NaN")
        deadline = time.monotonic() + max(timeout, 0.0)
        await self._announce()
        while True:
            messages = await self._poll_once(max_messages)
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0 or self._stopping.is_set():
                return messages
            await asyncio.sleep(min(0.02, remaining))

    async def __aiter__(self) -> AsyncIterator[Message]:
        while not self._closed:
            for message in await self.poll():
                yield message

    async def ack(self, *messages: Message | Iterable[Message]) -> int:
        """See redisq.Consumer.ack (orderly: committed within ack_interval_ms)."""
        by_tp = messages_by_partition(messages)
        for topic, _ in by_tp:
            if topic not in self._start_ids:
                raise ValueError(f"message of topic {topic!r}, not of this consumer")
        acked = 0
        now = time.monotonic()
        for tp, batch in by_tp.items():
            if self.mode == "concurrent":
                acked += await self.io.ack_group(tp, [m.offset for m in batch])
                continue
            reader = self._readers.get(tp)
            owned = self.ownership.owned.get(tp)
            if reader is None or owned is None or owned.lost:
                self.stats.fenced_commits += 1
                raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
            acked += reader.ack([m.offset for m in batch], now)
            if reader.commit_due(now, self._ack_interval_s):
                await self._commit(tp)
        return acked

    async def commit(self) -> None:
        """See redisq.Consumer.commit."""
        lost = []
        for tp in list(self._readers):
            try:
                await self._commit(tp)
            except LeaseLost:
                lost.append(tp)
        if lost:
            raise LeaseLost(f"{', '.join(f'{t}/{p}' for t, p in lost)} no longer held")

    def seek(self, partition: int | TopicPartition, offset: str) -> None:
        tp = self._held_tp(partition)
        reader = self._readers.get(tp)
        if reader is None:
            raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
        reader.seek(PartitionIO.check_offset(offset))

    def seek_to_time(self, partition: int | TopicPartition, timestamp_ms: int) -> None:
        check_int("timestamp_ms", timestamp_ms, 0)
        self.seek(partition, f"{timestamp_ms}-0")

    def position(self, partition: int | TopicPartition) -> str:
        tp = self._held_tp(partition)
        reader = self._readers.get(tp)
        if reader is None:
            raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
        return reader.read_from

    async def committed(self, partition: int | TopicPartition) -> str | None:
        return await self.io.committed(self._tp(partition))

    def pause(self, *partitions: int | TopicPartition) -> None:
        self._set_paused(partitions, True)

    def resume(self, *partitions: int | TopicPartition) -> None:
        self._set_paused(partitions, False)

    def _set_paused(self, partitions: Iterable[int | TopicPartition], paused: bool) -> None:
        for partition in partitions:
            owned = self.ownership.owned.get(self._held_tp(partition))
            if owned is None:
                raise InvalidConfig(f"{partition} is not assigned to {self.name}")
            owned.paused = paused

    async def close(self, timeout: float | None = None) -> None:
        """Finish the messages in flight, commit, release the leases and leave the group. See
        redisq.Consumer.close: a partition whose handler is still running after timeout
        seconds keeps its lease (it runs out unrenewed, or the handler's task hands the
        partition over when it ends). With a timeout close() returns within about that time
        even when the server does not answer: what is left (commits, handing leases back,
        leaving the group) goes on in a task of its own while the event loop runs."""
        timeout = check_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self.ownership.stopping = True
        steps = self._closing = asyncio.ensure_future(self._close_steps(timeout))
        try:
            done, _ = await asyncio.wait({steps}, timeout=timeout)
        except asyncio.CancelledError:  # close() itself cancelled: nothing left running
            steps.cancel()
            raise
        if not done:
            log.warning(
                "%s: close() timed out after %s s: the rest goes on in the background",
                self.name, timeout,
            )  # fmt: skip
            return
        steps.result()

    async def _close_steps(self, timeout: float | None) -> None:
        running: set[TopicPartition] = set()
        try:
            if self._workers:
                workers = dict(self._workers)
                _, pending = await asyncio.wait(workers.values(), timeout=timeout)
                running = {tp for tp, task in workers.items() if task in pending}
            for tp in list(self._readers) + list(self.ownership.owned):
                if tp not in running:
                    await self._finish(tp)
        finally:  # also when close() itself is cancelled: the coordinator does not outlive it
            if self._coordinator is not None:
                await stop_task(self._coordinator, 0, self._halt)
        # What the coordinator took up while the partitions above were finished (an acquire
        # answered meanwhile), and acquires it had no answer to.
        for tp in list(self.ownership.owned):
            task = self._workers.get(tp)
            if task is None or task.done():
                await self._finish(tp)
        for tp in list(self.ownership.requests):
            self.ownership.give_up(tp)
        for request, tp in list(self.ownership.giving_up.items()):
            await self._give_up(request, tp)
        await self._leave_group()
        await self.io.close()

    # -- transactions (consume-transform-produce: Transaction.ack) --------------------------------
    def _transaction_inputs(
        self, messages: Message | Iterable[Message], tx_id: str
    ) -> list[tuple[Lease, InputPosition]]:
        """Acks that belong to transaction tx_id (see dispatch.transaction_inputs)."""
        if self.mode != "orderly":
            raise InvalidConfig("tx.ack() needs an orderly consumer (mode='orderly')")

        def lost(tp: TopicPartition) -> bool:
            owned = self.ownership.owned.get(tp)
            return owned is None or owned.lost

        return transaction_inputs(
            self._readers, lost, self.group, messages, tx_id, time.monotonic()
        )

    def _transaction_ended(self, tx_id: str, position: InputPosition, committed: bool) -> None:
        reader = self._readers.get((position.topic, position.partition))
        if reader is not None and reader.transaction == tx_id:
            reader.transaction_ended(position.position, position.entries_read, committed)

    # -- the coordinator task --------------------------------------------------------------------
    # -- poll ------------------------------------------------------------------------------------
    def _start_use(self, use: str) -> None:
        if self._closed:
            raise ConsumerClosed(f"{use}() after close()")
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise InvalidConfig(f"this consumer already uses {self._use}(); it cannot {use}() too")

    async def _poll_once(self, max_messages: int) -> list[Message]:
        tps = self.ownership.readable()
        if not tps:
            return []
        self._poll_cursor = (self._poll_cursor + 1) % len(tps)
        tps = tps[self._poll_cursor :] + tps[: self._poll_cursor]
        batches: list[tuple[OrderlyPartition | None, int, list[Message]]] = []
        taken = 0
        now = time.monotonic()
        for tp in tps:
            room = max_messages - taken
            if room <= 0:
                break
            if not self.ownership.may_handle(tp, now):
                continue
            reader = self._readers.get(tp)
            if reader is not None and reader.outstanding:
                continue
            moves = reader.moves if reader is not None else 0  # a seek, a hand-over: dropped
            try:
                if reader is not None:
                    if reader.commit_due(now, self._ack_interval_s):
                        await self._commit(tp)
                    messages = await self._released(reader, room)
                    if not messages:
                        entries = await self.io.read_range(reader, room)
                        messages = reader.admit_unless_moved(
                            decode_entries(*tp, entries), now, moves
                        )
                else:
                    messages = await self.io.claim_idle(tp, room) or decode_entries(
                        *tp, await self.io.read_group(tp, room, [], None)
                    )
            except LeaseLost:
                self._lease_lost(tp)
                continue
            except redis.RedisError as exc:
                log.warning("%s: reading %s/%d: %s", self.name, tp[0], tp[1], exc)
                continue
            messages = await self._screen(reader, messages, moves)
            batches.append((reader, reader.moves if reader is not None else 0, messages))
            taken += len(messages)
        result = still_given(batches)
        self.stats.consumed += len(result)
        return [self._deserialize(m) for m in result]

    async def _released(self, reader: OrderlyPartition, room: int) -> list[Message]:
        """See redisq.Consumer._released."""
        if not reader.parked_check_due(time.monotonic()):
            return []
        free = reader.released(await self.io.parked_now(reader.tp), room)
        if not free:
            return []
        try:
            return await self.io.fetch_offsets(reader.tp, free)
        except redis.RedisError:  # they stay held: the next poll reads them before anything
            reader.next_parked_check = 0.0
            raise

    async def _screen(
        self, reader: OrderlyPartition | None, messages: list[Message], moves: int
    ) -> list[Message]:
        """As redisq.partition.PartitionIO.screen (malformed entries go to the policy)."""
        good: list[Message] = []
        given: list[Message] = []
        passed: list[str] = []
        block_at = None
        for message in messages:
            if message.__class__ is not MalformedMessage:
                good.append(message)
                given.append(message)
                continue
            if reader is not None and reader.moves != moves:
                return []  # dropped (screened() says so again): no I/O for it
            action = self.policy.malformed()
            if not (reader is not None and reader.blocked == message.offset):
                self.stats.malformed += 1
            if isinstance(action, DeadLetter):
                self.stats.dead_letters += 1
                await self.io.dead_letter(reader, message, message.error(), 0)  # type: ignore[attr-defined]
                given.append(message)
                passed.append(message.offset)
                continue
            if reader is not None:
                if reader.blocked != message.offset:
                    await self.io.mark_blocked(reader.tp, message, message.error(), 0)  # type: ignore[attr-defined]
                block_at = message.offset
            break
        if reader is not None:
            now = time.monotonic()
            if not reader.screened(given, passed, block_at, now, moves):
                return []
        return good

    def _tp(self, partition: int | TopicPartition) -> TopicPartition:
        return topic_partition(self.topics, partition)

    def _held_tp(self, partition: int | TopicPartition) -> TopicPartition:
        return held_partition(self.topics, partition, self.name)

    # -- run: one task per partition -------------------------------------------------------------
    def _start_worker(self, tp: TopicPartition) -> None:
        if tp in self._workers or self._handler is None:
            return
        self._workers[tp] = asyncio.ensure_future(handle_partition(self, tp))
