"""poll() and iteration, with Kafka's consumer habits (the thread API's twin is generated from
this module by tools/async_to_sync.py).

    for message in consumer:                 # or: messages = consumer.poll(timeout=1.0)
        handle(message)                      # no ack needed: enable_auto_commit (the default)

Auto-commit (enable_auto_commit=True, Kafka's default): each poll() first acknowledges what the
previous poll() returned, and iteration what it yielded before, so a loop that handles what it
gets and asks for more never stalls, and what it got but did not finish (it died first) is
handed again to the next owner: at least once, as Kafka's auto-commit in a single-threaded
loop. close() acknowledges the last of it too. With enable_auto_commit=False the caller acks
(ack(), or commit(), which commits everything returned so far); an orderly partition then gives
nothing more until what it gave is acked, and poll() says so in the log when every partition
this member holds waits for acks (never a silent stall).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable

import redis

from redisq.consume.coordinator_async import Coordinator
from redisq.consume.dispatch import OrderlyPartition, still_given
from redisq.consume.ownership import TopicPartition, messages_by_partition
from redisq.errors import ConsumerClosed, InvalidConfig, LeaseLost, check_int
from redisq.model.records import Message
from redisq.runtime import asleep

log = logging.getLogger("redisq.consumer")

# A poll() that returns nothing because every partition waits for acks says so this often.
STALL_LOG_INTERVAL_S = 10.0


class Poller(Coordinator):
    """poll(), iteration and auto-commit, for redisq.consume.consumer_async.Consumer."""

    _handed: list[Message]  # returned by poll() (or yielded) and not acked since
    _stall_logged: float

    async def ack(self, *messages: Message | Iterable[Message]) -> int:
        raise NotImplementedError  # Consumer's

    async def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError  # Consumer's

    async def _raise_assign_error(self) -> None:
        """on_assign raised: the consumer closes (its partitions go to the other members) and
        the caller of run()/poll() gets the error."""
        error = self._assign_error
        if error is not None:
            await self.close()
            raise error

    def _start_use(self, use: str) -> None:
        if self._closed:
            raise ConsumerClosed(f"{use}() after close()")
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise InvalidConfig(f"this consumer already uses {self._use}(); it cannot {use}() too")

    async def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        """Messages of the partitions this member holds, each partition's in offset order;
        waits up to timeout seconds for the first one.

        With enable_auto_commit (the default) it first acknowledges what the previous poll()
        returned (Kafka's auto-commit): call it again once those are handled. Orderly: one
        message of a partition at a time in offset order per key, so a partition gives nothing
        more until what it gave is acknowledged."""
        self._start_use("poll")
        await self.start()
        check_int("max_messages", max_messages, 1, 100_000)
        if timeout != timeout:  # NaN: no deadline would ever pass
            raise InvalidConfig("timeout is NaN")
        await self._auto_commit()
        messages = await self._poll(timeout, max_messages)
        self._handed.extend(messages)
        return messages

    async def __aiter__(self) -> AsyncIterator[Message]:
        """Messages one at a time, as poll() reads them. With enable_auto_commit (the default)
        a message counts as handled once the next one is asked for (or the loop ends): nothing
        to ack. A loop left early gives back what it had not reached: those are read again."""
        self._start_use("poll")
        await self.start()
        while not self._closed:
            await self._auto_commit()
            messages = await self._poll(1.0, 100)
            for i, message in enumerate(messages):
                self._handed.append(message)
                try:
                    yield message
                except BaseException:
                    self._give_back(messages[i + 1 :])
                    raise
                if self._closed and i + 1 < len(messages):
                    self._give_back(messages[i + 1 :])
                    break

    async def _auto_commit(self) -> None:
        """Kafka's auto-commit: what was handed out before is acknowledged now (a partition no
        longer held is skipped: its next owner hands those messages again)."""
        if not self.settings.enable_auto_commit or not self._handed:
            return
        for batch in self._take_handed(held_only=True):
            try:
                await self.ack(batch)
            except LeaseLost:
                pass  # the partition moved: at least once, its next owner has them
        # An ack commits only once ack_interval_ms passed: commit() commits now.

    async def _commit_handed(self) -> None:
        """commit(): everything returned so far is acknowledged first (Kafka's commitSync)."""
        for batch in self._take_handed():
            await self.ack(batch)

    def _take_handed(self, held_only: bool = False) -> list[list[Message]]:
        """What was handed out and is not acknowledged yet (the caller may have acked some, or a
        transaction), per partition; the list of handed messages starts again. held_only: an
        orderly partition no longer held is left out (close() may have handed it over already:
        whether the caller acked its messages is no longer known, and an ack would be refused)."""
        handed, self._handed = self._handed, []
        by_tp = messages_by_partition([handed])  # one list: grouped in C when one partition
        with self._guard:
            for tp, batch in by_tp.items():
                reader = self._readers.get(tp)
                if reader is not None:  # orderly: the offsets it still waits for
                    unacked = reader.unacked
                    batch[:] = [m for m in batch if m.offset in unacked] if unacked else []
                elif held_only and self.mode == "orderly":
                    batch.clear()
        return [batch for batch in by_tp.values() if batch]

    def _give_back(self, messages: list[Message]) -> None:
        """Messages read and not handed out (a loop left early): their partitions are read from
        the first of them again, so nothing waits for an ack that will not come."""
        first: dict[TopicPartition, str] = {}
        for message in messages:
            first.setdefault((message.topic, message.partition), message.offset)
        with self._guard:
            for tp, offset in first.items():
                reader = self._readers.get(tp)
                if reader is not None:
                    reader.seek(offset)

    async def _poll(self, timeout: float, max_messages: int) -> list[Message]:
        deadline = time.monotonic() + max(timeout, 0.0)
        await self._announce()
        await self._raise_assign_error()
        while True:
            # One read at a time: two callers polling at once both saw nothing outstanding on
            # a partition and read it from the same position (each message given twice).
            async with self._poll_lock:
                messages = await self._poll_once(max_messages)
            left = deadline - time.monotonic()
            if messages or left <= 0 or self._stopping.is_set():
                return messages
            await asleep(min(0.02, left))

    async def _poll_once(self, max_messages: int) -> list[Message]:
        with self._guard:
            tps = self.ownership.readable()
        if not tps:
            return []
        self._poll_cursor = (self._poll_cursor + 1) % len(tps)
        tps = tps[self._poll_cursor :] + tps[: self._poll_cursor]
        batches: list[tuple[OrderlyPartition | None, int, list[Message]]] = []
        try:
            return await self._poll_partitions(tps, batches, max_messages)
        except BaseException:
            # Raised (an error reply, a cancel) after earlier partitions' reads were admitted:
            # their positions moved over messages the caller never gets; read them again.
            with self._guard:  # not a partition whose position moved since (a hand-over)
                kept = [m for r, moves, b in batches if r is None or r.moves == moves for m in b]
            self._give_back(kept)
            raise

    async def _poll_partitions(
        self,
        tps: list[TopicPartition],
        batches: list[tuple[OrderlyPartition | None, int, list[Message]]],
        max_messages: int,
    ) -> list[Message]:
        taken = 0
        waiting = 0  # partitions that give nothing until what they gave is acked
        now = time.monotonic()
        for tp in tps:
            room = max_messages - taken
            if room <= 0:
                break
            with self._guard:
                if not self.ownership.may_handle(tp, now):
                    continue
                reader = self._readers.get(tp)
                due = reader is not None and reader.commit_due(now, self._ack_interval_s)
                outstanding = reader is not None and bool(reader.outstanding)
                moves = reader.moves if reader is not None else 0  # a seek, a hand-over: dropped
            try:
                # What was acked is committed within ack_interval_ms, also while the rest of
                # the batch is still out (the caller acks one at a time: a Kombu worker).
                if due:
                    await self._commit(tp)
                if outstanding:
                    waiting += 1
                    continue
                messages = await self._released(tp, reader, room) or await self.io.fetch(
                    tp, reader, room, self._guard, moves
                )
            except LeaseLost:
                with self._guard:
                    self._lease_lost(tp)
                continue
            except redis.RedisError as exc:
                log.warning("%s: reading %s/%d: %s", self.name, tp[0], tp[1], exc)
                continue
            batches.append((reader, moves, messages))  # admitted: given back if poll() fails
            messages = await self.io.screen(reader, messages, self.stats, self._guard, moves)
            batches[-1] = (reader, reader.moves if reader is not None else 0, messages)
            taken += len(messages)
        with self._guard:
            result = still_given(batches)
        if not result and waiting and waiting == len(tps):
            self._stalled(waiting)
        self.stats.consumed += len(result)
        if self._key_decoder is None and self._value_decoder is None:
            return result
        return [self._deserialize(m) for m in result]

    def _stalled(self, partitions: int) -> None:
        """Every partition this member holds waits for acks: said in the log (now and then),
        with what to do, never a silent stall."""
        now = time.monotonic()
        if now - self._stall_logged < STALL_LOG_INTERVAL_S:
            return
        self._stall_logged = now
        log.warning(
            "%s: poll() gives nothing: the %d partitions it holds each wait for the messages "
            "they gave to be acknowledged (an orderly partition gives one batch at a time): "
            "ack() or commit() each once it is handled",
            self.name,
            partitions,
        )

    async def _released(
        self, tp: TopicPartition, reader: OrderlyPartition | None, room: int
    ) -> list[Message]:
        """Held messages whose key was released (redisq dlq release), given out before
        anything read after them, as run() does; acking one takes it off the held list."""
        if reader is None or not reader.parked_check_due(time.monotonic()):
            return []
        parked_now = await self.io.parked_now(tp)
        with self._guard:
            free = reader.released(parked_now, room)
        if not free:
            return []
        try:
            return await self.io.fetch_offsets(tp, free)
        except redis.RedisError:  # they stay held: the next poll reads them before anything
            with self._guard:
                reader.next_parked_check = 0.0
            raise
