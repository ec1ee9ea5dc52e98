"""The Kombu transport: Kombu's virtual channel over redisq topics.

    Connection("redis://localhost:6379/0", transport="redisq.integrations.kombu:Transport")
    app.conf.broker_transport = "redisq.integrations.kombu:Transport"       # Celery

What maps to what (docs/integrations/celery.md has the table against the stock transport):

- a queue is a topic (created on declare); consuming it is a member of the queue's orderly
  consumer group; ``basic_ack`` lets the group commit the position under the partition's lease
  (fenced: a member that lost the partition cannot commit); a rejection goes to the group's
  dead-letter topic, never dropped; a requeue offers the message again, up to max_requeues;
- the message header ``ordering_key`` is the message's key: one key's messages reach Kombu one
  at a time, in send order, on whichever process holds the key's partition;
- a Celery task id (or the ``message_id`` header) is the message id: sent twice within the
  topic's dedup window, stored once;
- Celery's ``eta``/``countdown`` are delayed messages (the topic's schedule), not a worker's
  memory; ``expiration`` and a queue's ``x-message-ttl`` expire messages;
- exchanges route through bindings that every process shares (bindings.py); fanout, direct and
  topic exchanges work across processes (Celery's remote control is a fanout exchange).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import socket
import threading
import weakref
from dataclasses import dataclass, field, fields
from queue import Empty
from time import monotonic
from typing import Any
from urllib.parse import quote

import redis
from kombu.transport import virtual

import redisq
from redisq.errors import InvalidConfig, RedisqError, TopicNotFound
from redisq.integrations.kombu.bindings import Binding, BindingLog
from redisq.integrations.kombu.delivery import Delivery, Outcome, QueueConsumer
from redisq.integrations.kombu.mapping import ORDERING_HEADER, Outgoing, outgoing
from redisq.integrations.kombu.names import topic_for

log = logging.getLogger("redisq.integrations.kombu")

DEFAULT_PORT = 6379


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """``transport_options`` (Celery: ``broker_transport_options``) the transport reads."""

    namespace: str = "kombu"  # redisq namespace of every key the transport writes
    url: str | None = None  # a full redisq url (redis+cluster://, redis+sentinel://) instead
    partitions: int = 4  # of a queue's topic when the transport creates it
    # A queue is a log: what was consumed stays until retention trims it (Kafka's default, 7
    # days); a message not consumed by then is trimmed too. Ids are remembered for a day.
    retention_ms: int = 7 * 24 * 3600 * 1000
    dedup_window_ms: int = 24 * 3600 * 1000
    group: str = "kombu"  # the consumer group of every queue
    # Messages a partition hands out at a time (its next batch once all are acked); inside
    # one, different keys (and keyless messages) run in parallel, each key in order.
    batch: int = 64
    lease_ttl_ms: int = 30_000  # a killed worker's partitions move after about this
    max_requeues: int = 10  # requeues of one message before it is dead-lettered
    ordering_header: str = ORDERING_HEADER
    get_wait_s: float = 2.0  # basic_get waits at most this for messages not yet handed over
    extra: dict[str, Any] = field(default_factory=dict)  # options Kombu itself reads

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> TransportOptions:
        known = {f.name for f in fields(cls)} - {"extra"}
        ours = {k: v for k, v in options.items() if k in known}
        extra = {k: v for k, v in options.items() if k not in known}
        result = cls(**ours, extra=extra)
        for name in ("partitions", "batch", "lease_ttl_ms", "retention_ms", "dedup_window_ms"):
            value = getattr(result, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"transport option {name}={value!r}: a positive int")
        return result


class QoS(virtual.QoS):
    """Prefetch accounting as Kombu's; unacked messages are never re-published: released, the
    group hands them out again (from the committed position), so nothing is sent twice."""

    def restore_unacked(self) -> list[Any]:
        self._flush()
        while self._delivered:
            tag, _ = self._delivered.popitem()
            self.channel._settle(tag, Outcome.RELEASE)
        return []

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to restore: a dead member's leases run out and its partitions move."""


class Channel(virtual.Channel):
    QoS = QoS
    supports_fanout = True
    do_restore = True  # QoS.restore_unacked releases (above); nothing is re-published

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._bridges: dict[str, QueueConsumer] = {}
        self._given: dict[str, Delivery] = {}  # delivery tag -> offered to Kombu, not settled
        self._no_ack: set[str] = set()
        self._queue_args: dict[str, dict[str, Any]] = {}
        self._auto_delete: set[str] = set()
        self._bridges_lock = threading.Lock()

    @property
    def options(self) -> TransportOptions:
        return self.connection.options

    @property
    def broker(self) -> redisq.Broker:
        return self.connection.broker

    # -- queues and exchanges ------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        arguments = kwargs.get("arguments") or {}
        self._queue_args[queue] = arguments
        if kwargs.get("auto_delete"):
            self._auto_delete.add(queue)
        ttl_ms = arguments.get("x-message-ttl")
        # A queue of one consumer (auto_delete: remote-control, replies) needs no parallelism.
        partitions = 1 if kwargs.get("auto_delete") else self.options.partitions
        self.connection.ensure_topic(queue, partitions, int(ttl_ms) if ttl_ms else None)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        try:
            self.broker.describe_topic(topic_for(queue))
        except TopicNotFound:
            return False
        return True

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        """The topic goes, with its group and dead-letter topic (AMQP's queue.delete); this
        channel's consumer of it first, and every binding to it."""
        self._close_bridge(queue)
        self.connection.bindings.unbind_queue(queue)
        self.connection.forget_topic(queue)
        try:
            self.broker.delete_topic(topic_for(queue), force=True)
        except TopicNotFound:
            pass

    def get_table(self, exchange: str) -> list[Binding]:
        return self.connection.bindings.table(exchange)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        self.connection.bindings.bind(exchange, Binding(routing_key, pattern, queue))

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        exchange = exchange or "amq.direct"
        _, pattern, _ = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        self.connection.bindings.unbind(exchange, Binding(routing_key, pattern, queue))

    # -- publishing ------------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        out = outgoing(message, self.options.ordering_header)
        self.connection.send(queue, out)

    def _put_fanout(
        self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any
    ) -> None:
        for binding in self.get_table(exchange):
            self._put(binding.queue, message)

    # -- consuming -------------------------------------------------------------------------------
    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            self._no_ack.add(queue)
        self._bridge(queue)
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._close_bridge(queue)
            if queue in self._auto_delete:  # AMQP: deleted when its last consumer goes
                try:
                    self._delete(queue)
                except (redis.RedisError, RedisqError) as error:  # a closing worker goes on
                    log.warning("deleting auto-delete queue %r: %s", queue, error)
        return result

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """The next message of `queue` handed over by the group (never waits)."""
        bridge = self._bridge(queue)
        delivery = bridge.take()
        if delivery is None:
            raise Empty()
        return self._give(delivery)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Kombu's synchronous get: a member that just joined waits (at most get_wait_s) until
        the group handed it what the topic holds, so a message published before is found."""
        bridge = self._bridge(queue)
        deadline = monotonic() + self.options.get_wait_s
        while True:
            delivery = bridge.take()
            if delivery is not None:
                break
            if monotonic() >= deadline or bridge.caught_up():
                return None
            self.connection.wait_for_wake(min(0.05, max(0.0, deadline - monotonic())))
        message = self.Message(self._give(delivery), channel=self)
        if no_ack:
            self._settle(message.delivery_tag, Outcome.ACK)
        else:
            self.qos.append(message, message.delivery_tag)
        return message

    def _give(self, delivery: Delivery) -> dict[str, Any]:
        payload = delivery.payload
        properties = payload["properties"]
        tag = self._next_delivery_tag()
        properties["delivery_tag"] = tag
        redelivered = delivery.message.attempt > 1 or delivery.requeues > 0
        payload["redelivered"] = redelivered
        properties.setdefault("delivery_info", {})["redelivered"] = redelivered
        self._given[tag] = delivery
        return payload

    def deliver_ready(self, limit: int | None) -> int:
        """Hand ready messages of consumed queues to their Kombu callbacks, within prefetch."""
        delivered = 0
        for queue in list(self._active_queues):
            bridge = self._bridges.get(queue)
            while bridge is not None and (limit is None or delivered < limit):
                if not self.qos.can_consume():
                    return delivered
                delivery = bridge.take()
                if delivery is None:
                    break
                payload = self._give(delivery)
                no_ack = queue in self._no_ack
                self.connection._deliver(payload, queue)
                if no_ack:
                    self._settle(payload["properties"]["delivery_tag"], Outcome.ACK)
                delivered += 1
        return delivered

    def has_ready(self) -> bool:
        return any(
            bridge.has_ready() for q, bridge in self._bridges.items() if q in self._active_queues
        )

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        self._settle(delivery_tag, Outcome.ACK)
        super().basic_ack(delivery_tag, multiple)
        self.connection.wake()  # room within prefetch: the loop delivers what waits

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        delivery = self._given.pop(delivery_tag, None)
        self.qos.ack(delivery_tag)  # out of the prefetch count either way
        if delivery is not None:
            if requeue:
                delivery.requeue()
            else:
                delivery.settle(Outcome.REJECT)
        self.connection.wake()

    def _settle(self, delivery_tag: str, outcome: Outcome) -> None:
        delivery = self._given.pop(delivery_tag, None)
        if delivery is not None:
            delivery.settle(outcome)

    def _size(self, queue: str) -> int:
        """Messages in the queue's topic (the log's length: see docs, 'What is not mapped')."""
        try:
            return self.broker.describe_topic(topic_for(queue)).total_messages
        except TopicNotFound:
            return 0

    def _purge(self, queue: str) -> int:
        """Kombu's purge on a log: the ready messages this member is handed are acked unread
        until it is caught up (partitions other live members hold stay theirs)."""
        bridge = self._bridge(queue)
        purged = 0
        deadline = monotonic() + self.options.get_wait_s
        while monotonic() < deadline:
            delivery = bridge.take()
            if delivery is not None:
                delivery.settle(Outcome.ACK)
                purged += 1
                continue
            if bridge.caught_up():
                break
            self.connection.wait_for_wake(0.05)
        self._close_bridge(queue)
        return purged

    # -- the queue's group member ----------------------------------------------------------------
    def _bridge(self, queue: str) -> QueueConsumer:
        with self._bridges_lock:
            bridge = self._bridges.get(queue)
            if bridge is None:
                topic = self.connection.ensure_topic(queue, self.options.partitions)
                ttl = self._queue_args.get(queue, {}).get("x-message-ttl")
                bridge = QueueConsumer(
                    self.broker,
                    queue,
                    topic,
                    group=self.options.group,
                    wake=self.connection.wake,
                    queue_ttl_ms=int(ttl) if ttl else None,
                    max_requeues=self.options.max_requeues,
                    batch=self.options.batch,
                    options={"lease_ttl_ms": self.options.lease_ttl_ms},
                )
                self._bridges[queue] = bridge
            return bridge

    def _close_bridge(self, queue: str) -> None:
        with self._bridges_lock:
            bridge = self._bridges.pop(queue, None)
        if bridge is None:
            return
        for tag, delivery in list(self._given.items()):
            if delivery.queue == queue:
                self._given.pop(tag, None)
                delivery.settle(Outcome.RELEASE)
        bridge.close()

    def close(self) -> None:
        if self.closed:
            return
        super().close()  # cancels the consumers (their bridges close), releases the unacked
        for queue in list(self._bridges):
            self._close_bridge(queue)


class Transport(virtual.Transport):
    """Kombu transport on redisq: ``transport="redisq.integrations.kombu:Transport"``, or the
    ``redisq://`` scheme once this module is imported."""

    Channel = Channel
    driver_type = "redisq"
    driver_name = "redisq"
    # kombu declares these None and float; drain_events waits on handed-over messages, no timer
    default_port = DEFAULT_PORT  # type: ignore[assignment]
    polling_interval = None  # type: ignore[assignment]

    connection_errors = virtual.Transport.connection_errors + (  # type: ignore[assignment]
        redis.ConnectionError,
        redis.TimeoutError,
        ConnectionError,
        socket.error,
    )
    channel_errors = virtual.Transport.channel_errors + (  # type: ignore[assignment]
        redis.ResponseError,
        RedisqError,
    )

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.options = TransportOptions.from_dict(dict(client.transport_options or {}))
        self._broker: redisq.Broker | None = None
        self._producer: redisq.Producer | None = None
        self._bindings: BindingLog | None = None
        self._topics: set[str] = set()
        self._topics_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)

    # -- the connection ----------------------------------------------------------------------------
    def establish_connection(self) -> Any:
        broker = redisq.connect(
            self._url(),
            namespace=self.options.namespace,
            socket_connect_timeout=self._conninfo.connect_timeout or 5,
        )
        self._broker = broker
        self._producer = broker.producer(idempotence="message_id")
        self._bindings = BindingLog(broker, self._producer)
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        super().close_connection(connection)
        producer, broker = self._producer, self._broker
        self._producer = self._broker = self._bindings = None
        if producer is not None:
            try:
                producer.close(5.0)
            except Exception as error:  # what it had not sent fails with ProducerClosed
                log.warning("closing the producer: %s", error)
        if broker is not None:
            broker.close()

    def _url(self) -> str:
        if self.options.url:
            return self.options.url
        conninfo = self._conninfo
        host = conninfo.hostname or "localhost"
        port = conninfo.port or DEFAULT_PORT
        auth = ""
        if conninfo.password:
            user = quote(conninfo.userid or "", safe="")
            auth = f"{user}:{quote(conninfo.password, safe='')}@"
        vhost = str(conninfo.virtual_host or "0").strip("/")
        db = vhost if vhost.isdigit() else "0"
        scheme = "rediss" if conninfo.ssl else "redis"
        return f"{scheme}://{auth}{host}:{port}/{db}"

    @property
    def _conninfo(self) -> Any:
        """The kombu.Connection this transport serves (kombu types it as None)."""
        return self.client

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": DEFAULT_PORT, "hostname": "localhost"}

    @property
    def broker(self) -> redisq.Broker:
        if self._broker is None:
            raise redis.ConnectionError("the redisq transport is not connected")
        return self._broker

    @property
    def bindings(self) -> BindingLog:
        if self._bindings is None:
            raise redis.ConnectionError("the redisq transport is not connected")
        return self._bindings

    # -- topics ------------------------------------------------------------------------------------
    def ensure_topic(self, queue: str, partitions: int, retention_ms: int | None = None) -> str:
        """The queue's topic, created on first use (as Redis creates a list on LPUSH); a queue
        with a message TTL keeps its messages that long."""
        topic = topic_for(queue)
        if topic not in self._topics:
            retention = retention_ms or self.options.retention_ms
            with self._topics_lock:
                self.broker.create_topic(
                    topic,
                    partitions,
                    retention_ms=retention,
                    dedup_window_ms=min(self.options.dedup_window_ms, retention),
                    exist_ok=True,
                )
                self._topics.add(topic)
        return topic

    def forget_topic(self, queue: str) -> None:
        with self._topics_lock:
            self._topics.discard(topic_for(queue))

    def send(self, queue: str, out: Outgoing) -> None:
        topic = self.ensure_topic(queue, self.options.partitions)
        try:
            self._send(topic, out)
        except TopicNotFound:  # deleted since it was cached: created again, as a list would be
            self.forget_topic(queue)
            self.ensure_topic(queue, self.options.partitions)
            self._send(topic, out)

    def _send(self, topic: str, out: Outgoing) -> None:
        if self._producer is None:
            raise redis.ConnectionError("the redisq transport is not connected")
        send = functools.partial(
            self._producer.send,
            topic,
            out.value,
            key=out.key,
            headers=out.headers or None,
            message_id=out.message_id,
            partition=out.partition,
        )
        if out.deliver_at is None:
            send()
            return
        try:
            send(deliver_at=out.deliver_at)
        except InvalidConfig as error:  # due past the topic's retention (or 3 days): held by
            log.info("%s: %s; sent now, the worker holds it", topic, error)  # the worker
            send()

    # -- waking the consuming loop -----------------------------------------------------------------
    def wake(self) -> None:
        """A message is ready (or prefetch room opened): wake drain_events / the event loop.
        One byte per call, no flag: a flag cleared by the reader can race a writer and lose
        the wake-up; a full pipe already wakes the reader."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        except OSError as error:
            if error.errno != errno.EBADF:
                raise

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:  # BlockingIOError: emptied
            pass

    def wait_for_wake(self, timeout: float) -> None:
        if timeout > 0:
            select.select([self._wake_r], [], [], timeout)
        self._drain_wake()

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Deliver one ready message; wait for one until timeout (socket.timeout then)."""
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            self._drain_wake()
            if self._deliver_ready(limit=1):
                return
            remaining = None if deadline is None else deadline - monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError()
            select.select([self._wake_r], [], [], 1.0 if remaining is None else remaining)

    def _deliver_ready(self, limit: int | None = None) -> int:
        delivered = 0
        channels: list[Channel] = list(self.channels or ())
        for channel in channels:
            if channel.closed or not channel._consumers:
                continue
            delivered += channel.deliver_ready(None if limit is None else limit - delivered)
            if limit is not None and delivered >= limit:
                break
        return delivered

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        loop.add_reader(self._wake_r, self._on_readable)
        loop.on_tick.add(self._on_tick)

    def _on_readable(self, *args: Any) -> None:
        self._drain_wake()
        self._deliver_ready()

    def _on_tick(self) -> None:
        channels: list[Channel] = list(self.channels or ())
        if any(channel.has_ready() for channel in channels if not channel.closed):
            self._deliver_ready()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
