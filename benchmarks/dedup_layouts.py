"""Layouts for remembered message ids: memory and server time per id, side by side in one run.

    python benchmarks/dedup_layouts.py [--url URL] [--ids N] [--rounds R] [--markdown]

The performance issue asks for <= 40 B per remembered id (with its original offset) while
`idempotence="message_id"` stays >= 1.5x raw XADD. This measures the candidate layouts the way
the produce script would use them: per batch of 500 ids, look each id up in the current and the
previous time slice of the dedup ring, and insert the new ones with their offset. The previous
slice is filled with as many other ids first, as in a steady state. Per layout and server:

- bytes per id: the change of INFO used_memory over the current slice's ids;
- server µs per id: INFO commandstats time of the script calls, divided by the ids.

Layouts:
- "hash id -> offset": what redisq does, two hashes per partition (HMGET x2 + HSET per batch).
- "hash fingerprint -> offset": the same with an 8-byte fingerprint of the id and a packed
  10-byte offset (an exact store would also read the original entry on every match).
- "small hashes by fingerprint": ~80 ids per hash so each stays listpack-encoded, every hash
  named in KEYS (HGET x2 + HSET per id).
- "key per id": SET id offset NX PX (the one-key-per-id scheme).

By default it starts its own servers: redis-server from PATH and the embedded valkey-server,
both without persistence, and stops them; --url measures a server of yours instead (an idle one,
and the script flushes nothing: it deletes the keys it wrote).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

BATCH = 500
IDS_PER_SMALL_HASH = 80

TWO_HASHES = """
local n = #ARGV / 2
local ids = {}
for i = 1, n do ids[i] = ARGV[2 * i - 1] end
local now = redis.call('HMGET', KEYS[1], unpack(ids))
local before = redis.call('HMGET', KEYS[2], unpack(ids))
local new = {}
for i = 1, n do
  if not now[i] and not before[i] then
    new[#new + 1] = ARGV[2 * i - 1]
    new[#new + 1] = ARGV[2 * i]
  end
end
if #new > 0 then redis.call('HSET', KEYS[1], unpack(new)) end
return #new / 2
"""

SMALL_HASHES = """
local n = #ARGV / 2
local added = 0
for i = 1, n do
  local id = ARGV[2 * i - 1]
  if not redis.call('HGET', KEYS[2 * i - 1], id) and not redis.call('HGET', KEYS[2 * i], id) then
    redis.call('HSET', KEYS[2 * i - 1], id, ARGV[2 * i])
    added = added + 1
  end
end
return added
"""

KEY_PER_ID = """
local added = 0
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i], ARGV[i], 'NX', 'PX', 3600000) then added = added + 1 end
end
return added
"""


@dataclass
class Row:
    server: str
    layout: str
    bytes_per_id: float
    server_us_per_id: float


def fingerprint(message_id: bytes) -> bytes:
    return hashlib.blake2b(message_id, digest_size=8).digest()


def packed_offset(index: int) -> bytes:
    return (1_763_770_000_000 + index // 100).to_bytes(6, "big") + (index % 100).to_bytes(4, "big")


def text_offset(index: int) -> bytes:
    return b"%d-%d" % (1_763_770_000_000 + index // 100, index % 100)


class Layout:
    """One layout: batches of (keys, args) for the ids [start, start + BATCH) of a slice."""

    def __init__(self, name: str, script: str, ids: int) -> None:
        self.name = name
        self.script = script
        self.small_hashes = max(1, ids // IDS_PER_SMALL_HASH)

    def batch(self, ns: str, slice_no: int, start: int, end: int) -> tuple[list, list]:
        numbered = [(i, b"order-%d-%012d" % (slice_no, i)) for i in range(start, end)]
        now, before = f"{ns}:{{p}}:s{slice_no}", f"{ns}:{{p}}:s{slice_no - 1}"
        if self.script is KEY_PER_ID:
            keys = [f"{ns}:{{p}}:id:{m.decode()}" for _, m in numbered]
            return keys, [text_offset(i) for i, _ in numbered]
        if self.script is TWO_HASHES:
            if self.name.startswith("hash id"):
                pairs = [(m, text_offset(i)) for i, m in numbered]
            else:
                pairs = [(fingerprint(m), packed_offset(i)) for i, m in numbered]
            return [now, before], [x for pair in pairs for x in pair]
        keys: list[str] = []
        args: list[bytes] = []
        for i, m in numbered:
            fp = fingerprint(m)
            shard = int.from_bytes(fp[:4], "big") % self.small_hashes
            keys += [f"{now}:{shard}", f"{before}:{shard}"]
            args += [fp, packed_offset(i)]
        return keys, args


def load(client: Any, layout: Layout, ns: str, slice_no: int, ids: int) -> None:
    script = client.register_script(layout.script)
    pipe = client.pipeline(transaction=False)
    for n, start in enumerate(range(0, ids, BATCH)):
        keys, args = layout.batch(ns, slice_no, start, min(ids, start + BATCH))
        script(keys=keys, args=args, client=pipe)
        if n % 8 == 7:
            pipe.execute()
    pipe.execute()


def script_usec(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(
        int(v.get("usec", 0)) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def used_memory(client: Any) -> int:
    time.sleep(0.3)  # lazy frees run in a background thread
    return int(client.info("memory")["used_memory"])


def delete_namespace(client: Any, ns: str) -> None:
    for keys in batched(client.scan_iter(match=f"{ns}:*", count=10_000), 5_000):
        client.unlink(*keys)


def batched(items: Any, size: int) -> Any:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def measure(client: Any, server: str, layout: Layout, ids: int) -> Row:
    ns = f"dl{uuid.uuid4().hex[:8]}"
    load(client, layout, ns, 0, ids)  # the previous slice
    before = used_memory(client)
    usec = script_usec(client)
    load(client, layout, ns, 1, ids)
    usec = script_usec(client) - usec
    after = used_memory(client)
    delete_namespace(client, ns)
    return Row(server, layout.name, (after - before) / ids, usec / ids)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(binary: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return process, url


def servers(url: str | None) -> list[tuple[str, str | None]]:
    if url is not None:
        return [(url, None)]
    found: list[tuple[str, str | None]] = []
    if shutil.which("redis-server"):
        found.append(("redis-server", shutil.which("redis-server")))
    try:
        from redisq.server.embedded import valkey_binary

        found.append(("embedded valkey-server", valkey_binary()))
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"no embedded valkey-server ({exc}): skipped", file=sys.stderr)
    return found


def server_clients(url: str | None) -> Iterator[tuple[str, Any]]:
    """(label, client) of each server to measure: the one at --url, or our own redis-server
    and embedded valkey-server, each started for the measurement and stopped after it."""
    for name, binary in servers(url):
        process = None
        target = name
        if binary is not None:
            process, target = start_server(binary)
        try:
            client = redis.Redis.from_url(target)
            info = client.info("server")
            version = info.get("valkey_version") or info["redis_version"]
            yield ("your server" if url is not None else f"{name} {version}"), client
            client.close()
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=30)


def run(url: str | None, ids: int, rounds: int) -> list[Row]:
    layouts = [
        Layout("hash id -> offset (redisq today)", TWO_HASHES, ids),
        Layout("hash fingerprint -> offset", TWO_HASHES, ids),
        Layout(f"small hashes by fingerprint (~{IDS_PER_SMALL_HASH} ids each)", SMALL_HASHES, ids),
        Layout("key per id, SET NX PX", KEY_PER_ID, ids),
    ]
    rows: list[Row] = []
    for label, client in server_clients(url):
        measured: dict[str, list[Row]] = {layout.name: [] for layout in layouts}
        for round_no in range(rounds):
            for layout in layouts:  # interleaved: each round measures every layout
                measured[layout.name].append(measure(client, label, layout, ids))
            print(f"  {label}: round {round_no + 1} of {rounds} done", file=sys.stderr, flush=True)
        for layout in layouts:
            got = measured[layout.name]
            rows.append(
                Row(
                    label,
                    layout.name,
                    statistics.median(r.bytes_per_id for r in got),
                    statistics.median(r.server_us_per_id for r in got),
                )
            )
    return rows


def render(rows: list[Row], markdown: bool) -> str:
    lines = []
    if markdown:
        lines += [
            "| server | layout | bytes per id | server µs per id | time vs today |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
    today: dict[str, float] = {}
    for row in rows:
        if row.layout.startswith("hash id"):
            today[row.server] = row.server_us_per_id
        ratio = f"{row.server_us_per_id / today[row.server]:.2f}x"
        if markdown:
            lines.append(
                f"| {row.server} | {row.layout} | {row.bytes_per_id:.1f} | "
                f"{row.server_us_per_id:.2f} | {ratio} |"
            )
        else:
            lines.append(
                f"{row.server:<24} {row.layout:<40} {row.bytes_per_id:>7.1f} B "
                f"{row.server_us_per_id:>6.2f} µs  {ratio}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an idle server (default: start our own)")
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(render(run(args.url, args.ids, args.rounds), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
