# WARNING: generated from consumer_async.py by tools/async_to_sync.py; do not edit.
# Change consumer_async.py and run `python tools/async_to_sync.py`.
"""The consumer: a member of a consumer group that reads a topic's partitions (the asyncio API's;
the thread API's `redisq.Consumer` is generated from this module by tools/async_to_sync.py).

    with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        consumer.run(handle)            # handle(message); raising means retry

    async with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        async for message in consumer:
            ...
            await consumer.ack(message)
        # or: await consumer.run(handler, idle_timeout=2.0)

The decisions live in I/O-free cores: ownership.py (membership, assignment, leases),
dispatch.py (an orderly partition's position, commits, held keys), policies.py (what a failed
handler leads to). This module and the drivers under it own the tasks (threads) and talk to
Redis through the protocol layer: a coordinator heartbeats, follows the assignment and keeps
the leases; in run() each owned partition has a worker (worker.py) calling the handler
one message at a time in offset order (key_concurrency=N: N lanes, each key in order); poll()
reads in the caller's task (thread). In asyncio, handlers may be coroutine functions, or plain
functions (run in a worker thread, so a slow one does not stall the event loop).

Orderly mode reads a partition like a log (dispatch.py): by range from the group's committed
position, under the lease, and commits the position (XGROUP SETID) every ack_interval_ms.
Concurrent mode is competing consumption on Redis consumer groups (XREADGROUP / XACK, entries
left by a dead member reclaimed with XAUTOCLAIM).

Delivery is at-least-once: what a member handled but did not commit before it died is handled
again by the next owner. Exactly-once effects need an idempotent handler (`Consumer.idempotent`).

A little over 500 lines: the public API of both runtimes with the docstrings users read, poll()'s
read and the close steps, all methods of the one class whose state is the coordinator's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from redisq.consume.coordinator import default_member_name, mark_own
from redisq.consume.dispatch import OFFSET, transaction_inputs
from redisq.consume.idempotent import IdempotentHandler
from redisq.consume.ownership import (
    TopicPartition,
    held_partition,
    messages_by_partition,
    topic_partition,
)
from redisq.consume.poller import Poller
from redisq.consume.worker import Worker
from redisq.errors import InvalidConfig, LeaseLost, check_int
from redisq.model.records import Message
from redisq.model.stats import ConsumerStats
from redisq.model.timeouts import check_timeout, remaining
from redisq.protocol.group import Lease
from redisq.protocol.transactions import InputPosition
from redisq.runtime import (
    Cancelled,
    Task,
    alive,
    cancel,
    is_coroutine_callable,
    join,
    spawn,
    stop,
)

log = logging.getLogger("redisq.consumer")

__all__ = ["Consumer", "ConsumerStats", "default_member_name"]


class Consumer(Poller):
    """A member of consumer group `group` of `topics` (a name or a list; `pattern=` adds every
    topic whose name matches). Create it with `broker.consumer(...)`; the options are
    `redisq.settings.ConsumerOptions`."""

    @property
    def topic(self) -> str:
        """The (first) topic: for a consumer of one topic."""
        return self.topics[0]

    def __repr__(self) -> str:
        api = "redisq"
        return (
            f"<{api}.Consumer topics={self.topics!r} group={self.group!r} name={self.name!r} "
            f"mode={self.mode!r}>"
        )

    def __enter__(self) -> Consumer:
        self.start()
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
        with self._guard:
            held = self.ownership.held()
        if len(self.topics) == 1 and self._pattern is None:
            return [p for _, p in held]
        return held

    @property
    def members(self) -> list[str]:
        return list(self.ownership.members.get(self.topics[0], [])) if self.topics else []

    def idempotent(self, handler: Callable[[Message], Any], **options: Any) -> IdempotentHandler:
        """handler wrapped so that a redelivered message whose handling finished is skipped
        (scope: this group). See `redisq.consume.idempotent.IdempotentHandler`; in asyncio the
        handler may be a coroutine function or a plain one (run in a worker thread)."""
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
        (then the failure policy). Blocks until close() (from another thread or task, a handler
        or a signal handler), timeout seconds, idle_timeout seconds without a message, or
        max_messages handled; the consumer is closed when run() returns. Returns the messages
        handled: at most max_messages (a message dead-lettered counts towards it as taken).
        In asyncio, handler may be a coroutine function; a plain one runs in a worker thread."""
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        self._start_use("run")
        self.start()
        if max_messages is not None:
            check_int("max_messages", max_messages, 1)
        self._handler_coroutine = is_coroutine_callable(handler)
        one_thread = None
        if self.settings.handler_thread == "one" and not self._handler_coroutine:
            # every call on this one thread; a partition's thread (or a task's worker thread)
            # waits for its call there
            one_thread = ThreadPoolExecutor(1, thread_name_prefix=f"redisq-handler-{self.name}")
            handler = functools.partial(on_thread, one_thread, handler)
        self._handler = handler
        self._budget = max_messages
        started = time.monotonic()
        handled_before = self.stats.handled
        self._last_handled = started
        with self._guard:
            for tp, owned in list(self.ownership.owned.items()):
                if owned.announced:
                    self._start_worker(tp)
        self._announce()
        self._wake.set()
        try:
            while not self._stopping.is_set() and self._assign_error is None:
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
            if one_thread is not None:
                one_thread.shutdown(wait=False)
        self._raise_assign_error()
        return self.stats.handled - handled_before

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
            with self._guard:
                reader = self._readers.get(tp)
                owned = self.ownership.owned.get(tp)
                if reader is None or owned is None or owned.lost:
                    self.stats.fenced_commits += 1
                    raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
                acked += reader.ack(map(OFFSET, batch), now)
                due = reader.commit_due(now, self._ack_interval_s)
            if due:
                self._commit(tp)
        return acked

    def commit(self) -> None:
        """Acknowledge every message poll() returned (or iteration yielded) so far, then commit
        every orderly partition's position now (Kafka's commitSync); LeaseLost if a partition
        was lost (its position was not committed)."""
        self._commit_handed()
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
        with self._guard:
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
        with self._guard:
            reader = self._readers.get(tp)
            if reader is None:
                raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.name}")
            return reader.read_from

    def committed(self, partition: int | TopicPartition) -> str | None:
        """The group's committed position on this partition (XINFO GROUPS last-delivered-id),
        whoever holds it; None before the group first read it."""
        return self.io.committed(self._tp(partition))

    def pause(self, *partitions: int | TopicPartition) -> None:
        """Stop reading these partitions (their leases are kept and renewed). The member
        remembers it: a paused partition revoked and assigned back stays paused until
        resume()."""
        self._set_paused(partitions, True)

    def resume(self, *partitions: int | TopicPartition) -> None:
        """Read these partitions again (a paused partition held elsewhere now: forgotten, so
        it is not paused when it comes back)."""
        self._set_paused(partitions, False)

    def paused(self) -> list[TopicPartition]:
        with self._guard:
            return sorted(tp for tp, o in self.ownership.owned.items() if o.paused)

    def _set_paused(self, partitions: Iterable[int | TopicPartition], paused: bool) -> None:
        with self._guard:
            for partition in partitions:
                self.ownership.set_paused(self._held_tp(partition), paused)
        self._wake.set()

    def dead_letter(self, message: Message, error: BaseException | str, attempts: int = 0) -> None:
        """Move a message to the group's dead-letter topic and pass over it (for poll() users)."""
        tp = (message.topic, message.partition)
        with self._guard:
            reader = self._readers.get(tp)
        if self.mode == "orderly" and reader is None:
            raise LeaseLost(f"{tp[0]}/{tp[1]} is not held by {self.name}")
        self.io.dead_letter(reader, message, error, attempts or message.attempt)
        self.stats.dead_letters += 1
        if reader is not None:
            with self._guard:
                reader.ack([message.offset], time.monotonic())

    def close(self, timeout: float | None = None) -> None:
        """Finish the messages in flight, commit, release the leases and leave the group.
        timeout: seconds (None: no limit; TypeError / InvalidConfig otherwise, before anything
        is done); a partition whose handler is still running then keeps its lease (it runs
        out, unrenewed, or the worker hands the partition over when it ends). With a timeout
        close() returns within about that time even when the server does not answer: what is
        left (commits, handing leases back, leaving the group) then goes on in the background
        (a thread, or a task while the event loop runs) until the socket timeout, and leases
        not handed back expire by themselves. Called from a handler or an on_assign/on_revoke
        callback it returns at once, the steps going on in the background (run() returns
        once they are done)."""
        timeout = check_timeout(timeout)
        if self._closed:
            if not self._own():  # closing elsewhere: wait for it (not for ourselves)
                self._close_done.wait(timeout)
            return
        with self._guard:  # from now on no worker starts another batch
            self.ownership.stopping = True
            workers = list(self._workers.values())
        self._closed = True
        self._stopping.set()
        self._wake.set()
        failed: list[BaseException] = []
        # The steps run in a task (thread) of their own: close() waits for them no longer than
        # timeout.
        steps = self._closing = spawn(
            self._close, timeout, workers, failed, name=f"redisq-close-{self.name}"
        )
        if self._own():
            # From a handler or an on_assign/on_revoke callback: waiting here for the workers
            # and the coordinator would wait for this very caller (Kafka's close() from a
            # callback does not wait either).
            return
        try:
            done = self._close_done.wait(timeout)
        except Cancelled:  # close() itself cancelled: nothing left running
            cancel(steps)
            raise
        if not done:
            log.warning(
                "%s: close() timed out after %s s: the rest goes on in the background",
                self.name,
                timeout,
            )
        elif failed:
            raise failed[0]

    def _close(
        self, timeout: float | None, workers: list[Task], failed: list[BaseException]
    ) -> None:
        mark_own(self)  # an on_revoke callback calling close() here must not wait for itself
        try:
            self._close_steps(timeout, workers)
        except Cancelled:
            raise
        except BaseException as exc:  # raised by close() in its caller, if it waits
            log.warning("%s: closing failed: %r", self.name, exc)
            failed.append(exc)
        finally:
            self._close_done.set()

    def _close_steps(self, timeout: float | None, workers: list[Task]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:  # what poll() handed out counts as handled (auto-commit), committed below; here,
            # within close()'s timeout (a silent server holds an ack up to the socket timeout)
            self._auto_commit()
        except (redis.RedisError, LeaseLost) as exc:  # its next owner hands it again
            log.warning("%s: close(): the last messages not acknowledged: %s", self.name, exc)
        try:
            for worker in workers:
                join(worker, None if deadline is None else remaining(deadline))
            for tp in list(self._readers) + list(self.ownership.owned):
                if tp not in self._workers:
                    self._finish(tp)
        finally:  # also when close() is cancelled: the coordinator does not outlive it
            self._halt_coordinator()  # a thread ends at its next check, given up to timeout;
            if self._coordinator is not None:  # a task is cancelled at once (what it was doing,
                # a hand-over or an acquire, is finished or given up below)
                grace = timeout
                stop(self._coordinator, grace, self._halt_coordinator)
            # Not in the coordinator's task, which a cancellation ends: the delayed messages'
            # scheduler hands its leases back here (past close()'s timeout, in the background).
            self._scheduler.close()
        if self._coordinator is None or not alive(self._coordinator):
            # What the coordinator took up while the partitions above were finished (an acquire
            # answered meanwhile), and acquires it had no answer to.
            for tp in list(self.ownership.owned):
                running = self._workers.get(tp)
                if running is None or not alive(running):
                    # A worker still in its handler after the timeout keeps the lease (it
                    # runs out, unrenewed, or the worker hands over when it stops): releasing
                    # it would give the partition to another member while the handler runs.
                    self._finish(tp)
            with self._guard:
                for tp in list(self.ownership.requests):
                    self.ownership.give_up(tp)
            for request, tp in list(self.ownership.giving_up.items()):
                self._give_up(request, tp)
        self._leave_group()
        self.io.close()

    # -- transactions (consume-transform-produce: Transaction.ack) --------------------------------
    def _transaction_inputs(
        self, messages: Message | Iterable[Message], tx_id: str
    ) -> list[tuple[Lease, InputPosition]]:
        """Acks that belong to transaction tx_id (see dispatch.transaction_inputs)."""
        if self.mode != "orderly":
            raise InvalidConfig("tx.ack() needs an orderly consumer (mode='orderly')")
        with self._guard:

            def lost(tp: TopicPartition) -> bool:
                owned = self.ownership.owned.get(tp)
                return owned is None or owned.lost

            return transaction_inputs(
                self._readers, lost, self.group, messages, tx_id, time.monotonic()
            )

    def _transaction_ended(self, tx_id: str, position: InputPosition, committed: bool) -> None:
        with self._guard:
            reader = self._readers.get((position.topic, position.partition))
            if reader is not None and reader.transaction == tx_id:
                reader.transaction_ended(position.position, position.entries_read, committed)

    # -- poll ------------------------------------------------------------------------------------
    def _tp(self, partition: int | TopicPartition) -> TopicPartition:
        return topic_partition(self.topics, partition)

    def _held_tp(self, partition: int | TopicPartition) -> TopicPartition:
        return held_partition(self.topics, partition, self.name)

    # -- run: one worker per partition -----------------------------------------------------------
    def _start_worker(self, tp: TopicPartition) -> None:
        """Under the guard: the worker's hand-over (which takes it) cannot run before its task
        (thread) is recorded."""
        if tp in self._workers or self._handler is None:
            return
        worker = Worker(self, tp, self._readers.get(tp))
        self._workers[tp] = spawn(worker.run, name=f"redisq-{tp[0]}-{tp[1]}")


def on_thread(
    thread: ThreadPoolExecutor, handler: Callable[[Message], Any], message: Message
) -> Any:
    """handler_thread="one": the handler's call made on the member's one handler thread."""
    return thread.submit(handler, message).result()
