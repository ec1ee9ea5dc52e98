"""`redisq demo`: the mission end to end, on the embedded server unless --url/REDIS_URL is given.

1. A key-ordered, idempotent producer sends messages for many keys while a chaos thread kills
   its connections over and over (CLIENT KILL): the producer retries the very same batches.
2. A check reads every partition back and prints whether every key's messages are there once
   each, in the order they were sent.
3. message_id mode: the same business ids sent twice are written once.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

import redis

import redisq
from redisq.cli import Progress, print_table

TOPIC = "demo-orders"
CHAOS_NAME = "redisq-demo-producer"


class ConnectionChaos(threading.Thread):
    """Kills the demo producer's connections (found by client name) every `interval` seconds."""

    def __init__(self, client: Any, interval: float = 0.05) -> None:
        super().__init__(name="redisq-demo-chaos", daemon=True)
        self._client = client
        self._interval = interval
        self._stop_event = threading.Event()
        self.kills = 0

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            try:
                for info in self._client.client_list():
                    if info.get("name") == CHAOS_NAME:
                        self._client.client_kill_filter(_id=info["id"])
                        self.kills += 1
            except redis.RedisError:
                pass

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def produce_with_chaos(url: str | None, namespace: str, messages: int, keys: int) -> dict[str, Any]:
    admin = redisq.connect(url, namespace=namespace)
    admin.create_topic(TOPIC, partitions=4, exist_ok=True)
    chaos_target = redisq.connect(url, namespace=namespace, client_name=CHAOS_NAME)
    chaos = ConnectionChaos(admin.client)
    sent_per_key: dict[str, int] = defaultdict(int)
    futures = []
    progress = Progress("  producing", messages, force=True)
    with chaos_target.producer(
        name="demo-producer", idempotence="sequence", max_batch_messages=200, linger_ms=2
    ) as producer:
        chaos.start()
        for i in range(messages):
            key = f"customer-{i % keys}"
            n = sent_per_key[key]
            sent_per_key[key] += 1
            value = json.dumps({"key": key, "n": n}).encode()
            futures.append(producer.send_async(TOPIC, value, key=key))
            progress.update()
            if i % 500 == 499:
                time.sleep(0.05)  # spread the run over the chaos
        producer.flush()
        chaos.stop()
    progress.close()
    acked = sum(1 for f in futures if f.exception() is None)
    reported_duplicates = sum(1 for f in futures if f.exception() is None and f.result().duplicate)
    chaos_target.close()
    admin.close()
    return {
        "sent": messages,
        "acked": acked,
        "kills": chaos.kills,
        "retried_as_duplicate": reported_duplicates,
        "per_key": dict(sent_per_key),
    }


def check_order(url: str | None, namespace: str, sent_per_key: dict[str, int]) -> dict[str, int]:
    """Read every partition back: per key, n must run 0, 1, 2, ... with nothing missing or twice."""
    broker = redisq.connect(url, namespace=namespace)
    seen: dict[str, list[int]] = defaultdict(list)
    config = broker.topic_config(TOPIC)
    wrong_partition = 0
    for p in range(config.partitions):
        for message in broker.read(TOPIC, p):
            record = json.loads(message.value)
            seen[record["key"]].append(record["n"])
            if redisq.partition_for_key(record["key"].encode(), config.partitions) != p:
                wrong_partition += 1
    duplicates = missing = out_of_order = 0
    for key, count in sent_per_key.items():
        got = seen.get(key, [])
        duplicates += len(got) - len(set(got))
        missing += len(set(range(count)) - set(got))
        out_of_order += sum(1 for a, b in zip(got, got[1:], strict=False) if b < a)
    broker.close()
    return {
        "keys": len(sent_per_key),
        "messages read": sum(len(v) for v in seen.values()),
        "duplicates": duplicates,
        "missing": missing,
        "out of order": out_of_order,
        "in a wrong partition": wrong_partition,
    }


def message_id_dedup(url: str | None, namespace: str) -> tuple[int, int]:
    broker = redisq.connect(url, namespace=namespace)
    broker.create_topic("demo-payments", partitions=2, exist_ok=True)
    with broker.producer(idempotence="message_id") as producer:
        first = [
            producer.send_async("demo-payments", b"charge", message_id=f"payment-{i}")
            for i in range(100)
        ]
        again = [
            producer.send_async("demo-payments", b"charge", message_id=f"payment-{i}")
            for i in range(100)
        ]
        producer.flush()
    same_offsets = sum(
        1
        for a, b in zip(first, again, strict=True)
        if b.result().duplicate and a.result().offset == b.result().offset
    )
    total = broker.describe_topic("demo-payments").total_messages
    broker.close()
    return same_offsets, total


def run_demo(args: argparse.Namespace) -> int:
    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    url = args.url
    # The retries are the point of the demo: it counts them instead of logging each one.
    logging.getLogger("redisq").setLevel(logging.ERROR)
    broker = redisq.connect(url, namespace=namespace)
    print(f"redisq demo on {broker!r}")
    broker.close()

    print(
        f"\n1. {args.messages:,} messages for {args.keys} keys, idempotent producer, "
        "connections killed every 50 ms"
    )
    produced = produce_with_chaos(url, namespace, args.messages, args.keys)
    print(
        f"  {produced['acked']:,}/{produced['sent']:,} acknowledged; the chaos thread killed "
        f"{produced['kills']} producer connections; {produced['retried_as_duplicate']} messages "
        "were re-sent after a kill and recognised as already written"
    )

    print("\n2. reading every partition back")
    verdict = check_order(url, namespace, produced["per_key"])
    print_table(list(verdict.items()), ["check", "value"])
    ok = (
        verdict["duplicates"] == verdict["missing"] == verdict["out of order"] == 0
        and verdict["in a wrong partition"] == 0
        and produced["acked"] == produced["sent"]
    )
    print("  per-key order intact, zero duplicates, nothing lost" if ok else "  CHECK FAILED")

    print("\n3. message_id mode: 100 payments sent twice")
    same, total = message_id_dedup(url, namespace)
    print(
        f"  {same}/100 second sends answered as duplicates with the first offset; "
        f"{total} messages in the topic"
    )
    ok = ok and same == 100 and total == 100

    cleanup = redisq.connect(url, namespace=namespace)
    for topic in cleanup.list_topics():
        cleanup.delete_topic(topic)
    cleanup.close()
    print("\nverdict:", "OK" if ok else "FAILED")
    return 0 if ok else 1
