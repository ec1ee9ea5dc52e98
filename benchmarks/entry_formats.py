"""What the entry format costs: one stream entry per message (redisq) against one per batch.

    python benchmarks/entry_formats.py [--url URL] [--valkey] [--messages N] [--rounds R]
                                       [--no-rabbit] [--markdown]

The performance issue asks for `sequence` produce at >= 2x RabbitMQ Streams' deduplicated
publish. redisq writes one stream entry per message, so the server does an XADD per message in
the produce script. This measures, side by side in one run, on the same keyed 100-byte messages
(peers.py's workload, 4 partitions by CRC-32 of the key), what each format costs the server and
the client:

- "raw XADD": redis-py pipelined XADD, 1000 per round trip (the baseline);
- "redisq sequence": redisq's producer (send_async per message, then flush);
- "entry per message, script": a minimal version of redisq's produce script (producer state
  checked and updated once per batch, one XADD per message with the same four fields k, v, p, s),
  its arguments packed once in RESP by the client, 500 messages per call;
- "entry per batch, script": the same check, and one XADD per batch holding the batch's
  messages in one field (length-prefixed key and value), as Kafka's record batches and
  RabbitMQ's sub-entries do;
- "RabbitMQ Streams": peers.py's named producer with publishing ids and confirms.

Per variant: msg/s, the server's CPU per message (INFO cpu, main process), and the benchmark
process's CPU per message (client threads included). RabbitMQ's broker CPU is not read. The two
script variants are prototypes that nothing reads: they show how far each format lets a producer
go on this machine, not a finished feature.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import redis
from peers import RabbitSide, Skip, Workload, start_valkey
from report import print_table, run_rounds

import redisq
from redisq.protocol.resp import command

PARTITIONS = 4
BATCH = 500
PIPELINE = 8  # script calls in flight per round trip

# KEYS[1] stream, KEYS[2] producer state; ARGV[1] producer id, ARGV[2] base sequence, ARGV[3]
# count, ARGV[4...] the batch. The state check is the same in both: next sequence must match.
CHECK = """
local state = redis.call('HMGET', KEYS[2], 'epoch', 'next')
local next_seq = tonumber(state[2]) or 0
if tonumber(ARGV[2]) ~= next_seq then
  return redis.error_reply('OUT_OF_ORDER expected=' .. next_seq)
end
local count = tonumber(ARGV[3])
"""
UPDATE = """
redis.call('HSET', KEYS[2], 'epoch', '0', 'next', next_seq + count)
return first
"""
PER_MESSAGE = (
    CHECK
    + """
local first
for i = 0, count - 1 do
  local id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[4 + 2 * i], 'v', ARGV[5 + 2 * i],
    'p', ARGV[1], 's', next_seq + i)
  first = first or id
end
"""
    + UPDATE
)
PER_BATCH = (
    CHECK
    + """
local first = redis.call('XADD', KEYS[1], '*', 'n', ARGV[3], 'b', ARGV[4], 'p', ARGV[1],
  's', ARGV[2])
"""
    + UPDATE
)
_HEAD = struct.Struct(">BI")  # key length, value length
RABBIT = "RabbitMQ Streams (rstream, dedup + confirms)"


class ServerSide:
    """The Redis variants on one server, with its CPU read around each run."""

    def __init__(self, url: str, work: Workload) -> None:
        self.client = redis.Redis.from_url(url)
        info = self.client.info("server")
        version = info.get("valkey_version") or info["redis_version"]
        self.label = f"{'Valkey' if 'valkey_version' in info else 'Redis'} {version}"
        self.url, self.work = url, work
        self.ns = f"entryformats-{uuid.uuid4().hex[:6]}"
        self.per_message = self.client.script_load(PER_MESSAGE)
        self.per_batch = self.client.script_load(PER_BATCH)
        self.partition_of = [zlib.crc32(k) % PARTITIONS for k in work.keys]
        self.written: list[str] = []
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # variant -> (server, client) µs/msg

    def _server_cpu(self) -> float:
        cpu = self.client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def measured(self, name: str, run: Callable[[], int]) -> Callable[[], float]:
        """run() writes the workload and returns how many messages the server holds."""

        def timed() -> float:
            server, client = self._server_cpu(), time.process_time()
            start = time.perf_counter()
            stored = run()
            elapsed = time.perf_counter() - start
            n = self.work.n
            if stored != n:
                raise RuntimeError(f"{name}: {stored:,} stored of {n:,}")
            per = (
                (self._server_cpu() - server) / n * 1e6,
                (time.process_time() - client) / n * 1e6,
            )
            self.cpu.setdefault(name, []).append(per)
            return n / elapsed

        return timed

    def _streams(self) -> list[str]:
        run = uuid.uuid4().hex[:6]
        streams = [f"{self.ns}:{{{run}:{p}}}" for p in range(PARTITIONS)]
        self.written += streams + [f"{s}:pid" for s in streams]
        return streams

    def raw(self) -> int:
        streams = self._streams()
        pipe = self.client.pipeline(transaction=False)
        for i, (key, value) in enumerate(zip(self.work.keys, self.work.values, strict=True)):
            pipe.xadd(streams[self.partition_of[i]], {"k": key, "v": value})
            if (i + 1) % 1000 == 0:
                pipe.execute()
        pipe.execute()
        return sum(self.client.xlen(s) for s in streams)

    def redisq_sequence(self) -> int:
        topic = f"t{uuid.uuid4().hex[:6]}"
        with redisq.connect(self.url, namespace=self.ns) as broker:
            broker.create_topic(topic, partitions=PARTITIONS)
            with broker.producer(idempotence="sequence") as producer:
                for key, value in zip(self.work.keys, self.work.values, strict=True):
                    producer.send_async(topic, value, key=key)
                producer.flush()
            stored = broker.describe_topic(topic).total_messages
            broker.delete_topic(topic)
        return stored

    def _scripted(self, sha: str, pack: Callable[[list[int]], list[bytes]]) -> int:
        """Batches of BATCH messages per partition, each call's RESP made once by the client, up
        to PIPELINE calls per round trip on one connection."""
        streams = self._streams()
        members: list[list[int]] = [[] for _ in range(PARTITIONS)]
        for i, p in enumerate(self.partition_of):
            members[p].append(i)
        calls: list[bytes] = []
        for p, indexes in enumerate(members):
            for base in range(0, len(indexes), BATCH):
                chunk = indexes[base : base + BATCH]
                keys = (streams[p], f"{streams[p]}:pid")
                args = (sha, 2, *keys, 1, base, len(chunk), *pack(chunk))
                calls.append(command(b"EVALSHA", args))
        connection = self.client.connection_pool.get_connection("EVALSHA")
        try:
            for start in range(0, len(calls), PIPELINE):
                group = calls[start : start + PIPELINE]
                connection.send_packed_command(group)
                for _ in group:
                    connection.read_response()
        finally:
            self.client.connection_pool.release(connection)
        return (
            sum(self.client.xlen(s) for s in streams)
            if sha == self.per_message
            else sum(
                int(fields[b"n"])
                for s in streams
                for _, fields in self.client.xrange(s)  # one entry per batch: count its messages
            )
        )

    def per_message_script(self) -> int:
        keys, values = self.work.keys, self.work.values
        return self._scripted(
            self.per_message, lambda chunk: [x for i in chunk for x in (keys[i], values[i])]
        )

    def per_batch_script(self) -> int:
        keys, values = self.work.keys, self.work.values
        head = _HEAD.pack

        def blob(chunk: list[int]) -> list[bytes]:
            return [
                b"".join(head(len(keys[i]), len(values[i])) + keys[i] + values[i] for i in chunk)
            ]

        return self._scripted(self.per_batch, blob)

    def close(self) -> None:
        for start in range(0, len(self.written), 100):
            self.client.delete(*self.written[start : start + 100])
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--valkey", action="store_true", help="the embedded valkey-server instead")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rabbit", default="127.0.0.1:5552", help="RabbitMQ Streams host:port")
    parser.add_argument("--no-rabbit", action="store_true", help="leave RabbitMQ Streams out")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    work = Workload.make(args.messages)
    valkey = None
    url = args.url
    if args.valkey:
        valkey, url = start_valkey()
    side = ServerSide(url, work)
    rabbit: Any = None
    try:
        variants = {
            "raw XADD, pipelined 1000": side.measured("raw", side.raw),
            'redisq "sequence" (send_async)': side.measured("redisq", side.redisq_sequence),
            "entry per message, script": side.measured("per message", side.per_message_script),
            "entry per batch, script": side.measured("per batch", side.per_batch_script),
        }
        if not args.no_rabbit:
            host, _, port = args.rabbit.rpartition(":")
            rabbit = RabbitSide(host, int(port), "guest", "guest", work)
            try:
                print(f"peer: {rabbit.probe(enable=True)}", file=sys.stderr)
                variants[RABBIT] = lambda: rabbit.produce()[0]
            except Skip as exc:
                print(f"RabbitMQ Streams skipped: {exc}", file=sys.stderr)
                rabbit = None
        load = os.getloadavg()[0]
        medians = run_rounds(variants, args.rounds)
    finally:
        side.close()
        if rabbit is not None:
            rabbit.close()
        if valkey is not None:
            valkey.stop()
    raw = medians["raw XADD, pipelined 1000"]
    peer = medians.get(RABBIT)
    cpu_names = dict(zip(variants, ("raw", "redisq", "per message", "per batch"), strict=False))
    rows = []
    for name, rate in medians.items():
        cpu = side.cpu.get(cpu_names.get(name, ""), [])
        server = f"{sorted(c[0] for c in cpu)[len(cpu) // 2]:.2f}" if cpu else "-"
        client = f"{sorted(c[1] for c in cpu)[len(cpu) // 2]:.2f}" if cpu else "-"
        rows.append([
            name, f"{rate:,.0f}", f"{rate / raw:.2f}x",
            f"{rate / peer:.2f}x" if peer else "-", server, client,
        ])  # fmt: skip
    print(
        f"\n{side.label}; {work.n:,} keyed 100-B messages, {PARTITIONS} partitions, median of "
        f"{args.rounds} interleaved rounds; load average {load:.2f} before"
    )
    heads = ["variant", "msg/s", "vs raw", "vs RabbitMQ", "server µs/msg", "client µs/msg"]
    print_table(heads, rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
