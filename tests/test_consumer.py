"""Consumer groups in one process, on every backend: API, leases and fencing, rebalancing,
failure policies, dead letters, the idempotent helper, observability and the CLI commands."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import pytest

import redisq
from redisq import cli
from redisq.deadletter import (
    dead_letter_topic,
    list_dead_letters,
    release_key,
    replay_dead_letters,
)
from redisq.dispatch import OrderlyPartition
from redisq.errors import ConsumerClosed, GroupModeMismatch, InvalidConfig, LeaseLost
from redisq.group import assign_partitions, describe_group, list_groups
from redisq.partition import PartitionIO
from redisq.policies import Backoff, make_policy
from redisq.protocol.group import Commit
from redisq.settings import ConsumerSettings
from tests.conftest import wait_until
from tests.crash import poll_then_crash

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


class Recorder:
    """A handler that records (key, n) per call and checks per-key order and exclusivity."""

    def __init__(self, sleep: float = 0.0, fail: Callable[[dict[str, int]], bool] | None = None):
        self.sleep = sleep
        self.fail = fail
        self.lock = threading.Lock()
        self.done: dict[int, list[int]] = defaultdict(list)
        self.calls: list[tuple[int, int, int]] = []  # (key, n, attempt)
        self.running: dict[int, int] = defaultdict(int)  # partition -> handlers running
        self.overlaps = 0

    def __call__(self, message: redisq.Message) -> None:
        record = json.loads(message.value)
        with self.lock:
            self.calls.append((record["k"], record["n"], message.attempt))
            self.running[message.partition] += 1
            if self.running[message.partition] > 1:
                self.overlaps += 1
        try:
            if self.sleep:
                time.sleep(self.sleep)
            if self.fail is not None and self.fail(record):
                raise RuntimeError(f"cannot handle key{record['k']}#{record['n']}")
            with self.lock:
                self.done[record["k"]].append(record["n"])
        finally:
            with self.lock:
                self.running[message.partition] -= 1

    def handled(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.done.values())


def run_in_thread(
    consumer: redisq.consumer.Consumer, handler: Callable, **kw: object
) -> threading.Thread:
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


def test_parameters_are_validated(broker: redisq.Broker) -> None:
    broker.create_topic("t")
    with pytest.raises(InvalidConfig, match="mode="):
        broker.consumer("t", "g", mode="fast")
    with pytest.raises(InvalidConfig, match="park_key"):
        broker.consumer("t", "g", mode="concurrent", failure_policy="park_key")
    with pytest.raises(InvalidConfig, match="lease_ttl_ms=10"):
        broker.consumer("t", "g", lease_ttl_ms=10)
    with pytest.raises(redisq.InvalidName):
        broker.consumer("t", "bad:group")
    with pytest.raises(redisq.TopicNotFound):
        broker.consumer("missing", "g")


# -- orderly run -------------------------------------------------------------------------------
def test_run_orderly_handles_everything_in_key_order(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=4)
    produce(broker, "orders", keys=10, per_key=30)
    recorder = Recorder()
    with broker.consumer("orders", "billing", **FAST) as consumer:
        handled = consumer.run(recorder, idle_timeout=1.5)
    assert handled == 300 == recorder.handled()
    assert all(ns == list(range(30)) for ns in recorder.done.values())
    assert recorder.overlaps == 0
    description = describe_group(broker, "orders", "billing")
    assert description.total_lag == 0 and description.total_pending == 0
    assert description.mode == "orderly" and description.members == []
    assert all(p.owner is None for p in description.partitions)  # leases released on close
    # XINFO GROUPS tells the same story as describe.
    info = broker.client.xinfo_groups(broker.keys.log("orders", 0))
    assert [g["name"] for g in info] == [b"billing"] and info[0]["pending"] == 0


def seek_back_after(count: int, consumer_ref: list[object], seen: list[int], offsets: list[str]):
    """A handler recording each message's number that, after `count` messages, seeks the
    partition back to the first one (the consumer is looked up when it is needed)."""

    def handler(message: redisq.Message) -> None:
        seen.append(json.loads(message.value)["n"])
        offsets.append(message.offset)
        if len(seen) == count:
            consumer_ref[0].seek(0, offsets[0])  # type: ignore[attr-defined]

    return handler


def assert_seek_took_effect(seen: list[int], count: int, total: int) -> None:
    """The messages after the seek's: the rest of the read under way is not handled first (a
    chunk of it may be), then everything again from the seek's offset, in order."""
    assert seen[:count] == list(range(count))
    restart = seen.index(0, count)
    assert seen[count:restart] == list(range(count, restart))
    assert restart - count < 100, f"{restart - count} messages of the old read after the seek"
    assert seen[restart:] == list(range(total))


def test_seek_from_the_handler_takes_effect_before_the_rest_of_the_read(
    broker: redisq.Broker,
) -> None:
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for n in range(500):
            producer.send_async("t", json.dumps({"n": n}), key=f"k{n % 5}")
    seen: list[int] = []
    consumer_ref: list[object] = [None]
    with broker.consumer("t", "g", batch_size=1000, **FAST) as consumer:
        consumer_ref[0] = consumer
        consumer.run(seek_back_after(10, consumer_ref, seen, []), idle_timeout=1.5)
    assert_seek_took_effect(seen, 10, 500)


def test_key_concurrency_keeps_each_key_in_order(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=8, per_key=10)
    recorder = Recorder(sleep=0.005)
    active, peak = [0], [0]
    lock = threading.Lock()

    def handler(message: redisq.Message) -> None:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            recorder(message)
        finally:
            with lock:
                active[0] -= 1

    with broker.consumer("orders", "g", key_concurrency=4, **FAST) as consumer:
        consumer.run(handler, idle_timeout=1.5)
    assert recorder.handled() == 80
    assert all(ns == list(range(10)) for ns in recorder.done.values())
    assert peak[0] > 1  # different keys of one partition ran in parallel


def test_start_latest_skips_what_was_there(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=4, per_key=5)
    recorder = Recorder()
    consumer = broker.consumer("orders", "late", start="latest", **FAST)
    thread = run_in_thread(consumer, recorder)
    time.sleep(0.5)
    with broker.producer() as producer:
        producer.send("orders", json.dumps({"k": 99, "n": 0}), key="fresh")
    wait_until(lambda: recorder.handled() == 1, what="the new message")
    time.sleep(0.3)
    consumer.close()
    thread.join(10)
    assert dict(recorder.done) == {99: [0]}


# -- poll / ack and fencing ----------------------------------------------------------------------
def test_poll_gates_a_partition_until_acked(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=10)
    with broker.consumer("orders", "g", **FAST) as consumer:
        first = consumer.poll(timeout=10, max_messages=4)
        assert [json.loads(m.value)["n"] for m in first] == [0, 1, 2, 3]
        assert consumer.poll(timeout=0.3) == []  # orderly: nothing more until acked
        assert consumer.ack(first) == 4
        rest = consumer.poll(timeout=10, max_messages=100)
        assert [json.loads(m.value)["n"] for m in rest] == list(range(4, 10))
        consumer.ack(*rest)
        with pytest.raises(InvalidConfig):
            consumer.run(lambda m: None)
    with pytest.raises(ConsumerClosed):
        consumer.poll()


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
    from redisq.group import GroupMembership

    broker.create_topic("orders", partitions=1)
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


# -- rebalancing -------------------------------------------------------------------------------
def test_join_and_leave_rebalance_without_overlap(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=4)
    produce(broker, "orders", keys=16, per_key=15)
    recorder = Recorder(sleep=0.004)
    first = broker.consumer("orders", "g", "first", **FAST)
    t1 = run_in_thread(first, recorder)
    wait_until(lambda: recorder.handled() >= 40, what="first member going")
    second = broker.consumer("orders", "g", "second", **FAST)
    t2 = run_in_thread(second, recorder)
    wait_until(lambda: len(second.assignment) == 2, what="second member gets half")
    assert len(first.assignment) == 2 and not set(first.assignment) & set(second.assignment)
    first.close()  # a clean leave: second takes everything without waiting for the ttl
    t1.join(10)
    wait_until(lambda: len(second.assignment) == 4, what="second member takes over")
    wait_until(
        lambda: all(sorted(set(recorder.done[k])) == list(range(15)) for k in range(16)),
        what="everything handled",
    )
    second.close()
    t2.join(10)
    assert recorder.overlaps == 0
    assert all(sorted(set(ns)) == list(range(15)) for ns in recorder.done.values())
    for ns in recorder.done.values():  # each key in order, repeats only as redeliveries
        assert ns == sorted(ns)


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


def test_crashed_member_pending_entries_go_first(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=6)
    url = server_url_of(broker)
    got = poll_then_crash(url, broker.namespace, "orders", "g", "victim", 3, **FAST)
    assert len(got) == 3  # polled, never acked; then SIGKILL: no commit, release or leave
    recorder = Recorder()
    started = time.monotonic()
    with broker.consumer("orders", "g", "heir", **FAST) as heir:
        heir.run(recorder, idle_timeout=3.0)
    assert recorder.done[0] == [0, 1, 2, 3, 4, 5]  # from the committed position, in order
    # The first message after the position was handed to an owner that never got past it.
    assert [a for _k, n, a in recorder.calls if n < 3] == [2, 1, 1]
    assert time.monotonic() - started < 30


# -- failures ----------------------------------------------------------------------------------
def test_poison_message_reaches_the_dead_letter_topic(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=2, per_key=5)
    recorder = Recorder(fail=lambda r: r["k"] == 0 and r["n"] == 2)
    with broker.consumer("orders", "g", max_attempts=3, **FAST) as consumer:
        consumer.run(recorder, idle_timeout=1.5)
    assert [a for k, n, a in recorder.calls if (k, n) == (0, 2)] == [1, 2, 3]
    assert recorder.done[0] == [0, 1, 3, 4] and recorder.done[1] == list(range(5))
    letters = list_dead_letters(broker, "orders", "g")
    assert len(letters) == 1
    letter = letters[0]
    assert letter.attempts == 3 and "cannot handle key0#2" in letter.error
    assert letter.topic == "orders" and letter.group == "g" and letter.message.key == b"key0"
    assert json.loads(letter.message.value) == {"k": 0, "n": 2}
    description = describe_group(broker, "orders", "g")
    assert description.dead_letter_messages == 1
    assert sum(p.dead_letters for p in description.partitions) == 1
    assert description.dead_letter_topic == dead_letter_topic("orders", "g") == "orders~dlq~g"
    # Replay: back to the topic, out of the dead-letter topic.
    assert replay_dead_letters(broker, "orders", "g") == 1
    assert list_dead_letters(broker, "orders", "g") == []
    recorder2 = Recorder()
    with broker.consumer("orders", "g", **FAST) as consumer:
        consumer.run(recorder2, idle_timeout=1.5)
    assert dict(recorder2.done) == {0: [2]}


def test_park_key_holds_that_key_and_lets_others_go(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=3, per_key=6)
    recorder = Recorder(fail=lambda r: r["k"] == 1 and r["n"] == 1)
    consumer = broker.consumer("orders", "g", max_attempts=2, failure_policy="park_key", **FAST)
    thread = run_in_thread(consumer, recorder)
    wait_until(
        lambda: recorder.done[0] == list(range(6)) and recorder.done[2] == list(range(6)),
        what="other keys done",
    )
    assert recorder.done[1] == [0]  # key1 parked at #1: #2..#5 held
    description = describe_group(broker, "orders", "g")
    assert description.partitions[0].parked_keys == 1
    assert description.partitions[0].held == 4  # recorded, so the position could move on
    recorder.fail = None
    assert release_key(broker, "orders", "g", "key1") == 1
    wait_until(lambda: recorder.done[1] == [0, 2, 3, 4, 5], what="held messages after release")
    consumer.close()
    thread.join(10)
    assert len(list_dead_letters(broker, "orders", "g")) == 1


def test_block_policy_shows_the_poison_message(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=1)
    produce(broker, "orders", keys=1, per_key=3)
    recorder = Recorder(fail=lambda r: r["n"] == 1)
    consumer = broker.consumer("orders", "g", max_attempts=2, failure_policy="block", **FAST)
    thread = run_in_thread(consumer, recorder)
    wait_until(
        lambda: describe_group(broker, "orders", "g").partitions[0].blocked_offset is not None,
        what="blocked state",
    )
    part = describe_group(broker, "orders", "g").partitions[0]
    assert part.blocked_attempts >= 2 and "cannot handle" in (part.blocked_error or "")
    assert recorder.done[0] == [0]
    recorder.fail = None  # the cause is fixed: the partition goes on by itself
    wait_until(lambda: recorder.done[0] == [0, 1, 2], what="unblocked")
    consumer.close()
    thread.join(10)
    assert describe_group(broker, "orders", "g").partitions[0].blocked_offset is None


def test_idempotent_helper_skips_done_and_reruns_failed(broker: redisq.Broker) -> None:
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

    consumer = broker.consumer("orders", "g", **FAST)
    handler = consumer.idempotent(effect, processing_ttl_ms=500)
    messages = consumer.poll(timeout=10)
    for message in messages:
        try:
            handler(message)
        except RuntimeError:
            handler(message)  # the failed run left no marker: it runs again
    for message in messages:  # a redelivery of everything: all done, all skipped
        handler(message)
    assert effects == [0, 1, 2] and handler.skipped == 3 and handler.ran == 3
    consumer.ack(messages)
    consumer.close()


# -- concurrent mode ---------------------------------------------------------------------------
def test_concurrent_members_compete_and_reclaim_idle_entries(broker: redisq.Broker) -> None:
    broker.create_topic("jobs", partitions=2)
    produce(broker, "jobs", keys=4, per_key=25)
    taken = poll_then_crash(
        server_url_of(broker), broker.namespace, "jobs", "w", "victim", 10, mode="concurrent",
        **FAST,
    )  # fmt: skip
    assert len(taken) == 10  # left pending by the killed member
    recorder = Recorder()
    a = broker.consumer("jobs", "w", "a", mode="concurrent", claim_idle_ms=500, **FAST)
    b = broker.consumer("jobs", "w", "b", mode="concurrent", claim_idle_ms=500, **FAST)
    ta, tb = run_in_thread(a, recorder), run_in_thread(b, recorder)
    wait_until(lambda: recorder.handled() >= 100, what="all jobs, including reclaimed ones")
    a.close()
    b.close()
    ta.join(10)
    tb.join(10)
    assert all(sorted(set(ns)) == list(range(25)) for ns in recorder.done.values())
    with pytest.raises(GroupModeMismatch):
        broker.consumer("jobs", "w", mode="orderly")


# -- observability and CLI ---------------------------------------------------------------------
def test_describe_shows_owner_lease_and_lag(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=2)
    produce(broker, "orders", keys=4, per_key=5)
    with broker.consumer("orders", "g", "solo", **FAST) as consumer:
        wait_until(lambda: len(consumer.assignment) == 2, what="leases")
        description = describe_group(broker, "orders", "g")
        assert [m.name for m in description.members] == ["solo"]
        assert {p.owner for p in description.partitions} == {"solo"}
        assert all(
            p.lease_age_ms is not None and p.lease_age_ms >= 0 for p in description.partitions
        )
        assert description.total_lag == 20
        assert list_groups(broker, "orders") == [("orders", "g")]


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
