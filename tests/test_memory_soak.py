"""Bounded memory: 300,000 messages from 3,000 short-lived producers (100 messages each, then
close), on a topic with a short retention and a short producer-state TTL. Redis memory grows
while messages are inside the retention window and falls back under a stated bound once they
are past it: retention trims the streams (on the next write: XTRIM MINID in the produce script),
and producer state and dedup buckets expire.

Runs with the suite (about a minute here). The longer soak of earlier waves, 1,000,000 messages
from 10,000 producers (2-3 minutes):
    REDISQ_SOAK_PRODUCERS=10000 pytest -s tests/test_memory_soak.py
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import redisq
from tests.replication import wait_for
from tests.servers import ServerProcess

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

TOPIC = "soak"
PARTITIONS = 8
PRODUCERS = int(os.environ.get("REDISQ_SOAK_PRODUCERS", "3000"))
PER_PRODUCER = 100
RETENTION_MS = 15_000
PRODUCER_STATE_TTL_MS = 1_000  # the topic keeps state max(this, retention) = 15 s
# A producer's state lives as long as it may re-send a batch (its delivery timeout, 120 s by
# default) and no less than the topic's retention.
DELIVERY_TIMEOUT_MS = 10_000
DEDUP_WINDOW_MS = 10_000  # message-id buckets live two windows
BOUND_BYTES = 1 << 20  # after retention: at most 1 MiB above the empty-topic baseline
MESSAGE_ID_EVERY = 10  # one producer in ten uses idempotence="message_id" (dedup buckets)


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def load_memory_benchmark() -> Any:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("redisq_memory_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_memory_falls_back_after_retention() -> None:
    server = ServerProcess().start()
    try:
        admin = server.client()
        namespace = f"soak{uuid.uuid4().hex[:6]}"
        broker = redisq.connect(server.url, namespace=namespace)
        broker.create_topic(
            TOPIC,
            partitions=PARTITIONS,
            retention_ms=RETENTION_MS,
            producer_state_ttl_ms=PRODUCER_STATE_TTL_MS,
            dedup_window_ms=DEDUP_WINDOW_MS,
        )
        baseline = used_memory(admin)
        keys_before = int(admin.dbsize())

        rng = random.Random(1)
        values = [b"x" * 100]
        peak = baseline
        samples: list[tuple[float, int, int]] = []
        start = time.monotonic()
        for n in range(PRODUCERS):
            mode = "message_id" if n % MESSAGE_ID_EVERY == 0 else "sequence"
            with broker.producer(
                idempotence=mode, delivery_timeout_ms=DELIVERY_TIMEOUT_MS
            ) as producer:
                for _ in range(PER_PRODUCER):
                    producer.send_async(TOPIC, values[0], key=b"key-%d" % rng.randrange(5000))
            if n % 500 == 499:
                memory = used_memory(admin)
                peak = max(peak, memory)
                samples.append((time.monotonic() - start, n + 1, memory))
        produce_s = time.monotonic() - start
        last_write = time.monotonic()
        retained = broker.describe_topic(TOPIC).total_messages
        at_end = used_memory(admin)
        keys_at_end = int(admin.dbsize())
        peak = max(peak, at_end)

        # Past the retention window, writes trim the streams: XTRIM MINID ~ in the produce
        # script removes at most 100 x stream-node-max-entries (10,000) entries per write, so a
        # burst of up to 125,000 entries per partition takes a few more writes to go.
        time.sleep(max(0.0, last_write + RETENTION_MS / 1000 + 1 - time.monotonic()))
        ticks = 0
        with broker.producer() as ticker:
            while True:
                for p in range(PARTITIONS):
                    ticker.send(TOPIC, b"tick", partition=p)
                ticks += 1
                trimmed = broker.describe_topic(TOPIC).total_messages
                if trimmed <= PARTITIONS * 200 or ticks >= 200:
                    break

        # Producer state (15 s: the retention) and dedup buckets (two windows) expire on their own;
        # SCAN visits keys, which expires the due ones without waiting for the active cycle.
        def settled() -> bool:
            for _ in admin.scan_iter(count=10_000):
                pass
            return used_memory(admin) <= baseline + BOUND_BYTES

        wait_for(settled, timeout=120, what="memory to fall back under the bound")
        after = used_memory(admin)
        keys_after = int(admin.dbsize())

        messages = PRODUCERS * PER_PRODUCER
        print(
            f"\nsoak: {messages:,} messages from {PRODUCERS:,} producers in {produce_s:.0f} s "
            f"({messages / produce_s:,.0f} msg/s, {PRODUCERS / produce_s:,.0f} producers/s)\n"
            f"  used_memory baseline {baseline / 1e6:.2f} MB, peak {peak / 1e6:.1f} MB, "
            f"at the end of producing {at_end / 1e6:.1f} MB "
            f"({retained:,} messages retained, {keys_at_end - keys_before:,} extra keys)\n"
            f"  after retention + expiry {after / 1e6:.2f} MB (bound: baseline + "
            f"{BOUND_BYTES / 1e6:.2f} MB); streams trimmed to {trimmed:,} messages by "
            f"{ticks} writes per partition; "
            f"{keys_after - keys_before:,} extra keys\n"
            f"  while producing: {(at_end - baseline) / max(retained, 1):.0f} B per retained "
            f"message (stream entries + producer state + dedup buckets)"
        )
        for elapsed, producers, memory in samples[:: max(1, len(samples) // 10)]:
            print(
                f"    t={elapsed:5.0f} s  producers={producers:6,}  "
                f"used_memory={memory / 1e6:6.1f} MB"
            )
        # How much the window held depends on how fast this machine produced (retention trims
        # while producing); what must hold is that it held a lot, and that all of it went.
        assert retained >= messages // 10, f"the soak never held much: {retained:,} retained"
        assert at_end - baseline > retained * 100, "the retained messages took no memory"
        assert after <= baseline + BOUND_BYTES
        assert trimmed < retained / 10

        # The benchmark measures topics as create_topic makes them by default (as this soak's
        # topic), and each of its rows names that format.
        benchmark = load_memory_benchmark()
        rows = benchmark.run(server.url, ids=30_000, messages=30_000, producers=300)
        print(benchmark.render(rows, markdown=True))
        default_format = broker.describe_topic(TOPIC).config.entry_format
        assert [row.entries.split(",")[0] for row in rows if row.entries] == [default_format] * 6
        per_partition = [
            row for row in rows if "per partition" in row.what or "partition of" in row.what
        ]
        assert len(per_partition) == 3 and all(row.per_item > 0 for row in per_partition)
        per_id = {row.what: row.per_item for row in rows}
        redisq_ids = next(v for k, v in per_id.items() if "redisq buckets" in k)
        plain_ids = next(v for k, v in per_id.items() if "baseline" in k)
        assert redisq_ids < plain_ids
        broker.close()
    finally:
        server.stop()
