"""`redisq demo`: the mission end to end, on the embedded server unless --url/REDIS_URL is given.

1. A key-ordered, idempotent producer sends messages for many keys while a chaos thread kills
   its connections over and over (CLIENT KILL): the producer retries the very same batches.
2. A check reads every partition back and prints whether every key's messages are there once
   each, in the order they were sent.
3. message_id mode: the same business ids sent twice are written once.
4. An orderly consumer group of three members reads the topic; one member is lost mid-way
   (it stops without acking or releasing its leases); the others take its partitions over once
   its leases expire, and a check prints that per-key order held and every message was handled.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

import redis

import redisq
from redisq.cli.common import Progress, print_table
from redisq.connection import resolve_url

TOPIC = "demo-orders"
PARTITIONS = 4
LEASE_TTL_MS = 2000
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
    admin.create_topic(TOPIC, partitions=PARTITIONS, exist_ok=True)
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


def _victim(url: str, namespace: str, lease_ttl_ms: int, events: Any) -> None:
    """Member 0, in a process of its own so that it can be lost for real (SIGKILL): no commit,
    no lease release, no goodbye."""
    broker = redisq.connect(url, namespace=namespace)
    consumer = broker.consumer(TOPIC, "demo-billing", "member-0", lease_ttl_ms=lease_ttl_ms)

    def handle(message: redisq.Message) -> None:
        record = json.loads(message.value)
        events.put(("S", record["key"], record["n"], "member-0", time.time(), message.partition))
        time.sleep(0.0002)
        events.put(("E", record["key"], record["n"], "member-0", time.time(), message.partition))

    consumer.run(handle)


def consume_with_lost_member(
    url: str, namespace: str, sent_per_key: dict[str, int], lease_ttl_ms: int = 2000
) -> dict[str, Any]:
    """Three orderly members; member 0 (a process of its own) is killed after a third of the
    messages. Handler starts and ends carry the wall clock (one machine, one clock), so sorting
    them gives the real order: a start of (key, n) needs an end of (key, n - 1) before it."""
    broker = redisq.connect(url, namespace=namespace)
    partitions = broker.topic_config(TOPIC).partitions
    total = sum(sent_per_key.values())
    log: list[tuple[str, str, int, str, float, int]] = []
    lock = threading.Lock()
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    victim = context.Process(target=_victim, args=(url, namespace, lease_ttl_ms, events))
    victim.start()

    def make_handler(member: str) -> Any:
        def handle(message: redisq.Message) -> None:
            record = json.loads(message.value)
            at = time.time()
            with lock:
                log.append(("S", record["key"], record["n"], member, at, message.partition))
            time.sleep(0.0002)
            with lock:
                log.append(
                    ("E", record["key"], record["n"], member, time.time(), message.partition)
                )

        return handle

    # Member 0 starts alone (it takes every partition), then the others join and share them.
    log.append(events.get(timeout=60))
    members = [
        broker.consumer(TOPIC, "demo-billing", f"member-{i}", lease_ttl_ms=lease_ttl_ms)
        for i in (1, 2)
    ]
    threads = [
        threading.Thread(target=m.run, args=(make_handler(m.name),), daemon=True) for m in members
    ]
    for thread in threads:
        thread.start()
    progress = Progress("  consuming", total, force=True)
    ended = 0
    lost_at = 0.0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        while not events.empty():
            event = events.get()
            with lock:
                log.append(event)
        with lock:
            done = {(k, n) for kind, k, n, *_rest in log if kind == "E"}
        progress.update(len(done) - ended)
        ended = len(done)
        with lock:
            shared = any(e[3] != "member-0" for e in log)  # the others got partitions
        if not lost_at and shared and ended >= total // 3 and victim.pid is not None:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            lost_at = time.time()
        if ended >= total:
            break
        time.sleep(0.1)
    progress.close()
    if victim.is_alive() and victim.pid is not None:
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
    for member in members:
        member.close()
    for thread in threads:
        thread.join(10)
    log.sort(key=lambda event: event[4])
    ended_set: set[tuple[str, int]] = set()
    order_violations = 0
    starts = 0
    takeover_at: dict[int, float] = {}
    # What member 0 held when it was killed: the partitions it handled in its last half second.
    victim_partitions = {
        e[5] for e in log if e[3] == "member-0" and lost_at - 0.5 <= e[4] <= lost_at
    }
    for kind, key, n, _member, at, partition in log:
        if kind == "S":
            starts += 1
            if n > 0 and (key, n - 1) not in ended_set:
                order_violations += 1
            if lost_at and at > lost_at and partition in victim_partitions:
                takeover_at.setdefault(partition, at)
        else:
            ended_set.add((key, n))
    expected = {(k, n) for k, count in sent_per_key.items() for n in range(count)}
    broker.close()
    delays = [at - lost_at for at in takeover_at.values()]
    return {
        "partitions / members": f"{partitions} partitions, 3 members (member-0 killed)",
        "lost member's partitions": ", ".join(map(str, sorted(victim_partitions))) or "-",
        "takeover after (s)": (
            f"{max(delays):.2f}" if delays else "- (member-0 was idle when it was killed)"
        ),
        "messages handled at least once": f"{len(expected & ended_set):,}/{len(expected):,}",
        "handled again after the loss (at-least-once)": starts - len(ended_set & expected),
        "per-key order violations": order_violations,
        "_ok": expected <= ended_set and order_violations == 0,
    }


def spark_audit(url: str | None, namespace: str) -> bool | None:
    """The ordering audit of the demo topic with a local Spark; None if Spark cannot run here."""
    if importlib.util.find_spec("pyspark") is None or importlib.util.find_spec("pyarrow") is None:
        print("  skipped: install the [spark] extra (pyspark, pyarrow) and Java 17 for this step")
        return None
    from spark_connector.jobs import demo_audit

    resolved, _ = resolve_url(url)  # the embedded server's url, for the Spark workers
    try:
        clean, verdict = demo_audit(resolved, namespace, TOPIC)
    except Exception as exc:  # no JVM, no pyarrow on the workers, ...
        print(f"  skipped: Spark could not run here ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    print("  " + verdict.replace("\n", "\n  "))
    return clean


def run_demo(url: str | None, *, messages: int = 20_000, keys: int = 200) -> int:
    """The demo on url (else REDIS_URL, else the embedded server), in a namespace of its own
    that is removed at the end, whatever happens: the demo leaves nothing on the server."""
    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    broker = redisq.connect(url, namespace=namespace)  # the embedded server's notice, if used
    print(f"redisq demo on {broker!r} (namespace {namespace}, removed at the end)")
    broker.close()
    # The retries are the point of the demo: it counts them instead of logging each one.
    logging.getLogger("redisq").setLevel(logging.ERROR)
    try:
        ok = _run_steps(url, namespace, messages, keys)
    finally:
        _drop_namespace(url, namespace)
    print("\nverdict:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _drop_namespace(url: str | None, namespace: str) -> None:
    """Every key of the demo's namespace (topics, groups, producer registrations, worker ids),
    on every node of a cluster."""
    cleanup = redisq.connect(url, namespace=namespace)
    try:
        for topic in cleanup.list_topics():
            cleanup.delete_topic(topic, force=True)  # member-0 was killed, not closed
        doomed = list(cleanup.client.scan_iter(match=cleanup.keys.pattern(), count=1000))
        for key in doomed:  # one by one: on a cluster the keys sit in many slots
            cleanup.client.delete(key)
    finally:
        cleanup.close()


def _run_steps(url: str | None, namespace: str, messages: int, keys: int) -> bool:
    print(
        f"\n1. {messages:,} messages for {keys} keys to {TOPIC} ({PARTITIONS} partitions), "
        "idempotent producer, connections killed every 50 ms"
    )
    produced = produce_with_chaos(url, namespace, messages, keys)
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

    ttl_s = LEASE_TTL_MS / 1000
    print(
        f"\n4. an orderly consumer group of 3 members reads the {PARTITIONS} partitions (lease "
        f"ttl {ttl_s:g} s); member-0, a process of its own, is killed with SIGKILL mid-way"
    )
    consumed = consume_with_lost_member(
        resolve_url(url)[0], namespace, produced["per_key"], LEASE_TTL_MS
    )
    consumed_ok = consumed.pop("_ok")
    print_table(list(consumed.items()), ["check", "value"])
    print(
        "  takeover: from the kill until another member handled the lost partitions. A killed "
        "member\n  never releases its leases, so the others wait for them to expire: up to the "
        f"lease ttl ({ttl_s:g} s)\n  plus one heartbeat ({min(LEASE_TTL_MS // 3, 3000) / 1000:g} "
        "s). A member that closes hands over at once."
    )
    print(
        "  per-key order held and every message handled at least once"
        if consumed_ok
        else "  CHECK FAILED"
    )
    ok = ok and consumed_ok

    print("\n5. Spark audits the demo topic: per producer and partition, sequence gaps, duplicates")
    print("   and out-of-order messages; per key, out-of-order messages")
    audit = spark_audit(url, namespace)
    if audit is not None:
        ok = ok and audit
    return ok
