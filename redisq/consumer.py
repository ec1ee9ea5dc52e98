"""The consumer (thread driver): a member of a consumer group that reads a topic's partitions.

    with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        consumer.run(handle)            # handle(message); raising means retry

The decisions live in I/O-free cores: ownership.py (membership, assignment, leases),
dispatch.py (an orderly partition's position, commits, held keys), policies.py (what a failed
handler leads to). This module owns the threads and talks to Redis through the protocol layer:
a coordinator thread heartbeats, follows the assignment and keeps the leases; in run() each
owned partition has a worker thread (worker.py) calling the handler one message at a time in
offset order (key_concurrency=N: N lanes, each key in order); poll() reads in the caller's
thread.

Orderly mode reads a partition like a log (dispatch.py): by range from the group's committed
position, under the lease, and commits the position (XGROUP SETID) every ack_interval_ms.
Concurrent mode is competing consumption on Redis consumer groups (XREADGROUP / XACK, entries
left by a dead member reclaimed with XAUTOCLAIM).

Delivery is at-least-once: what a member handled but did not commit before it died is handled
again by the next owner. Exactly-once effects need an idempotent handler (`Consumer.idempotent`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from redisq.coordinator import Coordinator, default_member_name, mark_thread
from redisq.dispatch import (
    OrderlyPartition,
    messages_by_partition,
    still_given,
    transaction_inputs,
)
from redisq.errors import ConsumerClosed, InvalidConfig, LeaseLost, check_int
from redisq.futures import check_timeout
from redisq.idempotent import IdempotentHandler
from redisq.ownership import TopicPartition, held_partition, topic_partition
from redisq.protocol.group import Lease
from redisq.protocol.transactions import InputPosition
from redisq.records import Message
from redisq.stats import ConsumerStats
from redisq.worker import Worker

log = logging.getLogger("redisq.consumer")

__all__ = ["Consumer", "ConsumerStats", "default_member_name"]


class Consumer(Coordinator):
    """A member of consumer group `group` of `topics` (a name or a list; `pattern=` adds every
    topic whose name matches). Create it with `broker.consumer(...)`; the options are
    `redisq.settings.ConsumerOptions`."""

    @property
    def topic(self) -> str:
        """The (first) topic: for a consumer of one topic."""
        return self.topics[0]

    def __repr__(self) -> str:
        return (
            f"<redisq.Consumer topics={self.topics!r} group={self.group!r} name={self.name!r} "
            f"mode={self.mode!r}>"
        )

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once close() was called (while it finishes what is in flight, and after)."""
        return self._closed

    @property
    def assignment(self) -> list[int] | list[TopicPartition]:
        """What this member holds now: partition numbers for a consumer of one topic, else
        (topic, partition) pairs."""
        with self._lock:
            held = self.ownership.held()
        if len(self.topics) == 1 and self._pattern is None:
            return [p for _, p in held]
        return held

    @property
    def members(self) -> list[str]:
        return list(self.ownership.members.get(self.topics[0], [])) if self.topics else []

    def idempotent(self, handler: Callable[[Message], Any], **options: Any) -> IdempotentHandler:
        """handler wrapped so that a redelivered message whose handling finished is skipped
        (scope: this group). See `redisq.idempotent.IdempotentHandler`."""
        return IdempotentHandler(self.broker, handler, scope=self.group, **options)

    def run(
        self,
        handler: Callable[[Message], Any],
        *,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_messages: int | None = None,
    ) -> int:
        """Call handler(message) for every message; its return commits it, a raise means retry
        (then the failure policy). Blocks until close() (from another thread or a signal
        handler), timeout seconds, idle_timeout seconds without a message, or max_messages
        handled; the consumer is closed when run() returns. Returns the messages handled:
        at most max_messages (a message dead-lettered counts towards it as taken)."""
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        self._start_use("run")
        if max_messages is not None:
            check_int("max_messages", max_messages, 1)
        self._handler = handler
        self._budget = max_messages
        started = time.monotonic()
        handled_before = self.stats.handled
        self._last_handled = started
        with self._lock:
            for tp, owned in list(self.ownership.owned.items()):
                if owned.announced:
                    self._start_worker(tp)
        self._announce()
        self._wake.set()
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
                self._stopping.wait(0.05)
        finally:
            self.close()
        return self.stats.handled - handled_before

    def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        """Messages of the partitions this member holds, each partition's in offset order.

        Orderly: a partition gives nothing more until what it gave is acked, so a caller that
        handles and acks what it got keeps the one-at-a-time order. Waits up to timeout seconds
        for the first message."""
        self._start_use("poll")
        check_int("max_messages", max_messages, 1, 100_000)
        if timeout != timeout:  # NaN: no deadline would ever pass
            raise InvalidConfig("timeout is NaN")
        deadline = time.monotonic() + max(timeout, 0.0)
        self._announce()
        while True:
            # One read at a time: two threads polling at once both saw nothing outstanding on
            # a partition and read it from the same position (each message given twice).
            with self._poll_lock:
                messages = self._poll_once(max_messages)
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0 or self._stopping.is_set():
                return messages
            time.sleep(min(0.02, remaining))

    def __iter__(self) -> Any:
        """Messages one at a time, as poll() gives them (ack them, or commit())."""
        while not self._closed:
            yield from self.poll()

    def ack(self, *messages: Message | Iterable[Message]) -> int:
        """Acknowledge messages (Kafka's commitAsync). Orderly: the partition's position moves
        over what was acked and is committed within ack_interval_ms (commit() commits now);
        LeaseLost once this member no longer holds a partition (what it acked there is handled
        again by the next owner). Concurrent: XACK, now. Returns how many were acknowledged now:
        a message this consumer did not give out (read with broker.read, or given before a seek)
        or acked already counts 0 and changes nothing, as XACK of an entry not pending."""
        by_tp = messages_by_partition(messages)
        for topic, _ in by_tp:
            if topic not in self._memberships:
                raise ValueError(f"message of topic {topic!r}, not of this consumer")
        acked = 0
        now = time.monotonic()
        for tp, batch in by_tp.items():
            if self.mode == "concurrent":
                acked += self.io.ack_group(tp, [m.offset for m in batch])
                continue
            with self._lock:
                reader = self._readers.get(tp)
                owned = self.ownership.owned.get(tp)
                if reader is None or owned is None or owned.lost:
                    self.stats.fenced_commits += 1
                    raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
                acked += reader.ack([m.offset for m in batch], now)
                due = reader.commit_due(now, self._ack_interval_s)
            if due:
                self._commit(tp)
        return acked

    def commit(self) -> None:
        """Commit every orderly partition's position now (Kafka's commitSync); LeaseLost if a
        partition was lost (its position was not committed)."""
        lost = []
        for tp in list(self._readers):
            try:
                self._commit(tp)
            except LeaseLost:
                lost.append(tp)
        if lost:
            raise LeaseLost(f"{', '.join(f'{t}/{p}' for t, p in lost)} no longer held")

    def seek(self, partition: int | TopicPartition, offset: str) -> None:
        """Read this partition from `offset` (a stream ID, inclusive) next; orderly, held now.
        The committed position follows once what is read from there is handled."""
        tp = self._held_tp(partition)
        with self._lock:
            reader = self._readers.get(tp)
            if reader is None:
                raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
            reader.seek(self.io.check_offset(offset))

    def seek_to_time(self, partition: int | TopicPartition, timestamp_ms: int) -> None:
        """Read from the first message appended at or after timestamp_ms (stream IDs carry the
        append time)."""
        check_int("timestamp_ms", timestamp_ms, 0)
        self.seek(partition, f"{timestamp_ms}-0")

    def position(self, partition: int | TopicPartition) -> str:
        """The offset the next read of this partition starts after (or at, after a seek)."""
        tp = self._held_tp(partition)
        with self._lock:
            reader = self._readers.get(tp)
            if reader is None:
                raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
            return reader.read_from

    def committed(self, partition: int | TopicPartition) -> str | None:
        """The group's committed position on this partition (XINFO GROUPS last-delivered-id),
        whoever holds it; None before the group first read it."""
        return self.io.committed(self._tp(partition))

    def pause(self, *partitions: int | TopicPartition) -> None:
        """Stop reading these partitions (their leases are kept and renewed)."""
        self._set_paused(partitions, True)

    def resume(self, *partitions: int | TopicPartition) -> None:
        self._set_paused(partitions, False)

    def paused(self) -> list[TopicPartition]:
        with self._lock:
            return sorted(tp for tp, o in self.ownership.owned.items() if o.paused)

    def _set_paused(self, partitions: Iterable[int | TopicPartition], paused: bool) -> None:
        with self._lock:
            for partition in partitions:
                owned = self.ownership.owned.get(self._held_tp(partition))
                if owned is None:
                    raise InvalidConfig(f"{partition} is not assigned to {self.name}")
                owned.paused = paused
        self._wake.set()

    def dead_letter(self, message: Message, error: BaseException | str, attempts: int = 0) -> None:
        """Move a message to the group's dead-letter topic and pass over it (for poll() users)."""
        tp = (message.topic, message.partition)
        with self._lock:
            reader = self._readers.get(tp)
        if self.mode == "orderly" and reader is None:
            raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
        self.io.dead_letter(reader, message, error, attempts or message.attempt, park=False)
        self.stats.dead_letters += 1
        if reader is not None:
            with self._lock:
                reader.ack([message.offset], time.monotonic())

    def close(self, timeout: float | None = None) -> None:
        """Finish the messages in flight, commit, release the leases and leave the group.
        timeout: seconds (None: no limit; TypeError / InvalidConfig otherwise, before anything
        is done); a partition whose handler is still running then keeps its lease. With a
        timeout close() returns within about that time even when the server does not answer:
        what is left (commits, handing leases back, leaving the group) then goes on in the
        background until the socket timeout, and leases not handed back expire by themselves."""
        timeout = check_timeout(timeout)
        if self._closed:
            if not self._own_thread():  # closing in another thread (or a thread of ours)
                self._close_done.wait(timeout)
            return
        with self._lock:  # from now on no worker starts another batch
            self.ownership.stopping = True
            workers = list(self._workers.values())
        self._closed = True
        self._stopping.set()
        self._wake.set()
        failed: list[BaseException] = []
        # The steps run in a thread of their own: close() waits for them no longer than timeout.
        threading.Thread(
            target=self._close,
            args=(timeout, workers, failed),
            name=f"redisq-close-{self.name}",
            daemon=True,
        ).start()
        if self._own_thread():
            # From a handler or an on_assign/on_revoke callback: waiting here for the workers
            # and the coordinator would wait for this very thread (run() returns once it is
            # done; Kafka's close() from a callback does not wait either).
            return
        if not self._close_done.wait(timeout):
            log.warning(
                "%s: close() timed out after %s s: the rest goes on in the background",
                self.name, timeout,
            )  # fmt: skip
        elif failed:
            raise failed[0]

    def _close(
        self, timeout: float | None, workers: list[threading.Thread], failed: list[BaseException]
    ) -> None:
        mark_thread(self)  # an on_revoke callback calling close() here must not wait for itself
        try:
            self._close_steps(timeout, workers)
        except BaseException as exc:  # raised by close() in the caller's thread, if it waits
            log.warning("%s: closing failed: %r", self.name, exc)
            failed.append(exc)
        finally:
            self._close_done.set()

    def _close_steps(self, timeout: float | None, workers: list[threading.Thread]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in workers:
            worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for tp in list(self._readers) + [tp for tp in self.ownership.owned]:
            if tp not in self._workers:
                self._finish(tp)
        self._coordinator_stop.set()
        self._wake.set()
        self._coordinator.join(timeout)
        if not self._coordinator.is_alive():
            # What the coordinator took up while the partitions above were finished (an acquire
            # answered meanwhile), and acquires it had no answer to.
            for tp in list(self.ownership.owned):
                running = self._workers.get(tp)
                if running is None or not running.is_alive():
                    # A worker still in its handler after the timeout keeps the lease (it
                    # runs out, unrenewed, or the worker hands over when it stops): releasing
                    # it would give the partition to another member while the handler runs.
                    self._finish(tp)
            with self._lock:
                for tp in list(self.ownership.requests):
                    self.ownership.give_up(tp)
            for request, tp in list(self.ownership.giving_up.items()):
                self._give_up(request, tp)
        for membership in self._memberships.values():
            try:
                membership.leave()
            except redis.RedisError as exc:
                log.warning("%s: could not leave the group: %s", self.name, exc)
        self.io.close()

    # -- transactions (consume-transform-produce: Transaction.ack) --------------------------------
    def _transaction_inputs(
        self, messages: Message | Iterable[Message], tx_id: str
    ) -> list[tuple[Lease, InputPosition]]:
        """Acks that belong to transaction tx_id (see dispatch.transaction_inputs)."""
        if self.mode != "orderly":
            raise InvalidConfig("tx.ack() needs an orderly consumer (mode='orderly')")
        with self._lock:

            def lost(tp: TopicPartition) -> bool:
                owned = self.ownership.owned.get(tp)
                return owned is None or owned.lost

            return transaction_inputs(
                self._readers, lost, self.group, messages, tx_id, time.monotonic()
            )

    def _transaction_ended(self, tx_id: str, position: InputPosition, committed: bool) -> None:
        with self._lock:
            reader = self._readers.get((position.topic, position.partition))
            if reader is not None and reader.transaction == tx_id:
                reader.transaction_ended(position.position, position.entries_read, committed)

    # -- the coordinator thread ------------------------------------------------------------------
    # -- committing ------------------------------------------------------------------------------
    # -- poll ------------------------------------------------------------------------------------
    def _start_use(self, use: str) -> None:
        if self._closed:
            raise ConsumerClosed(f"{use}() after close()")
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise InvalidConfig(f"this consumer already uses {self._use}(); it cannot {use}() too")

    def _poll_once(self, max_messages: int) -> list[Message]:
        with self._lock:
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
            with self._lock:
                if not self.ownership.may_handle(tp, now):
                    continue
                reader = self._readers.get(tp)
                if reader is not None and reader.outstanding:
                    continue
                moves = reader.moves if reader is not None else 0  # a seek, a hand-over: dropped
            try:
                if reader is not None and reader.commit_due(now, self._ack_interval_s):
                    self._commit(tp)
                messages = self._released(tp, reader, room) or self.io.fetch(
                    tp, reader, room, self._lock, moves
                )
            except LeaseLost:
                with self._lock:
                    self._lease_lost(tp)
                continue
            except redis.RedisError as exc:
                log.warning("%s: reading %s/%d: %s", self.name, tp[0], tp[1], exc)
                continue
            messages = self.io.screen(reader, messages, self.stats, self._lock, moves)
            batches.append((reader, reader.moves if reader is not None else 0, messages))
            taken += len(messages)
        with self._lock:
            result = still_given(batches)
        self.stats.consumed += len(result)
        return [self._deserialize(m) for m in result]

    def _released(
        self, tp: TopicPartition, reader: OrderlyPartition | None, room: int
    ) -> list[Message]:
        """Held messages whose key was released (redisq dlq release), given out before
        anything read after them, as run() does; acking one takes it off the held list."""
        if reader is None or not reader.parked_check_due(time.monotonic()):
            return []
        parked_now = self.io.parked_now(tp)
        with self._lock:
            free = reader.released(parked_now, room)
        if not free:
            return []
        try:
            return self.io.fetch_offsets(tp, free)
        except redis.RedisError:  # they stay held: the next poll reads them before anything
            with self._lock:
                reader.next_parked_check = 0.0
            raise

    def _tp(self, partition: int | TopicPartition) -> TopicPartition:
        return topic_partition(self.topics, partition)

    def _held_tp(self, partition: int | TopicPartition) -> TopicPartition:
        return held_partition(self.topics, partition, self.name)

    # -- run: one worker thread per partition ----------------------------------------------------
    def _start_worker(self, tp: TopicPartition) -> None:
        if tp in self._workers or self._handler is None:
            return
        worker = Worker(self, tp, self._readers.get(tp))
        self._workers[tp] = worker
        worker.start()
