"""Consumer groups in one process, on every backend, through both APIs where both have the
behaviour (the `api` fixture: thread and asyncio): API checks, orderly run() and key lanes,
start="latest", poll()/ack gating and iteration, rebalancing with on_assign/on_revoke, a crashed
member taken over, failure policies and dead letters, the idempotent helper, concurrent mode,
several topics, connections killed under an orderly member; thread-only: lease scripts and
fencing white-box, a mid-batch hand-over, describe and the CLI commands.

On the asyncio API a plain handler runs in a worker thread; where a test passes
`coroutine_on_asyncio(api, ...)` (tests/apis.py) it is a coroutine function awaited on the loop
instead. What only the asyncio API has (cancellation, coroutine handlers on the loop) is in
tests/consume/test_asyncio_only.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

import redisq
from redisq import cli
from redisq.consume.deadletter import (
    dead_letter_topic,
    list_dead_letters,
    release_key,
    replay_dead_letters,
)
from redisq.consume.dispatch import OrderlyPartition
from redisq.consume.ownership import assign_partitions
from redisq.consume.partition_io import PartitionIO
from redisq.consume.policies import Backoff, make_policy
from redisq.errors import (
    ConsumerClosed,
    GroupModeMismatch,
    GroupNotFound,
    InvalidConfig,
    LeaseLost,
)
from redisq.model.offsets import offset_parts
from redisq.protocol.group import Commit
from redisq.settings import ConsumerSettings
from tests.aio import Killer, Recorder, async_poll_then_crash
from tests.apis import coroutine_on_asyncio, open_api, run_until
from tests.conftest import wait_until
from tests.crash import poll_then_crash
from tests.marks import ONE_BACKEND
from tests.servers import ServerProcess

FAST = {"lease_ttl_ms": 1500, "retry_backoff_ms": 10, "max_retry_backoff_ms": 50}


def produce(broker: redisq.Broker, topic: str, keys: int, per_key: int) -> None:
    with broker.producer() as producer:
        for n in range(per_key):
            for k in range(keys):
                producer.send_async(topic, json.dumps({"k": k, "n": n}), key=f"key{k}")


def server_url_of(broker: redisq.Broker) -> str:
    """The url of a test broker's server (a cluster: any node)."""
    kwargs = broker.client.get_connection_kwargs() if not broker.is_cluster else None
    if kwargs is not None:
        return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"
    node = broker.client.get_default_node()
    return f"redis://{node.host}:{node.port}"


def numbers(messages: list[Any]) -> list[int]:
    return [json.loads(m.value)["n"] for m in messages]


def run_in_thread(consumer: Any, handler: Callable, **kw: object) -> threading.Thread:
    """consumer.run(handler) in a thread (either API: an asyncio consumer through its Bridge)."""
    thread = threading.Thread(target=consumer.run, args=(handler,), kwargs=kw, daemon=True)
    thread.start()
    return thread


# -- pure --------------------------------------------------------------------------------------
def test_assignment_is_averaged_and_total() -> None:
    members = ["c", "a", "b"]
    got = {m: assign_partitions(8, members, m) for m in members}
    assert got == {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7]}
    for n in range(1, 20):
        for m in range(1, 7):
            names = [f"m{i}" for i in range(m)]
            parts = [p for name in names for p in assign_partitions(n, names, name)]
            assert sorted(parts) == list(range(n))
    assert assign_partitions(4, ["a"], "zz") == []


# -- API checks ----------------------------------------------------------------------------------
@ONE_BACKEND
def test_parameters_are_validated(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("t")
    with pytest.raises(InvalidConfig, match="mode="):
        api.broker.consumer("t", "g", mode="fast")
    with pytest.raises(InvalidConfig, match="park_key"):
        api.broker.consumer("t", "g", mode="concurrent", failure_policy="park_key")
    with pytest.raises(InvalidConfig, match="lease_ttl_ms=10"):
        api.broker.consumer("t", "g", lease_ttl_ms=10)
    with pytest.raises(redisq.InvalidName):
        api.broker.consumer("t", "bad:group")
    with pytest.raises(TypeError):
        api.broker.consumer("t", "g", no_such_option=1)
    with pytest.raises(GroupNotFound):  # none of them joined
        broker.describe_group("t", "g")
    idle = api.broker.consumer("t", "g")
    with pytest.raises(TypeError):
        idle.run("not a handler")
    idle.close()


def test_a_consumer_of_a_missing_topic_is_refused(api: Any) -> None:
    with pytest.raises(redisq.TopicNotFound):
        api.broker.consumer("missing", "g")


# -- orderly run -------------------------------------------------------------------------------
def test_run_orderly_handles_everything_in_key_order(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=4)
    produce(broker, "orders", keys=10, per_key=30)
    recorder = Recorder(sleep=0.001)
    with api.broker.consumer("orders", "billing", **FAST) as consumer:
        handled = consumer.run(recorder, idle_timeout=1.5)
    assert handled == 300 == recorder.handled() == consumer.stats.handled
    assert sorted(recorder.done) == list(range(10))
    assert all(ns == list(range(30)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    assert {attempt for *_, attempt in recorder.calls} == {1}  # nothing handled twice
    if api.loop_thread is not None:  # asyncio: a plain handler runs in a worker thread
        assert api.loop_thread not in recorder.threads
    description = broker.describe_group("orders", "billing")
    assert description.total_lag == 0 and description.total_pending == 0
    assert description.mode == "orderly" and description.members == []
    assert all(p.owner is None for p in description.partitions)  # leases released on close
    # XINFO GROUPS tells the same story as describe.
    info = broker.client.xinfo_groups(broker.keys.log("orders", 0))
    assert [g["name"] for g in info] == [b"billing"] and info[0]["pending"] == 0


def test_key_concurrency_keeps_each_key_in_order(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=8, per_key=10)
    recorder = Recorder(sleep=0.005)
    lock = threading.Lock()
    per_key: dict[bytes | None, int] = defaultdict(int)
    active, peak, key_overlaps = [0], [0], [0]

    def handler(message: redisq.Message) -> None:
        with lock:
            active[0] += 1
            per_key[message.key] += 1
            peak[0] = max(peak[0], active[0])
            if per_key[message.key] > 1:
                key_overlaps[0] += 1
        try:
            recorder(message)
        finally:
            with lock:
                active[0] -= 1
                per_key[message.key] -= 1

    with api.broker.consumer("orders", "g", key_concurrency=4, **FAST) as consumer:
        consumer.run(handler, idle_timeout=1.5)
    assert recorder.handled() == 80 and len(recorder.done) == 8
    assert all(ns == list(range(10)) for ns in recorder.done.values())
    assert key_overlaps[0] == 0  # one call at a time per key
    assert peak[0] > 1  # different keys of one partition ran in parallel
    assert broker.describe_group("orders", "g").total_lag == 0


def test_start_latest_skips_what_was_there(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=4, per_key=5)
    recorder = Recorder()
    # Joined when made (as `async with` does): the group starts after what is there.
    consumer = api.broker.consumer("orders", "late", start="latest", **FAST)
    with broker.producer() as producer:
        for p in (0, 1):  # behind the old messages of each partition
            producer.send("orders", json.dumps({"k": 90 + p, "n": 0}), partition=p)
    run_until(consumer, recorder, lambda: recorder.handled() >= 2, what="the new messages")
    assert dict(recorder.done) == {90: [0], 91: [0]}


# -- poll / ack / iteration ----------------------------------------------------------------------
def test_poll_gates_a_partition_until_acked(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=10)
    with api.broker.consumer("orders", "g", **FAST, enable_auto_commit=False) as consumer:
        first = consumer.poll(timeout=10, max_messages=4)
        assert numbers(first) == [0, 1, 2, 3]
        assert consumer.poll(timeout=0.3) == []  # orderly: nothing more until acked
        assert consumer.ack(first[:2]) == 2
        assert consumer.poll(timeout=0.3) == []  # still two outstanding
        assert consumer.ack(first[2:]) == 2
        rest = consumer.poll(timeout=10, max_messages=100)
        assert numbers(rest) == list(range(4, 10))
        consumer.ack(*rest)
        consumer.commit()
        assert consumer.committed(0) == rest[-1].offset
        with pytest.raises(InvalidConfig):
            consumer.run(lambda m: None)
    with pytest.raises(ConsumerClosed):
        consumer.poll()
    # A new member resumes after the committed position: nothing is left.
    with api.broker.consumer("orders", "g", **FAST) as again:
        wait_until(lambda: again.assignment == [0], what="the lease")
        assert again.poll(timeout=0.5) == []


def test_iteration_with_acks_commits_each_partition(api: Any, broker: redisq.Broker) -> None:
    """`for message in consumer` (asyncio: `async for`), acking each: every key in order, and
    commit() commits each partition through the last message acked."""
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=8, per_key=5)  # keys 0-3 on 0, 4-7 on 1
    got: list[Any] = []
    with api.broker.consumer("orders", "g", ack_interval_ms=60_000, **FAST) as consumer:
        for message in consumer:
            got.append(message)
            consumer.ack(message)
            if len(got) == 40:
                break
        consumer.commit()
        for p in (0, 1):
            mine = [m.offset for m in got if m.partition == p]
            assert mine == sorted(mine, key=offset_parts)
            assert consumer.committed(p) == mine[-1]
    by_key: dict[bytes | None, list[int]] = defaultdict(list)
    for message in got:
        by_key[message.key].append(json.loads(message.value)["n"])
    assert all(ns == list(range(5)) for ns in by_key.values()) and len(by_key) == 8


# -- fencing, white-box (thread API) -----------------------------------------------------------
def test_fenced_ack_raises_lease_lost_and_changes_nothing(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=3)
    stream = broker.keys.log("orders", 0)
    with broker.consumer("orders", "g", ack_interval_ms=60_000, **FAST) as consumer:
        messages = consumer.poll(timeout=10)
        assert len(messages) == 3
        before = consumer.committed(0)
        # Another grant takes the lease (as if ours expired while we were paused).
        lease_key = broker.keys.lease("orders", 0, "g")
        broker.client.delete(lease_key)
        broker.client.set(lease_key, "999:intruder:0", px=60_000)
        consumer.ack(messages)  # recorded here; Redis decides at the commit
        with pytest.raises(LeaseLost):
            consumer.commit()
        assert consumer.committed(0) == before  # nothing was committed
        assert broker.client.xpending(stream, "g")["pending"] == 0  # orderly keeps no PEL
        with pytest.raises(LeaseLost):  # and the partition stays lost for this member
            consumer.ack(messages[0])
        broker.client.delete(lease_key)


def test_lease_scripts_fence_reads_and_bump_tokens(broker: redisq.Broker) -> None:
    from redisq.consume.membership import GroupMembership

    # entries as read from Redis: one per message
    broker.create_topic("orders", partitions=1, entry_format="message")
    produce(broker, "orders", keys=1, per_key=2)

    def member(name: str) -> GroupMembership:
        m = GroupMembership(
            broker,
            "orders",
            "g",
            name,
            mode="orderly",
            start="earliest",
            policy="dead_letter",
            lease_ttl_ms=500,
            session_timeout_ms=500,
        )
        m.join()
        return m

    a, b = member("a"), member("b")
    grant_a = a.acquire_lease(0)
    assert grant_a is not None and b.acquire_lease(0) is None
    lease_a = grant_a.lease
    assert a.renew_lease(lease_a)
    time.sleep(0.7)  # a's lease expires
    grant_b = b.acquire_lease(0)
    assert grant_b is not None and grant_b.lease.token == lease_a.token + 1
    assert not a.renew_lease(lease_a) and not a.release_lease(lease_a)
    settings = ConsumerSettings.from_options({})
    io = PartitionIO(broker, "g", "a", settings, make_policy("dead_letter", 5, Backoff()))
    with pytest.raises(LeaseLost):  # a's read sees b's lease: nothing comes back
        io.read_range(OrderlyPartition(grant_a), 10)
    with pytest.raises(LeaseLost):  # and a's commit changes nothing
        io.commit(lease_a, Commit(position=grant_b.position))
    assert len(io.read_range(OrderlyPartition(grant_b), 10)) == 2
    assert b.release_lease(grant_b.lease)


# -- rebalancing and callbacks -------------------------------------------------------------------
def test_rebalance_hands_partitions_over_with_callbacks(api: Any, broker: redisq.Broker) -> None:
    """first runs alone; second joins and takes half; first leaves and second takes the rest.
    Every partition is handled by one member at a time, and only between its on_assign and its
    on_revoke; on_revoke comes after the member's last commit of the partition; each key in order
    (a clean hand-over repeats nothing). On the asyncio API first's on_assign and second's
    on_revoke are coroutine functions, the others plain ones."""
    broker.create_topic("orders", partitions=4)
    produce(broker, "orders", keys=16, per_key=60)
    recorder = Recorder(sleep=0.01)
    events: list[tuple[Any, ...]] = []

    def handler_of(member: str) -> Callable[[redisq.Message], None]:
        def handle(message: redisq.Message) -> None:
            events.append(("handle", member, (message.topic, message.partition), message.offset))
            recorder(message)

        return handle

    def assigned(member: str) -> Callable[[list[tuple[str, int]]], None]:
        return lambda tps: events.extend(("assign", member, tp) for tp in tps)

    def revoked(member: str) -> Callable[[list[tuple[str, int]]], None]:
        def on_revoke(tps: list[tuple[str, int]]) -> None:
            for tp in tps:  # the group's committed position of the partition, now
                info = broker.client.xinfo_groups(broker.keys.log(*tp))
                last = [g["last-delivered-id"] for g in info if g["name"] == b"g"][0]
                events.append(("revoke", member, tp, last.decode()))

        return on_revoke

    first = api.broker.consumer(
        "orders", "g", "first",
        on_assign=coroutine_on_asyncio(api, assigned("first")), on_revoke=revoked("first"),
        **FAST,
    )  # fmt: skip
    t1 = run_in_thread(first, handler_of("first"))
    wait_until(lambda: recorder.handled() >= 40, what="first member going")
    second = api.broker.consumer(
        "orders", "g", "second",
        on_assign=assigned("second"), on_revoke=coroutine_on_asyncio(api, revoked("second")),
        **FAST,
    )  # fmt: skip
    t2 = run_in_thread(second, handler_of("second"))
    try:
        wait_until(
            lambda: len(second.assignment) == 2 and len(first.assignment) == 2,
            what="second member gets half",
        )
        assert not set(first.assignment) & set(second.assignment)
        assert recorder.handled() < 16 * 60 - 160, "precondition: first leaves mid-stream"
        first.close()  # a clean leave: second takes the rest without waiting for the ttl
        t1.join(30)
        wait_until(lambda: len(second.assignment) == 4, what="second member takes over")
        wait_until(lambda: recorder.complete(16, 60), what="everything handled")
    finally:
        first.close()
        second.close()
        t1.join(30)
        t2.join(30)
    assert recorder.overlaps == 0
    for ns in recorder.done.values():  # each key in order, nothing repeated
        assert ns == list(range(60))
    holder: dict[tuple[str, int], str | None] = {}
    last_handled: dict[tuple[str, tuple[str, int]], str] = {}
    handed_over = 0
    for event in events:
        kind, member, tp = event[0], event[1], event[2]
        if kind == "assign":
            assert holder.get(tp) is None, f"{tp} assigned to {member} while {holder[tp]} held it"
            holder[tp] = member
        elif kind == "handle":
            assert holder.get(tp) == member, f"{member} handled {tp} without holding it"
            last_handled[(member, tp)] = event[3]
        else:
            assert holder.get(tp) == member, f"{member} revoked {tp} it did not hold"
            holder[tp] = None
            if (member, tp) in last_handled:  # committed through what it handled, then revoked
                assert event[3] == last_handled[(member, tp)], (member, tp)
            handed_over += member == "first"
    assert handed_over == 4  # two at the rebalance, two at the leave
    assert all(member is None for member in holder.values())  # every partition revoked at close


def test_partition_moving_in_the_middle_of_a_batch_is_handed_over_without_repeats(
    broker: redisq.Broker,
) -> None:
    """run(): A is in the middle of a batch when B joins and takes the partition. A stops
    between two messages, commits every message it handled (in that batch too) and releases
    the lease, so B starts right after A's last one: on a clean hand-over nothing is handled
    twice.

    Mutant: the worker not moving the position over what it handled in a batch it leaves
    early (worker._handle_plain without its finally): B handles them again."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for i in range(300):
            producer.send_async("t", b"%d" % i)
    seen: list[tuple[str, int]] = []

    def handler(name: str) -> Callable[[redisq.Message], None]:
        def handle(message: redisq.Message) -> None:
            seen.append((name, int(message.value)))
            time.sleep(0.005)  # a batch of 300 takes 1.5 s: B joins in the middle of it

        return handle

    a = broker.consumer("t", "g", "z-a", batch_size=300, **FAST)
    ta = run_in_thread(a, handler("a"))
    wait_until(lambda: len(seen) >= 30, what="A in the middle of its batch")
    b = broker.consumer("t", "g", "b", batch_size=300, **FAST)  # sorts first: takes partition 0
    tb = run_in_thread(b, handler("b"))
    wait_until(lambda: len({n for _, n in seen}) == 300, what="every message handled")
    a.close()
    b.close()
    ta.join(10)
    tb.join(10)
    by_a = [n for name, n in seen if name == "a"]
    by_b = [n for name, n in seen if name == "b"]
    assert by_a and by_b and len(by_a) < 300, "precondition: the partition moved mid-batch"
    assert by_a + by_b == list(range(300))  # in order, each once


def test_crashed_member_is_taken_over_from_the_committed_position(
    api: Any, broker: redisq.Broker, server_url: str
) -> None:
    """A member (of the API under test) polls three of six messages and is SIGKILLed: no commit,
    release or leave. The heir handles all six from the committed position, in order, the first
    counted as a second delivery, once the victim's lease ran out."""
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=6)
    crash = poll_then_crash if api.name == "sync" else async_poll_then_crash
    got = crash(server_url, broker.namespace, "orders", "g", "victim", 3, **FAST)
    assert len(got) == 3
    assert broker.describe_group("orders", "g").partitions[0].owner == "victim"
    recorder = Recorder()
    started = time.monotonic()
    heir = api.broker.consumer("orders", "g", "heir", **FAST)
    run_until(heir, recorder, lambda: recorder.handled() >= 6, what="all six")
    assert recorder.done[0] == [0, 1, 2, 3, 4, 5]  # from the committed position, in order
    # The first message after the position was handed to an owner that never got past it.
    assert [a for _k, n, a in recorder.calls if n < 3] == [2, 1, 1]
    assert time.monotonic() - started < 30


# -- failures ----------------------------------------------------------------------------------
def test_poison_message_reaches_the_dead_letter_topic(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=6, per_key=5)  # keys 0-3 on 0, 4-5 on 1
    recorder = Recorder(fail=lambda r: r["k"] == 0 and r["n"] == 2)
    consumer = api.broker.consumer("orders", "g", max_attempts=3, **FAST)
    run_until(
        consumer,
        recorder,
        lambda: recorder.handled() == 29 and consumer.stats.dead_letters == 1,
        what="all but one handled, one dead letter",
    )
    assert [a for k, n, a in recorder.calls if (k, n) == (0, 2)] == [1, 2, 3]
    assert recorder.done[0] == [0, 1, 3, 4]
    assert all(recorder.done[k] == list(range(5)) for k in range(1, 6))
    letters = list_dead_letters(broker, "orders", "g")
    assert len(letters) == 1
    letter = letters[0]
    assert letter.attempts == 3 and "cannot handle key0#2" in letter.error
    assert letter.topic == "orders" and letter.group == "g" and letter.message.key == b"key0"
    assert json.loads(letter.message.value) == {"k": 0, "n": 2}
    description = broker.describe_group("orders", "g")
    assert description.dead_letter_messages == 1
    assert sum(p.dead_letters for p in description.partitions) == 1
    assert description.total_lag == 0
    assert description.dead_letter_topic == dead_letter_topic("orders", "g") == "orders~dlq~g"
    assert "orders~dlq~g" in api.broker.list_topics()
    assert len(list(api.broker.read("orders~dlq~g", 0))) == 1
    # Replay: back to the topic, out of the dead-letter topic, handled again by the group.
    assert replay_dead_letters(broker, "orders", "g") == 1
    assert list_dead_letters(broker, "orders", "g") == []
    again = Recorder()
    consumer = api.broker.consumer("orders", "g", **FAST)
    run_until(consumer, again, lambda: again.handled() >= 1, what="the replayed one")
    assert dict(again.done) == {0: [2]}


def test_park_key_holds_that_key_and_lets_others_go(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=3, per_key=6)
    recorder = Recorder(fail=lambda r: r["k"] == 1 and r["n"] == 1)
    consumer = api.broker.consumer("orders", "g", max_attempts=2, failure_policy="park_key", **FAST)
    thread = run_in_thread(consumer, recorder)
    try:
        wait_until(
            lambda: recorder.done[0] == list(range(6)) and recorder.done[2] == list(range(6)),
            what="other keys done",
        )
        assert recorder.done[1] == [0]  # key1 parked at #1: #2..#5 held

        def parked_and_held() -> bool:  # recorded, so the position could move on
            part = broker.describe_group("orders", "g").partitions[0]
            return part.parked_keys == 1 and part.held == 4

        wait_until(parked_and_held, what="parked key and held messages committed")
        recorder.fail = None
        assert release_key(broker, "orders", "g", "key1") == 1
        wait_until(lambda: recorder.done[1] == [0, 2, 3, 4, 5], what="held messages after release")
    finally:
        consumer.close()
        thread.join(30)
    assert len(list_dead_letters(broker, "orders", "g")) == 1
    assert recorder.overlaps == 0


def test_block_policy_shows_the_poison_message_and_goes_on_when_fixed(
    api: Any, broker: redisq.Broker
) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=3)
    recorder = Recorder(fail=lambda r: r["n"] == 1)
    consumer = api.broker.consumer("orders", "g", max_attempts=2, failure_policy="block", **FAST)
    thread = run_in_thread(consumer, recorder)
    try:
        wait_until(
            lambda: broker.describe_group("orders", "g").partitions[0].blocked_offset is not None,
            what="blocked state",
        )
        part = broker.describe_group("orders", "g").partitions[0]
        assert part.blocked_attempts >= 2 and "cannot handle" in (part.blocked_error or "")
        assert recorder.done[0] == [0]
        recorder.fail = None  # the cause is fixed: the partition goes on by itself
        wait_until(lambda: recorder.done[0] == [0, 1, 2], what="unblocked")
    finally:
        consumer.close()
        thread.join(30)
    assert broker.describe_group("orders", "g").partitions[0].blocked_offset is None
    assert list_dead_letters(broker, "orders", "g") == []


def test_idempotent_helper_skips_done_and_reruns_failed(api: Any, broker: redisq.Broker) -> None:
    """README, Consuming: `consumer.run(consumer.idempotent(handle))`. On the asyncio API the
    wrapped function is a coroutine function first, then a plain one."""
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=3)
    effects: list[int] = []
    fail_once = {1}

    def effect(message: redisq.Message) -> None:
        n = json.loads(message.value)["n"]
        if n in fail_once:
            fail_once.discard(n)
            raise RuntimeError("transient")
        effects.append(n)

    with api.broker.consumer("orders", "g", **FAST) as consumer:
        handler = consumer.idempotent(coroutine_on_asyncio(api, effect), processing_ttl_ms=500)
        messages = consumer.poll(timeout=10)
        assert len(messages) == 3
        for message in messages:
            try:
                handler(message)
            except RuntimeError:
                handler(message)  # the failed run left no marker: it runs again
        for message in messages:  # a redelivery of everything: all done, all skipped
            handler(message)
        assert effects == [0, 1, 2] and handler.skipped == 3 and handler.ran == 3
        plain = consumer.idempotent(lambda message: effects.append(-1))  # a plain function
        for message in messages:
            plain(message)
        assert plain.skipped == 3 and effects == [0, 1, 2]
        consumer.ack(messages)
    with api.broker.consumer("orders", "g2", **FAST) as consumer:  # another group: run()
        ran: list[int] = []
        wrapped = consumer.idempotent(lambda message: ran.append(json.loads(message.value)["n"]))
        assert consumer.run(wrapped, idle_timeout=1.0) == 3
        assert ran == [0, 1, 2] and wrapped.ran == 3


# -- concurrent mode ---------------------------------------------------------------------------
def test_concurrent_members_compete_and_reclaim_idle_entries(
    api: Any, broker: redisq.Broker, server_url: str
) -> None:
    broker.create_topic("jobs", partitions=2)
    produce(broker, "jobs", keys=8, per_key=12)  # keys 0-3 on 0, 4-7 on 1
    taken = poll_then_crash(
        server_url, broker.namespace, "jobs", "w", "victim", 10, mode="concurrent", **FAST
    )
    assert len(taken) == 10  # left pending by the killed member
    recorder = Recorder()
    a = api.broker.consumer("jobs", "w", "a", mode="concurrent", claim_idle_ms=500, **FAST)
    b = api.broker.consumer("jobs", "w", "b", mode="concurrent", claim_idle_ms=500, **FAST)
    # asyncio: a's handler a coroutine function on the loop, b's a plain one in a thread
    ta = run_in_thread(a, recorder.handle if api.name == "async" else recorder)
    tb = run_in_thread(b, recorder)
    try:
        wait_until(
            lambda: recorder.complete(keys=8, per_key=12),
            what="all jobs, including the reclaimed ones",
        )
    finally:
        a.close()
        b.close()
        ta.join(30)
        tb.join(30)
    assert all(sorted(set(ns)) == list(range(12)) for ns in recorder.done.values())
    assert broker.describe_group("jobs", "w").total_pending == 0
    with pytest.raises(GroupModeMismatch):
        api.broker.consumer("jobs", "w", mode="orderly")


# -- several topics ------------------------------------------------------------------------------
def test_one_consumer_of_several_topics(api: Any, broker: redisq.Broker) -> None:
    broker.create_topic("a", partitions=2)
    broker.create_topic("b", partitions=3)
    broker.create_topic("other", partitions=1)
    with broker.producer() as producer:
        for n in range(5):
            for k in range(4):
                producer.send_async("a", json.dumps({"k": k, "n": n}), key=f"a{k}")
            for k in range(10, 16):
                producer.send_async("b", json.dumps({"k": k, "n": n}), key=f"b{k}")
        foreign = producer.send("other", json.dumps({"k": 99, "n": 0}))
    recorder = Recorder()
    consumer = api.broker.consumer(["a", "b"], "g", **FAST)
    thread = run_in_thread(consumer, recorder)
    try:
        wait_until(lambda: len(consumer.assignment) == 5, what="five leases")
        assert sorted(consumer.assignment) == [
            ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2),
        ]  # fmt: skip
        with pytest.raises(InvalidConfig, match="several topics"):
            consumer.position(0)
        [other] = list(api.broker.read("other", foreign.partition))
        with pytest.raises(ValueError):
            consumer.ack(other)
        wait_until(lambda: recorder.handled() == 50, what="both topics handled")
    finally:
        consumer.close()
        thread.join(30)
    assert sorted(recorder.done) == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert all(ns == list(range(5)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    assert broker.describe_group("a", "g").total_lag == 0
    assert broker.describe_group("b", "g").total_lag == 0


# -- connections killed under an orderly consumer ------------------------------------------------
@pytest.mark.fault
@pytest.mark.parametrize("api_name", ["sync", "async"])
def test_orderly_run_while_connections_are_killed(api_name: str) -> None:
    """CLIENT KILL every 20 ms while an orderly member runs over 3000 messages: everything is
    handled, one handler call at a time per partition, and no key ever skips ahead (a key's
    next message is never handled before the one before it; repeats only restart earlier)."""
    server = ServerProcess().start()
    killer = Killer(server, interval=0.02)
    recorder = Recorder(sleep=0.002)
    namespace = f"k{uuid.uuid4().hex[:8]}"
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic("orders", partitions=4)
            produce(broker, "orders", keys=50, per_key=60)
        api = open_api(api_name, server.url, namespace)
        try:
            killer.start()
            consumer = api.broker.consumer("orders", "g", lease_ttl_ms=3000, batch_size=50)
            run_until(
                consumer,
                recorder,
                lambda: recorder.complete(keys=50, per_key=60),
                timeout=120,
                what="every message handled",
            )
        finally:
            killer.stop()
            api.shutdown()
    finally:
        killer.stop()
        server.stop()
    assert killer.killed > 0
    assert recorder.overlaps == 0
    for key, ns in recorder.done.items():
        assert ns[0] == 0, key
        skipped = [(a, b) for a, b in zip(ns, ns[1:], strict=False) if b > a + 1]
        assert not skipped, f"key {key} skipped ahead: {skipped[:3]}"


# -- observability and CLI ---------------------------------------------------------------------
def test_describe_shows_owner_lease_and_lag(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=4, per_key=5)
    with broker.consumer("orders", "g", "solo", **FAST) as consumer:
        wait_until(lambda: len(consumer.assignment) == 2, what="leases")
        description = broker.describe_group("orders", "g")
        assert [m.name for m in description.members] == ["solo"]
        assert {p.owner for p in description.partitions} == {"solo"}
        assert all(
            p.lease_age_ms is not None and p.lease_age_ms >= 0 for p in description.partitions
        )
        assert description.total_lag == 20
        assert broker.list_groups("orders") == [("orders", "g")]


def test_cli_group_lag_dlq(
    broker: redisq.Broker, server_url: str, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=2, per_key=3)
    recorder = Recorder(fail=lambda r: r["n"] == 0)
    with broker.consumer("orders", "g", max_attempts=1, **FAST) as consumer:
        consumer.run(recorder, idle_timeout=1.5)
    base = ["--url", server_url, "--namespace", broker.namespace]
    assert cli.main(["group", "list", *base]) == 0
    assert "orders" in capsys.readouterr().out
    assert cli.main(["group", "describe", "orders", "g", *base]) == 0
    out = capsys.readouterr().out
    assert "dead letters" in out and "orders~dlq~g" in out
    plot = tmp_path / "lag.png"
    assert cli.main(["lag", "orders", *base, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "lag" in out and plot.stat().st_size > 0
    assert cli.main(["dlq", "list", "orders", "g", *base]) == 0
    out = capsys.readouterr().out
    assert out.count("RuntimeError") == 2
    assert cli.main(["dlq", "replay", "orders", "g", "--all", *base]) == 0
    assert "replayed 2" in capsys.readouterr().out
    assert (
        cli.main(["consume", "orders", "--group", "g", "--max", "2", "--timeout", "10", *base]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
