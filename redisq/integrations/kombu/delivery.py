"""One Kombu queue consumed through an orderly consumer group: the bridge between the group's
poll()/ack() and Kombu's deliveries and acks.

A thread polls the group. In orderly mode a partition gives a batch and nothing more until
all of it is acked, and acks move the committed position over the acked prefix only (exact:
what was acked before a rebalance is not handed out again, unless a later message was acked
ahead of an earlier one still running). Inside a batch the bridge holds back a key's next
message until Kombu settled the one before: the first message of every key goes out at once
(different keys, and keyless messages, run in parallel), each key's in send order.
``basic_ack`` is the group's ack (committed under the partition's lease: fenced; a member that
lost the partition commits nothing); ``basic_reject`` moves the message to the group's
dead-letter topic; a requeue offers it again, up to max_requeues, then dead-letters it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redisq.errors import LeaseLost, RedisqError, TopicNotFound
from redisq.integrations.handoff import Rejected
from redisq.integrations.kombu.mapping import expired, incoming

if TYPE_CHECKING:
    import redisq

log = logging.getLogger("redisq.integrations.kombu")

Lane = tuple[int, bytes | None]  # (partition, key): what must not run twice at once


class Outcome(enum.Enum):
    ACK = "ack"
    REJECT = "reject"
    RELEASE = "release"


class Delivery:
    """A message offered to Kombu, until Kombu settles it."""

    __slots__ = ("message", "payload", "queue", "requeues", "_settled", "_bridge")

    def __init__(
        self, bridge: QueueConsumer, message: redisq.Message, payload: dict[str, Any]
    ) -> None:
        self._bridge = bridge
        self.message = message
        self.payload = payload
        self.queue = bridge.queue
        self.requeues = 0
        self._settled = False

    def settle(self, outcome: Outcome) -> None:
        if not self._settled:
            self._settled = True
            self._bridge.settled(self, outcome)

    def requeue(self) -> None:
        """Kombu requeued it: offered again first (AMQP puts it back at the head), up to the
        bridge's max_requeues, then rejected (a message requeued for ever is a poison one)."""
        self.requeues += 1
        if self.requeues > self._bridge.max_requeues:
            self.settle(Outcome.REJECT)
        else:
            self._bridge.offer(self, first=True)


class QueueConsumer:
    """A member of the queue's consumer group, polled by a thread of its own."""

    def __init__(
        self,
        broker: redisq.Broker,
        queue: str,
        topic: str,
        *,
        group: str,
        wake: Callable[[], None],
        queue_ttl_ms: int | None,
        max_requeues: int,
        batch: int = 64,
        options: dict[str, Any],
    ) -> None:
        self.queue = queue
        self.topic = topic
        self.max_requeues = max_requeues
        self._broker = broker
        self._wake = wake
        self._queue_ttl_ms = queue_ttl_ms
        self._batch = batch
        self._lock = threading.Lock()
        self._ready: deque[Delivery] = deque()
        self._busy: set[Lane] = set()  # lanes with a message offered and not settled
        self._behind: defaultdict[Lane, deque[Delivery]] = defaultdict(deque)
        self._seen: dict[int, tuple[int, int]] = {}  # partition -> highest offset polled
        self._closing = threading.Event()
        # Acked by basic_ack only: auto-commit (poll()'s default, Kafka's) would ack what a
        # poll handed over at the next poll (0.25 s later) and at close(), while Kombu still
        # runs it; a worker killed then would lose it (the group committed past it).
        self._consumer = broker.consumer(
            topic, group=group, mode="orderly", enable_auto_commit=False, **options
        )
        self._thread = threading.Thread(target=self._run, name=f"redisq-kombu-{queue}", daemon=True)
        self._thread.start()

    # -- the group's side ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                messages = self._consumer.poll(timeout=0.25, max_messages=self._batch)
            except Exception as error:  # closed under it, or the server went away: again
                if self._closing.is_set():
                    return
                log.warning("polling queue %r: %s", self.queue, error)
                self._closing.wait(0.2)
                continue
            for message in messages:
                self._admit(message)

    def _admit(self, message: redisq.Message) -> None:
        with self._lock:
            self._note_seen(message)
        error = getattr(message, "error", None)  # a MalformedMessage: another client's entry
        if callable(error):
            self._dead_letter(message, error())
            return
        if expired(message.headers, message.timestamp_ms, self._queue_ttl_ms):
            log.debug(
                "%s/%d@%s expired (TTL): dropped", self.topic, message.partition, message.offset
            )
            self._ack(message)
            return
        try:
            payload = incoming(message.value)
            payload["properties"]  # noqa: B018  (a Kombu message has them)
        except (ValueError, TypeError, KeyError) as failure:
            self._dead_letter(message, Rejected(f"not a Kombu message: {failure}"))
            return
        delivery = Delivery(self, message, payload)
        lane = (message.partition, message.key)
        with self._lock:
            if lane in self._busy:
                self._behind[lane].append(delivery)
                return
            self._busy.add(lane)
        self.offer(delivery)

    def _note_seen(self, message: redisq.Message) -> None:
        offset = _offset_key(message.offset)
        if offset > self._seen.get(message.partition, (-1, -1)):
            self._seen[message.partition] = offset

    def settled(self, delivery: Delivery, outcome: Outcome) -> None:
        """Kombu settled it (or the consumer closes): carry it out, then offer the next message
        of its key. A revoked partition is still leased to this member until all it gave out
        was acked (then the group commits and hands it over), so its held-back messages go on
        here; once the lease is gone the ack raises LeaseLost and they wait for the new owner."""
        message = delivery.message
        with self._lock:
            if delivery in self._ready:
                self._ready.remove(delivery)
        if outcome is Outcome.ACK:
            held = self._ack(message)
        elif outcome is Outcome.REJECT:
            reason = f"rejected by Kombu after {delivery.requeues} requeue(s)"
            held = self._dead_letter(message, Rejected(reason))
        else:  # released: not acked, so the group hands it out again
            held = False
        lane = (message.partition, message.key)
        with self._lock:
            behind = self._behind.get(lane)
            if held and behind and not self._closing.is_set():
                following = behind.popleft()
            else:  # what waited behind it is handed out again by the partition's next owner
                self._behind.pop(lane, None)
                self._busy.discard(lane)
                return
        self.offer(following)

    def _ack(self, message: redisq.Message) -> bool:
        try:
            self._consumer.ack(message)
        except LeaseLost:
            log.warning(
                "%s/%d moved before %s was acked: handed out again there",
                self.topic,
                message.partition,
                message.offset,
            )
            return False
        return True

    def _dead_letter(self, message: redisq.Message, error: BaseException) -> bool:
        try:
            self._consumer.dead_letter(message, error)
        except LeaseLost:
            return False
        except RedisqError as failure:  # not written: not acked either, so it comes back
            log.error(
                "dead-lettering %s/%d@%s failed: %s",
                self.topic,
                message.partition,
                message.offset,
                failure,
            )
            return False
        log.warning(
            "%s/%d@%s dead-lettered: %s", self.topic, message.partition, message.offset, error
        )
        return True

    # -- Kombu's side ----------------------------------------------------------------------------
    def offer(self, delivery: Delivery, *, first: bool = False) -> None:
        with self._lock:
            if self._closing.is_set():
                return
            if first:
                self._ready.appendleft(delivery)
            else:
                self._ready.append(delivery)
        self._wake()

    def take(self) -> Delivery | None:
        with self._lock:
            return self._ready.popleft() if self._ready else None

    def has_ready(self) -> bool:
        return bool(self._ready)

    def caught_up(self) -> bool:
        """Everything the topic holds was handed to this member, or committed by the group: a
        basic_get that finds nothing ready may answer 'empty'."""
        try:
            partitions = self._broker.describe_topic(self.topic).partitions
        except TopicNotFound:
            return True
        for info in partitions:
            if info.last_offset is None:
                continue
            last = _offset_key(info.last_offset)
            with self._lock:
                seen = self._seen.get(info.partition)
            if seen is not None and seen >= last:
                continue
            committed = self._consumer.committed(info.partition)
            if committed is not None and _offset_key(committed) >= last:
                continue
            return False
        return not self._ready

    def close(self, timeout: float = 10.0) -> None:
        """Leave the group: what was acked is committed; what Kombu still holds is not, and the
        group hands it out again."""
        self._closing.set()
        with self._lock:
            self._ready.clear()
            self._behind.clear()
        self._thread.join(timeout)
        started = time.monotonic()
        self._consumer.close(timeout)
        log.debug("consumer of %r closed in %.3f s", self.queue, time.monotonic() - started)


def _offset_key(offset: str) -> tuple[int, int]:
    ms, _, seq = offset.partition("-")
    return int(ms), int(seq or 0)
