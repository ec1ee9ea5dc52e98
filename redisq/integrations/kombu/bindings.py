"""Exchange bindings shared by every process: a one-partition topic of bind/unbind records.

Kombu's virtual transports keep exchanges and bindings in the process; a publisher in another
process (a Celery client, `celery inspect`) must see the queues a worker bound. Kombu's Redis
transport keeps them in Redis sets; here they are a log that every process folds into the same
table (one partition: one order for everyone), read again from where it stopped before each
lookup, one XRANGE that is empty when nothing changed.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, NamedTuple

from redisq.errors import TopicNotFound
from redisq.integrations.kombu.names import BINDINGS_TOPIC

if TYPE_CHECKING:
    import redisq


class Binding(NamedTuple):
    """One row of an exchange's table, as Kombu's exchange types read it."""

    routing_key: str
    pattern: str | None
    queue: str


class BindingLog:
    def __init__(self, broker: redisq.Broker, producer: redisq.Producer) -> None:
        self._broker = broker
        self._producer = producer
        self._lock = threading.Lock()
        self._tables: dict[str, dict[Binding, None]] = {}  # exchange -> bindings, in bind order
        self._after: str | None = None  # the last record folded in
        self._created = False

    def table(self, exchange: str) -> list[Binding]:
        """The exchange's bindings as every process sees them now."""
        with self._lock:
            self._catch_up()
            return list(self._tables.get(exchange, ()))

    def bind(self, exchange: str, binding: Binding) -> None:
        with self._lock:
            self._catch_up()
            if binding in self._tables.get(exchange, {}):
                return
        self._append("bind", exchange, binding)

    def unbind(self, exchange: str, binding: Binding) -> None:
        self._append("unbind", exchange, binding)

    def unbind_queue(self, queue: str) -> None:
        """Every binding of `queue` (it was deleted): publishers stop routing to it."""
        with self._lock:
            self._catch_up()
            doomed = [
                (exchange, binding)
                for exchange, table in self._tables.items()
                for binding in table
                if binding.queue == queue
            ]
        for exchange, binding in doomed:
            self._append("unbind", exchange, binding)

    def _append(self, op: str, exchange: str, binding: Binding) -> None:
        self._ensure_topic()
        record = {"op": op, "exchange": exchange, **binding._asdict()}
        self._producer.send(BINDINGS_TOPIC, json.dumps(record), key=exchange or "-")
        with self._lock:
            self._catch_up()

    def _ensure_topic(self) -> None:
        if not self._created:
            self._broker.create_topic(BINDINGS_TOPIC, 1, exist_ok=True)
            self._created = True

    def _catch_up(self) -> None:
        """Fold in the records appended since the last look (the caller holds the lock)."""
        start = "-" if self._after is None else f"({self._after}"
        try:
            records = list(self._broker.read(BINDINGS_TOPIC, 0, start=start))
        except TopicNotFound:
            return
        for record in records:
            self._after = record.offset
            try:
                fields = json.loads(record.value)
                exchange = fields["exchange"]
                binding = Binding(fields["routing_key"], fields["pattern"], fields["queue"])
            except (ValueError, KeyError, TypeError):
                continue  # not ours: another client's entry changes no binding
            table = self._tables.setdefault(exchange, {})
            if fields.get("op") == "bind":
                table[binding] = None
            else:
                table.pop(binding, None)
