"""Layouts for idle producer state: memory per (partition, producer), side by side in one run.

    python benchmarks/state_layouts.py [--url URL] [--states N] [--rounds R] [--markdown]

The performance issue asks for <= 100 B per idle producer state. What an idle producer leaves on
a partition it wrote one batch to is its epoch, the next sequence, the number of batches and one
window slot (base:count:first stream ID), kept until it expires. This writes N such states
(random 63-bit producer ids, the epoch a millisecond clock, as redisq's anonymous producers
have) in each layout and reports bytes per state: the change of INFO used_memory (which counts
what MEMORY USAGE leaves out: the expiry's own entry) and the sum of MEMORY USAGE over a sample.

Layouts:
- "hash per (partition, PID)": what redisq does (DESIGN: a key per (partition, PID) with an
  expiry refreshed on every write).
- "string per (partition, PID)": the same state packed into one string.
- "key per (partition, PID), value 1": the smallest value a key can hold, the floor of any
  layout with a key per state.
- "hash per partition, PID -> packed state": one field per producer, no expiry of its own (on
  Redis 7.0 nothing could expire an idle producer's field).
- "... with HPEXPIRE per field": the same with hash-field expiry, where the server has it
  (Valkey >= 9, Redis >= 7.4).

Servers as in dedup_layouts.py: its own redis-server and embedded valkey-server by default.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from dedup_layouts import delete_namespace, server_clients, used_memory

PARTITIONS = 4
TTL_MS = 86_400_000
EPOCH = 1_763_770_000_123
SAMPLE = 1_000


@dataclass
class Row:
    server: str
    layout: str
    bytes_per_state: float
    memory_usage: float


def state_hash(first_id: str) -> dict[str, str]:
    return {"epoch": str(EPOCH), "next": "1", "nb": "1", "w0": f"0:1:{first_id}"}


def packed(first_id: str) -> str:
    return f"{EPOCH}:1:1|0:1:{first_id}"


def key_of(ns: str, partition: int, pid: int) -> str:
    return f"{ns}:{{orders:{partition}}}:pid:{pid}"


def partition_hash(ns: str, partition: int) -> str:
    return f"{ns}:{{orders:{partition}}}:pids"


Writer = Callable[[Any, str, int, int, str], None]


def write_hash(pipe: Any, ns: str, p: int, pid: int, first_id: str) -> None:
    pipe.hset(key_of(ns, p, pid), mapping=state_hash(first_id))
    pipe.pexpire(key_of(ns, p, pid), TTL_MS)


def write_string(pipe: Any, ns: str, p: int, pid: int, first_id: str) -> None:
    pipe.set(key_of(ns, p, pid), packed(first_id), px=TTL_MS)


def write_floor(pipe: Any, ns: str, p: int, pid: int, first_id: str) -> None:
    pipe.set(key_of(ns, p, pid), 1, px=TTL_MS)


def write_field(pipe: Any, ns: str, p: int, pid: int, first_id: str) -> None:
    pipe.hset(partition_hash(ns, p), str(pid), packed(first_id))


def write_field_expiring(pipe: Any, ns: str, p: int, pid: int, first_id: str) -> None:
    pipe.hset(partition_hash(ns, p), str(pid), packed(first_id))
    pipe.execute_command("HPEXPIRE", partition_hash(ns, p), TTL_MS, "FIELDS", 1, str(pid))


@dataclass
class Layout:
    name: str
    write: Writer
    per_partition_hash: bool = False
    needs: str | None = None  # a command the server must have


LAYOUTS = [
    Layout("hash per (partition, PID) (redisq today)", write_hash),
    Layout("string per (partition, PID), packed", write_string),
    Layout("key per (partition, PID), value 1 (floor)", write_floor),
    Layout("hash per partition, PID -> packed state", write_field, per_partition_hash=True),
    Layout("... with HPEXPIRE per field", write_field_expiring, True, needs="HPEXPIRE"),
]


def has_command(client: Any, name: str) -> bool:
    try:
        client.execute_command(name)
    except redis.ResponseError as exc:  # "unknown command", or "wrong number of arguments"
        return "unknown command" not in str(exc).lower()
    return True


def measure(client: Any, server: str, layout: Layout, states: int) -> Row:
    ns = f"sl{uuid.uuid4().hex[:8]}"
    rng = random.Random(7)
    before = used_memory(client)
    pipe = client.pipeline(transaction=False)
    sampled: list[str] = []
    for i in range(states):
        p, pid = i % PARTITIONS, rng.getrandbits(63)
        layout.write(pipe, ns, p, pid, f"{EPOCH + i // 500}-{i % 500}")
        if not layout.per_partition_hash and len(sampled) < SAMPLE:
            sampled.append(key_of(ns, p, pid))
        if i % 2_000 == 1_999:
            pipe.execute()
    pipe.execute()
    after = used_memory(client)
    if layout.per_partition_hash:
        usage = sum(
            client.memory_usage(partition_hash(ns, p), samples=0) or 0 for p in range(PARTITIONS)
        )
        per_usage = usage / states
    else:
        per_usage = statistics.fmean(client.memory_usage(k) or 0 for k in sampled)
    delete_namespace(client, ns)
    return Row(server, layout.name, (after - before) / states, per_usage)


def run(url: str | None, states: int, rounds: int) -> list[Row]:
    rows: list[Row] = []
    for label, client in server_clients(url):
        layouts = [x for x in LAYOUTS if x.needs is None or has_command(client, x.needs)]
        measured: dict[str, list[Row]] = {x.name: [] for x in layouts}
        for round_no in range(rounds):
            for layout in layouts:  # interleaved
                measured[layout.name].append(measure(client, label, layout, states))
            print(f"  {label}: round {round_no + 1} of {rounds} done", file=sys.stderr)
        for layout in LAYOUTS:
            got = measured.get(layout.name)
            if not got:
                print(f"  {label}: no {layout.needs}: {layout.name!r} skipped", file=sys.stderr)
                continue
            rows.append(
                Row(
                    label,
                    layout.name,
                    statistics.median(r.bytes_per_state for r in got),
                    statistics.median(r.memory_usage for r in got),
                )
            )
    return rows


def render(rows: list[Row], markdown: bool) -> str:
    lines = []
    if markdown:
        lines += [
            "| server | layout | bytes per state (used_memory) | MEMORY USAGE per state |",
            "| --- | --- | ---: | ---: |",
        ]
    for row in rows:
        if markdown:
            lines.append(
                f"| {row.server} | {row.layout} | {row.bytes_per_state:.1f} | "
                f"{row.memory_usage:.1f} |"
            )
        else:
            lines.append(
                f"{row.server:<24} {row.layout:<46} {row.bytes_per_state:>7.1f} B "
                f"{row.memory_usage:>7.1f} B"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an idle server (default: start our own)")
    parser.add_argument("--states", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(render(run(args.url, args.states, args.rounds), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
