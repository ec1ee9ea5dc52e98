"""Produce throughput, side by side in one run, against raw redis-py pipelined XADD.

    python benchmarks/produce.py [--url URL] [--messages N] [--repeat R] [--no-asyncio]
                                 [--retention-ms MS] [--only TEXT] [--markdown]

Every variant writes the same messages (100-byte payloads, keys "key-<i % 1000>", 4 partitions)
to the same server; each runs R times, interleaved, and the median counts. The ratio column is
msg/s divided by the raw pipelined XADD baseline of the same run (the same keyed messages, routed
by the same CRC-32); a value-only XADD row is shown for context. The redisq rows send with
send_async and then flush(); message_id rows give each message an explicit id ("m-<i>"). The
redisq.asyncio rows do the same on the asyncio producer (send_async returns an asyncio.Future
per message; the caller yields to the loop every 1,000 sends). Without --url or REDIS_URL it
uses the embedded valkey-server. --retention-ms gives the topics retention by age (the message_id
script then trims exactly before each batch); --only keeps the rows whose name contains TEXT
(and the raw XADD baseline); --backlog N writes N messages to a topic of its own first and
keeps them until the end, as a server that holds data (message ids included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
import zlib

import redis
from report import print_table, ratio_rows, run_rounds

import redisq
import redisq.asyncio as redisq_asyncio

PARTITIONS = 4
PAYLOAD = b"x" * 100


def keys_for(n: int) -> list[bytes]:
    return [b"key-%d" % (i % 1000) for i in range(n)]


def run_raw(client: redis.Redis, namespace: str, n: int, pipeline_size: int = 1000) -> float:
    """The baseline: XADD per message, pipelined 1000 at a time, key-hashed to 4 streams."""
    streams = [f"{namespace}:raw:{p}" for p in range(PARTITIONS)]
    keys = keys_for(n)
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(keys):
        pipe.xadd(streams[zlib.crc32(key) % PARTITIONS], {"k": key, "v": PAYLOAD})
        if (i + 1) % pipeline_size == 0:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - start
    client.delete(*streams)
    return n / elapsed


def run_raw_value_only(client: redis.Redis, namespace: str, n: int) -> float:
    """For context: the same XADD without a key field, round-robin over the 4 streams."""
    streams = [f"{namespace}:raw:{p}" for p in range(PARTITIONS)]
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(streams[i % PARTITIONS], {"v": PAYLOAD})
        if (i + 1) % 1000 == 0:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - start
    client.delete(*streams)
    return n / elapsed


def ids_for(n: int) -> list[bytes]:
    return [b"m-%d" % i for i in range(n)]


def run_redisq(
    broker: redisq.Broker, idempotence: str | None, n: int, retention_ms: int = 0
) -> float:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=PARTITIONS, retention_ms=retention_ms)
    keys = keys_for(n)
    ids = ids_for(n)
    with broker.producer(idempotence=idempotence) as producer:
        start = time.perf_counter()
        send = producer.send_async
        if idempotence == "message_id":
            for key, message_id in zip(keys, ids, strict=True):
                send(topic, PAYLOAD, key=key, message_id=message_id)
        else:
            for key in keys:
                send(topic, PAYLOAD, key=key)
        producer.flush()
        elapsed = time.perf_counter() - start
    total = broker.describe_topic(topic).total_messages
    broker.delete_topic(topic)
    if total != n and not retention_ms:  # with retention, the run's start may be trimmed
        raise SystemExit(f"{idempotence}: wrote {total} messages, expected {n}")
    return n / elapsed


def run_asyncio(
    url: str | None, namespace: str, idempotence: str, n: int, retention_ms: int = 0
) -> float:
    """The asyncio producer: send_async per message (a future each), yielding to the loop
    every 1,000, then flush()."""

    async def main() -> float:
        broker = await redisq_asyncio.connect(url, namespace=namespace)
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        keys = keys_for(n)
        ids = ids_for(n)
        try:
            await broker.create_topic(topic, partitions=PARTITIONS, retention_ms=retention_ms)
            # The whole run may sit in the buffer (as in the thread rows): max_buffered_messages
            # above n, or send_async refuses once the sender falls 100,000 behind.
            async with broker.producer(
                idempotence=idempotence, max_buffered_messages=n + 1000
            ) as producer:
                await producer.send(topic, PAYLOAD, key=b"warm-up")  # identity, metadata
                start = time.perf_counter()
                send = producer.send_async
                # The caller yields to the event loop every 1,000 sends, as an application
                # that awaits anything does: the sender writes meanwhile (without it, nothing
                # is written until flush() and send_async refuses past max_buffered_messages).
                if idempotence == "message_id":
                    for i, (key, message_id) in enumerate(zip(keys, ids, strict=True)):
                        send(topic, PAYLOAD, key=key, message_id=message_id)
                        if i % 1000 == 999:
                            await asyncio.sleep(0)
                else:
                    for i, key in enumerate(keys):
                        send(topic, PAYLOAD, key=key)
                        if i % 1000 == 999:
                            await asyncio.sleep(0)
                await producer.flush()
                elapsed = time.perf_counter() - start
            total = (await broker.describe_topic(topic)).total_messages
            await broker.delete_topic(topic)
        finally:
            await broker.close()
        if total != n + 1 and not retention_ms:
            raise SystemExit(f"asyncio {idempotence}: wrote {total} messages, expected {n + 1}")
        return n / elapsed

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-asyncio", action="store_true", help="leave out the asyncio rows")
    parser.add_argument("--retention-ms", type=int, default=0, help="topics' retention by age")
    parser.add_argument("--only", default="", help="keep the rows whose name contains this")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        help="messages a topic of its own holds during the run (a server holding data)",
    )
    args = parser.parse_args(argv)

    broker = redisq.connect(args.url, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    client = broker.client
    if args.backlog:
        print(f"writing a backlog of {args.backlog:,} messages", file=sys.stderr)
        broker.create_topic("backlog", partitions=PARTITIONS)
        with broker.producer(idempotence="message_id") as producer:
            for i in range(args.backlog):
                producer.send_async("backlog", PAYLOAD, key=b"key-%d" % (i % 1000))
    variants = {
        "raw redis-py XADD, pipelined 1000": lambda: run_raw(
            client, broker.namespace, args.messages
        ),
        "raw redis-py XADD, pipelined 1000, no key": lambda: run_raw_value_only(
            client, broker.namespace, args.messages
        ),
    }
    for mode in ("sequence", "message_id", None):
        name = f'redisq idempotence="{mode}"' if mode else "redisq idempotence=None"
        variants[name] = lambda mode=mode: run_redisq(
            broker, mode, args.messages, args.retention_ms
        )
    if not args.no_asyncio:
        for mode in ("sequence", "message_id"):
            variants[f'redisq.asyncio idempotence="{mode}"'] = lambda mode=mode: run_asyncio(
                args.url, broker.namespace, mode, args.messages, args.retention_ms
            )
    baseline = "raw redis-py XADD, pipelined 1000"
    variants = {k: v for k, v in variants.items() if k == baseline or args.only in k}
    medians = run_rounds(variants, args.repeat)
    retention = f", retention_ms {args.retention_ms}" if args.retention_ms else ""
    if args.backlog:
        retention += f", a backlog of {args.backlog:,} messages held"
        broker.delete_topic("backlog")
    print(
        f"\nserver: {broker.server}; {args.messages:,} messages of 100 B, {PARTITIONS} partitions, "
        f"median of {args.repeat}{retention}"
    )
    print_table(
        ["variant", "msg/s", "ratio to raw XADD"],
        ratio_rows(medians, "raw redis-py XADD, pipelined 1000"),
        args.markdown,
    )
    for key in client.scan_iter(match=broker.keys.pattern(), count=1000):
        client.delete(key)  # the benchmark's namespace: producer-id counters, worker leases
    broker.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
