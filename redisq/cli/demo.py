"""`redisq demo`: the mission end to end, on the embedded server unless --url/REDIS_URL is given.

1. A key-ordered, idempotent producer sends messages for many keys through a proxy that loses
   the answers of some batches for real (demo_proxy.py: the server wrote them, the connection
   is cut before the answer arrives): the producer re-sends those very batches, and the server
   answers the copies as duplicates. The step counts both and says so when a run showed none.
2. A check reads every partition back and prints whether every key's messages are there once
   each, in the order they were sent.
3. message_id mode: the same business ids sent twice are written once.
4. An orderly consumer group of three members reads the topic; once Redis shows the leases
   spread over several members, one of them is lost (SIGKILL: it stops without acking or
   releasing its leases); the step prints who held what, the others take its partitions over
   once its leases expire, and a check prints that per-key order held and every message was
   handled. Here too the step says so when a run did not show its claim.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import uuid
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

import redisq
from redisq.cli.common import Progress, print_table
from redisq.cli.demo_proxy import AnswerLosingProxy
from redisq.cli.spark_output import spark_log
from redisq.server.connection import resolve_url

TOPIC = "demo-orders"
PARTITIONS = 4
LEASE_TTL_MS = 2000


def produce_losing_answers(url: str, namespace: str, messages: int, keys: int) -> dict[str, Any]:
    """The idempotent producer sends through a proxy that loses the answer of every 5th batch
    sent (at most 5): the server wrote it, the producer does not know, so it sends it again.
    Counts what happened instead of assuming it: answers lost, batches re-sent, and messages
    the server answered as already written."""
    admin = redisq.connect(url, namespace=namespace)
    admin.create_topic(TOPIC, partitions=PARTITIONS, exist_ok=True)
    target = urlsplit(url)
    # A batch for the demo topic names one of its partition keys in its KEYS: what the names
    # of two partitions have in common is the start of every one.
    needle = os.path.commonprefix([admin.keys.log(TOPIC, 0), admin.keys.log(TOPIC, 1)]).encode()
    proxy = AnswerLosingProxy(target.hostname or "127.0.0.1", target.port or 6379, needle)
    proxied = proxy.url_for(url)
    if proxied is not None:
        proxy.start()
    sender = redisq.connect(proxied or url, namespace=namespace)
    sent_per_key: dict[str, int] = defaultdict(int)
    futures = []
    progress = Progress("  producing", messages, force=True)
    with sender.producer(
        name="demo-producer", idempotence="sequence", max_batch_messages=200, linger_ms=2
    ) as producer:
        for i in range(messages):
            key = f"customer-{i % keys}"
            n = sent_per_key[key]
            sent_per_key[key] += 1
            value = json.dumps({"key": key, "n": n}).encode()
            futures.append(producer.send_async(TOPIC, value, key=key))
            progress.update()
            if i % 500 == 499:
                time.sleep(0.05)  # many batches, so that some answers can be lost
        producer.flush()
        stats = producer.stats
    progress.close()
    proxy.stop()
    acked = sum(1 for f in futures if f.exception() is None)
    duplicates = sum(1 for f in futures if f.exception() is None and f.result().duplicate)
    sender.close()
    admin.close()
    return {
        "sent": messages,
        "acked": acked,
        "proxied": proxied is not None,
        "cluster": sender.is_cluster,
        "answers lost": proxy.answers_lost,
        "batches re-sent": stats.retries,
        "re-sent and deduplicated": duplicates,
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


GROUP = "demo-billing"
VICTIM = "member-0"


def _victim(url: str, namespace: str, lease_ttl_ms: int, pace_s: float, events: Any) -> None:
    """Member 0, in a process of its own so that it can be lost for real (SIGKILL): no commit,
    no lease release, no goodbye."""
    broker = redisq.connect(url, namespace=namespace)
    consumer = broker.consumer(TOPIC, GROUP, VICTIM, lease_ttl_ms=lease_ttl_ms)

    def handle(message: redisq.Message) -> None:
        record = json.loads(message.value)
        events.put(("S", record["key"], record["n"], VICTIM, time.time(), message.partition))
        time.sleep(pace_s)
        events.put(("E", record["key"], record["n"], VICTIM, time.time(), message.partition))

    events.put(("J", "", 0, VICTIM, time.time(), -1))  # joining: the others may start
    consumer.run(handle)


def lease_holders(broker: redisq.Broker) -> dict[str, list[int]]:
    """Who holds which partition's lease now (describe_group: what Redis says, not what a
    member believes)."""
    held: dict[str, list[int]] = defaultdict(list)
    try:
        description = broker.describe_group(TOPIC, GROUP)
    except (redisq.errors.GroupNotFound, redisq.errors.ReadFailed):
        return {}  # no member has joined yet; or a read to try again at the next look
    for p in description.partitions:
        if p.owner:
            held[p.owner].append(p.partition)
    return dict(held)


def _holders_text(held: dict[str, list[int]]) -> str:
    return "; ".join(
        f"{member}: {', '.join(map(str, sorted(parts)))}" for member, parts in sorted(held.items())
    )


def consume_with_lost_member(
    url: str, namespace: str, sent_per_key: dict[str, int], lease_ttl_ms: int = 2000
) -> dict[str, Any]:
    """Three orderly members; member-0 (a process of its own) is killed once the leases are
    spread (it and another member hold partitions, as Redis says) and it has handled messages.
    Handlers take a few ms each, so the topic is not read to the end before that. Handler
    starts and ends carry the wall clock (one machine, one clock), so sorting them gives the
    real order: a start of (key, n) needs an end of (key, n - 1) before it."""
    broker = redisq.connect(url, namespace=namespace)
    partitions = broker.topic_config(TOPIC).partitions
    total = sum(sent_per_key.values())
    # Handlers pace the read to ~4 s of handler time per partition: long enough for the
    # leases to spread before the topic is read to the end.
    pace_s = min(0.005, max(0.0002, 4.0 * partitions / max(total, 1)))
    log: list[tuple[str, str, int, str, float, int]] = []
    lock = threading.Lock()
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    victim = context.Process(target=_victim, args=(url, namespace, lease_ttl_ms, pace_s, events))
    victim.start()

    def make_handler(member: str) -> Any:
        def handle(message: redisq.Message) -> None:
            record = json.loads(message.value)
            at = time.time()
            with lock:
                log.append(("S", record["key"], record["n"], member, at, message.partition))
            time.sleep(pace_s)
            with lock:
                log.append(
                    ("E", record["key"], record["n"], member, time.time(), message.partition)
                )

        return handle

    # Member 0 joins first (it takes every partition), then the others join and the leases
    # move until each holds its share.
    try:
        log.append(events.get(timeout=120))
    except queue.Empty:  # it never started: the output says what was not shown
        pass
    members = [
        broker.consumer(TOPIC, GROUP, f"member-{i}", lease_ttl_ms=lease_ttl_ms) for i in (1, 2)
    ]
    threads = [
        threading.Thread(target=m.run, args=(make_handler(m.name),), daemon=True) for m in members
    ]
    for thread in threads:
        thread.start()
    progress = Progress("  consuming", total, force=True)
    ended = 0
    lost_at = 0.0
    at_kill: dict[str, list[int]] = {}
    taken: dict[int, tuple[str, float]] = {}  # the victim's partitions: new holder, when
    started = time.monotonic()
    deadline = started + 300
    while time.monotonic() < deadline:
        while not events.empty():
            event = events.get()
            with lock:
                log.append(event)
        with lock:
            done = {(k, n) for kind, k, n, *_rest in log if kind == "E"}
            victim_handled = {e[5] for e in log if e[3] == VICTIM and e[0] == "E"}
        progress.update(len(done) - ended)
        ended = len(done)
        held = lease_holders(broker)
        if not lost_at:
            # Every member holds a lease, and the victim has handled messages of its own.
            spread = len(held) == 3 and bool(set(held.get(VICTIM, [])) & victim_handled)
            # Spread, or given up waiting (then the output says what it did not show).
            if spread or time.monotonic() - started > 60 or ended >= total:
                at_kill = held
                if victim.pid is not None:
                    os.kill(victim.pid, signal.SIGKILL)
                victim.join(10)
                lost_at = time.time()
        else:
            for p in at_kill.get(VICTIM, []):
                holder = next((m for m, parts in held.items() if p in parts), None)
                if p not in taken and holder not in (None, VICTIM):
                    taken[p] = (str(holder), time.time())
        if lost_at and ended >= total and len(taken) == len(at_kill.get(VICTIM, [])):
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
    for kind, key, n, _member, _at, _partition in log:
        if kind == "S":
            starts += 1
            if n > 0 and (key, n - 1) not in ended_set:
                order_violations += 1
        elif kind == "E":
            ended_set.add((key, n))
    expected = {(k, n) for k, count in sent_per_key.items() for n in range(count)}
    broker.close()
    lost = sorted(at_kill.get(VICTIM, []))
    new_holders: dict[str, list[int]] = defaultdict(list)
    for p, (holder, _at) in taken.items():
        new_holders[holder].append(p)
    delays = [at - lost_at for _holder, at in taken.values()]
    return {
        "partitions / members": f"{partitions} partitions, 3 members ({VICTIM} killed)",
        "leases held at the kill": _holders_text(at_kill) or "-",
        "lost member's partitions": ", ".join(map(str, lost)) or "-",
        "taken over by": _holders_text(dict(new_holders)) or "-",
        "takeover after (s)": f"{max(delays):.2f}" if delays else "-",
        "messages handled at least once": f"{len(expected & ended_set):,}/{len(expected):,}",
        "handled again after the loss (at-least-once)": starts - len(ended_set & expected),
        "per-key order violations": order_violations,
        "_ok": expected <= ended_set and order_violations == 0,
        "_holders_at_kill": len(at_kill),
        "_victim_held": len(lost),
        "_taken_over": len(taken) == len(lost) > 0,
    }


def spark_audit(url: str | None, namespace: str) -> bool | None:
    """The ordering audit of the demo topic with a local Spark; None if Spark cannot run here."""
    if importlib.util.find_spec("pyspark") is None or importlib.util.find_spec("pyarrow") is None:
        print("  skipped: install the [spark] extra (pyspark, pyarrow) and Java 17 for this step")
        return None
    from spark_connector.jobs import demo_audit

    resolved, _ = resolve_url(url)  # the embedded server's url, for the Spark workers
    with spark_log() as log:
        try:
            clean, verdict = demo_audit(resolved, namespace, TOPIC)
        except Exception as exc:  # no JVM, no pyarrow on the workers, ...
            path = log.kept_when_written()
            where = f"; Spark's own output is in {path}" if path else ""
            print(
                f"  skipped: Spark could not run here ({type(exc).__name__}: "
                f"{str(exc)[:200]}){where}"
            )
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
    resolved = resolve_url(url)[0]
    ok, produced = step_produce(resolved, namespace, messages, keys)

    print("\n2. reading every partition back")
    verdict = check_order(resolved, namespace, produced["per_key"])
    print_table(list(verdict.items()), ["check", "value"])
    read_ok = (
        verdict["duplicates"] == verdict["missing"] == verdict["out of order"] == 0
        and verdict["in a wrong partition"] == 0
    )
    ok = ok and read_ok
    print("  per-key order intact, zero duplicates, nothing lost" if ok else "  CHECK FAILED")

    print("\n3. message_id mode: 100 payments sent twice")
    same, total = message_id_dedup(resolved, namespace)
    print(
        f"  {same}/100 second sends answered as duplicates with the first offset; "
        f"{total} messages in the topic"
    )
    ok = ok and same == 100 and total == 100

    ok = step_consume(resolved, namespace, produced["per_key"]) and ok

    print("\n5. Spark audits the demo topic: per producer and partition, sequence gaps, duplicates")
    print("   and out-of-order messages; per key, out-of-order messages")
    audit = spark_audit(resolved, namespace)
    if audit is not None:
        ok = ok and audit
    return ok


def step_produce(url: str, namespace: str, messages: int, keys: int) -> tuple[bool, dict[str, Any]]:
    """Step 1, printed: (every message acknowledged?, what produce_losing_answers counted). What
    it claims (answers lost, copies answered as duplicates) it checks, and says so when a run
    did not show it."""
    print(
        f"\n1. {messages:,} messages for {keys} keys to {TOPIC} ({PARTITIONS} partitions), "
        "idempotent producer; a proxy between it and the server loses the answer of every 5th "
        "batch sent (at most 5): the server wrote the batch, the producer never hears so"
    )
    produced = produce_losing_answers(url, namespace, messages, keys)
    print(
        f"  {produced['acked']:,}/{produced['sent']:,} acknowledged; {produced['answers lost']} "
        f"answers lost; {produced['batches re-sent']} batches re-sent; "
        f"{produced['re-sent and deduplicated']:,} re-sent messages deduplicated (answered as "
        "already written, not written again)"
    )
    if produced["re-sent and deduplicated"]:
        print("  shown: a lost answer makes the producer send again, and the copy is not written")
    elif not produced["proxied"]:
        print(
            "  NOT SHOWN: no answer was lost (the proxy cannot sit in front of a TLS or unix "
            "socket url), so nothing was re-sent"
        )
    else:
        why = (
            "a cluster client talks to its nodes directly, past the proxy"
            if produced["cluster"]
            else "the cut answers held no batch that had been written"
        )
        print(f"  NOT SHOWN: no re-sent message was answered as a duplicate ({why})")
    return produced["acked"] == produced["sent"], produced


def step_consume(url: str, namespace: str, sent_per_key: dict[str, int]) -> bool:
    """Step 4, printed: True when every message was handled and per-key order held. What it
    claims (several members hold partitions when one is killed, the others take its
    partitions over) it checks, and says so when a run did not show it."""
    ttl_s = LEASE_TTL_MS / 1000
    print(
        f"\n4. an orderly consumer group of 3 members reads the {PARTITIONS} partitions (lease "
        f"ttl {ttl_s:g} s); once the leases are spread, {VICTIM}, a process of its own, is "
        "killed with SIGKILL"
    )
    consumed = consume_with_lost_member(url, namespace, sent_per_key, LEASE_TTL_MS)
    ok = consumed.pop("_ok")
    holders = consumed.pop("_holders_at_kill")
    victim_held = consumed.pop("_victim_held")
    taken_over = consumed.pop("_taken_over")
    print_table(list(consumed.items()), ["check", "value"])
    if holders > 1 and victim_held:
        print(f"  shown: {holders} members held partitions when {VICTIM} was killed")
    else:
        print(
            f"  NOT SHOWN: {holders} member(s) held partitions when {VICTIM} was killed "
            f"({VICTIM} held {victim_held}): the leases had not spread in time"
        )
    if taken_over:
        print(
            "  takeover: from the kill until another member held each lost partition's lease. A "
            "killed member\n  never releases its leases, so the others wait for them to expire: "
            f"up to the lease ttl ({ttl_s:g} s)\n  plus one heartbeat "
            f"({min(LEASE_TTL_MS // 3, 3000) / 1000:g} s). A member that closes hands over at once."
        )
    else:
        print(f"  NOT SHOWN: no other member took over {VICTIM}'s partitions")
    print(
        "  per-key order held and every message handled at least once" if ok else "  CHECK FAILED"
    )
    return bool(ok)
