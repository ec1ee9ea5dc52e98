"""Guards that only a test can defend: each test here fails when the check it names is removed
from the library (issue 9, item 11). The mutants they were tried against are listed per test.

  * The fenced read: a member whose lease was granted to another member reads nothing more of
    that partition and cannot ack (consumer._read_new_entries compares the lease it WATCHes),
    and takes the partition back once it is free again (both APIs).
  * The lease deadline: a member that cannot renew stops handling before its lease runs out,
    even while its reads still work (the deadline checks in consumer._handle_batch and
    consumer._may_handle).
  * Retention by count on real servers: MAXLEN ~ keeps the newest N and at most one stream
    node more (lua/includes/append.lua).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import redisq
from redisq.consume.membership import GroupMembership
from redisq.consume.membership_async import GroupMembership as AsyncGroupMembership
from redisq.errors import LeaseLost
from redisq.model.records import decode_entries
from redisq.protocol.group import Grant, Lease, parse_lease
from tests.apis import poll_and_ack
from tests.conftest import wait_until
from tests.servers import ServerProcess, binary_for

# The fenced-read tests: leases so long that member A's coordinator renews nothing and sees no
# other member during a test (renewal after ttl / 3 = 200 s, next heartbeat after 300 s), so
# only the read path itself can notice that the lease moved.
LONG_LEASE = {"lease_ttl_ms": 600_000, "heartbeat_interval_ms": 300_000}


def send(broker: redisq.Broker, topic: str, values: range) -> None:
    with broker.producer() as producer:
        for i in values:
            producer.send_async(topic, b"%d" % i)


def values(messages: list[redisq.Message]) -> list[int]:
    return [int(m.value) for m in messages]


def pending_of(broker: redisq.Broker, topic: str, group: str, member: str) -> list[Any]:
    return list(
        broker.client.xpending_range(
            broker.keys.log(topic, 0), group, "-", "+", 100, consumername=member
        )
    )


# -- the fenced read ---------------------------------------------------------------------------


def test_member_whose_lease_moved_reads_nothing_of_that_partition(
    api: Any, broker: redisq.Broker
) -> None:
    """A polled, acked and committed; its lease then expired (deleted here, as a pause past the
    ttl would leave it) and B was granted it. A's coordinator has not noticed, so A still
    believes it owns the partition: its next poll must return nothing of it, its acks are
    refused, and B gets the new messages (both APIs).

    Mutant: without the lease comparison of the fenced read (PartitionIO.read_range: the lease
    value read with the entries in one MULTI/EXEC), A's poll returns 5..9 and the test fails."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", range(0, 5))
    a = api.broker.consumer("t", "g", "z-a", **LONG_LEASE)
    b: Any = None
    try:
        first = poll_and_ack(a, 5)
        assert values(first) == [0, 1, 2, 3, 4]
        a.commit()  # acks are committed within ack_interval_ms; now, here

        assert broker.client.delete(broker.keys.lease("t", 0, "g")) == 1
        # B sorts first among [b, z-a]: the partition is B's; B takes the free lease at once.
        b = api.broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        wait_until(lambda: b.assignment == [0], what="B holding the lease")
        send(broker, "t", range(5, 10))
        assert a.assignment == [0], "precondition: A has not noticed the new grant by itself"

        assert a.poll(timeout=0.5) == []
        assert a.assignment == []
        assert pending_of(broker, "t", "g", "z-a") == []  # an orderly group keeps no PEL
        with pytest.raises(LeaseLost):
            a.ack(first)
        assert values(poll_and_ack(b, 5)) == [5, 6, 7, 8, 9]
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_partition_lost_while_polling_is_taken_again_once_free(
    api: Any, broker: redisq.Broker
) -> None:
    """A's poll found its lease granted to B (the fenced read): A stops reading the partition.
    Once B leaves, the partition is A's again (A is the only member left): A must take the
    lease back and read on, or the group never reads that partition again."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", range(0, 5))
    a = api.broker.consumer("t", "g", "z-a", **LONG_LEASE)
    b: Any = None
    try:
        assert values(poll_and_ack(a, 5)) == [0, 1, 2, 3, 4]
        a.commit()
        assert broker.client.delete(broker.keys.lease("t", 0, "g")) == 1
        b = api.broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        wait_until(lambda: b.assignment == [0], what="B holding the lease")
        send(broker, "t", range(5, 10))
        assert a.poll(timeout=0.5) == [] and a.assignment == []  # fenced
        assert values(poll_and_ack(b, 5)) == [5, 6, 7, 8, 9]
        b.close()  # commits, releases the lease, leaves the group
        send(broker, "t", range(10, 15))
        assert values(poll_and_ack(a, 5, timeout=6)) == [10, 11, 12, 13, 14]
        assert a.assignment == [0]
    finally:
        a.close()
        if b is not None:
            b.close()


def test_waiting_read_returns_nothing_once_the_lease_moved_while_it_waited(
    broker: redisq.Broker,
) -> None:
    """A caught-up owner waits for entries and reads them in one round trip (XREAD BLOCK, then
    GET of the lease: PartitionIO.read_waiting). Its lease goes to B while it waits, and the
    entry appended then wakes it: the read raises LeaseLost and hands on nothing, while B,
    waiting in the same way, gets the entry.

    Mutant: without the lease comparison of read_waiting, A's read returns message 2."""
    from redisq.consume.dispatch import OrderlyPartition
    from redisq.consume.partition_io import PartitionIO
    from redisq.consume.policies import Backoff, make_policy
    from redisq.settings import ConsumerSettings

    broker.create_topic("t", partitions=1)
    send(broker, "t", range(0, 2))

    def member(name: str) -> GroupMembership:
        m = GroupMembership(
            broker, "t", "g", name, mode="orderly", start="earliest", policy="dead_letter",
            lease_ttl_ms=600_000, session_timeout_ms=600_000,
        )  # fmt: skip
        m.join()
        return m

    def reader_of(membership: GroupMembership) -> tuple[PartitionIO, OrderlyPartition]:
        grant = membership.acquire_lease(0)
        assert grant is not None
        settings = ConsumerSettings.from_options({})
        io = PartitionIO(
            broker, "g", membership.member, settings, make_policy("block", 5, Backoff())
        )
        reader = OrderlyPartition(grant)
        entries = io.read_range(reader, 10)  # caught up: 0 and 1 read
        reader.admit(decode_entries("t", 0, entries), time.monotonic())
        return io, reader

    a, b = member("a"), member("b")
    io_a, reader_a = reader_of(a)
    outcome: dict[str, Any] = {}

    def wait(name: str, io: PartitionIO, reader: OrderlyPartition) -> None:
        try:
            entries = io.read_waiting(reader, 10, 10_000)
            outcome[name] = [m.value for m in decode_entries("t", 0, entries)]
        except LeaseLost as exc:
            outcome[name] = exc

    waiting_a = threading.Thread(target=wait, args=("a", io_a, reader_a))
    waiting_a.start()
    time.sleep(0.3)  # A is blocked in XREAD
    assert broker.client.delete(broker.keys.lease("t", 0, "g")) == 1  # A's lease expired
    io_b, reader_b = reader_of(b)
    waiting_b = threading.Thread(target=wait, args=("b", io_b, reader_b))
    waiting_b.start()
    time.sleep(0.3)
    send(broker, "t", range(2, 3))
    waiting_a.join(10)
    waiting_b.join(10)
    assert isinstance(outcome.get("a"), LeaseLost), outcome.get("a")
    assert outcome.get("b") == [b"2"]


def test_stale_member_acks_are_refused_and_the_new_owner_redelivers(
    api: Any, broker: redisq.Broker
) -> None:
    """A polled 0..4 and had not acked them when its lease went to B: A's ack is recorded but its
    commit is refused by Redis (LeaseLost, nothing committed), later acks raise LeaseLost, and
    B handles 0..4 again (the first of them counted as a second delivery), then 5..9, in order
    (both APIs)."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", range(0, 5))
    a = api.broker.consumer("t", "g", "z-a", ack_interval_ms=60_000, **LONG_LEASE)
    b: Any = None
    try:
        stale: list[redisq.Message] = []
        wait_until(lambda: bool(stale.extend(a.poll(timeout=0.2)) or stale), what="A's poll")
        assert values(stale) == [0, 1, 2, 3, 4]

        assert broker.client.delete(broker.keys.lease("t", 0, "g")) == 1
        b = api.broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        wait_until(lambda: b.assignment == [0], what="B holding the lease")
        send(broker, "t", range(5, 10))

        position = a.committed(0)
        assert a.ack(stale) == 5  # Kafka's commitAsync: Redis decides at the commit
        with pytest.raises(LeaseLost):
            a.commit()
        assert a.committed(0) == position  # nothing was committed
        assert b.committed(0) == position
        with pytest.raises(LeaseLost):
            a.ack(stale)  # and A knows it now
        assert a.stats.fenced_commits >= 2
        redelivered = poll_and_ack(b, 10)
        assert values(redelivered) == list(range(10))
        assert [m.attempt for m in redelivered[:5]] == [2, 1, 1, 1, 1]
    finally:
        a.close()
        if b is not None:
            b.close()


def test_auto_commit_leaves_a_partition_no_longer_held_alone(
    api: Any, broker: redisq.Broker
) -> None:
    """A polled 0..4 and acked them; its lease then went to B. A's next poll() auto-commits
    what it handed out: the partition is no longer held, so nothing is acked again (no refused
    commit counted, no settle span for messages the user had acked). Mutant: the held_only
    check in Poller._take_handed removed (the old ack goes out and is fenced)."""
    broker.create_topic("t", partitions=1)
    send(broker, "t", range(0, 5))
    a = api.broker.consumer("t", "g", "z-a", lease_ttl_ms=1500, ack_interval_ms=60_000)
    b: Any = None
    try:
        polled: list[redisq.Message] = []
        wait_until(lambda: bool(polled.extend(a.poll(timeout=0.2)) or polled), what="A's poll")
        assert values(polled) == [0, 1, 2, 3, 4]
        assert a.ack(polled) == 5

        assert broker.client.delete(broker.keys.lease("t", 0, "g")) == 1
        b = api.broker.consumer("t", "g", "b", lease_ttl_ms=600_000)
        wait_until(lambda: b.assignment == [0], what="B holding the lease")
        # A finds out at its next renewal and hands the partition over (the guard: its reader
        # and its ownership go together)
        wait_until(lambda: ("t", 0) not in a.ownership.owned, what="A handing over")
        refused = a.stats.fenced_commits
        assert a.poll(timeout=0.2) == []
        assert a.stats.fenced_commits == refused
    finally:
        a.close()
        if b is not None:
            b.close()


# -- the lease deadline --------------------------------------------------------------------------

DEADLINE_TTL_MS = 1500


class CutOff:
    """Cuts member `name` off from its group's coordination once it holds a lease: heartbeats,
    lease grants, renewals and releases raise ConnectionError (as on a link that drops those
    calls), while its reads, acks and handlers go on. Records the leases granted per member.
    Both APIs' memberships (the asyncio one's methods are coroutines) are patched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.name = name
        self.cut = threading.Event()
        self.grants: dict[str, list[Lease]] = {}
        for cls, is_async in ((GroupMembership, False), (AsyncGroupMembership, True)):
            for method in ("heartbeat", "renew_lease", "release_lease", "acquire_lease"):
                monkeypatch.setattr(cls, method, self._patched(getattr(cls, method), is_async))

    def _before(self, membership: Any) -> None:
        if membership.member == self.name and self.cut.is_set():
            raise redis.ConnectionError("cut off by the test")

    def _after(self, membership: Any, original: Callable[..., Any], result: Any) -> None:
        if original.__name__ == "acquire_lease" and isinstance(result, Grant):
            self.grants.setdefault(membership.member, []).append(result.lease)
            if membership.member == self.name:
                self.cut.set()

    def _patched(self, original: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        if is_async:

            async def acall(membership: Any, *args: Any, **kwargs: Any) -> Any:
                self._before(membership)
                result = await original(membership, *args, **kwargs)
                self._after(membership, original, result)
                return result

            return acall

        def call(membership: Any, *args: Any, **kwargs: Any) -> Any:
            self._before(membership)
            result = original(membership, *args, **kwargs)
            self._after(membership, original, result)
            return result

        return call


class Handler:
    """Records the wall-clock start of every call, and the offsets handled successfully. The
    servers run on this host, so time.time() and the server's TIME read the same clock.
    `handle` is the same as a coroutine function (awaited on the asyncio API's loop)."""

    def __init__(self, sleep: float, fail: bool = False) -> None:
        self.sleep = sleep
        self.fail = fail
        self.starts: list[float] = []
        self.done: set[str] = set()

    def __call__(self, message: redisq.Message) -> None:
        self.starts.append(time.time())
        if self.fail:
            raise RuntimeError("downstream unavailable")
        time.sleep(self.sleep)
        self.done.add(message.offset)

    async def handle(self, message: redisq.Message) -> None:
        self.starts.append(time.time())
        if self.fail:
            raise RuntimeError("downstream unavailable")
        await asyncio.sleep(self.sleep)
        self.done.add(message.offset)


@pytest.fixture
def running() -> Iterator[list[Any]]:
    consumers: list[Any] = []
    yield consumers
    for consumer in consumers:
        consumer.close(timeout=10)


def run_in_thread(consumer: Any, handler: Callable[..., Any]) -> threading.Thread:
    thread = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("backend", ["valkey"])
@pytest.mark.parametrize(
    "variant",
    [
        # One lane, a plain handler: a 500-message batch takes 2.5 s, so the deadline falls
        # inside it (mutant: the `limit` check removed from Consumer._handle_batch).
        pytest.param({"key_concurrency": 1, "sleep": 0.005}, id="one-lane"),
        # Key lanes (asyncio: a coroutine handler): each lane checks before every message
        # (mutant: the deadline removed from Consumer._may_handle).
        pytest.param({"key_concurrency": 4, "sleep": 0.02, "coroutine": True}, id="key-lanes"),
        # Policy block on a handler that always fails (asyncio: a coroutine handler): retries
        # would go on for ever (mutant: the deadline removed from Consumer._may_handle, which
        # the retry sleep checks).
        pytest.param(
            {"key_concurrency": 1, "sleep": 0.0, "fail": True, "coroutine": True}, id="retrying"
        ),
    ],
)
def test_member_that_cannot_renew_stops_before_its_lease_deadline(
    api: Any,
    broker: redisq.Broker,
    monkeypatch: pytest.MonkeyPatch,
    running: list[Any],
    variant: dict[str, Any],
) -> None:
    """A holds the only partition; then none of its renewals (nor heartbeats) arrive, while its
    reads and acks still work and messages keep coming. No handler call of A may start after
    its lease expires in Redis (grant time + ttl, server clock); the partition then passes to B,
    and every message is handled (both APIs)."""
    cut = CutOff(monkeypatch, "a")
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        for i in range(600):
            producer.send_async("t", b"%d" % i, key=f"key{i % 16}")
    flowing = threading.Event()
    flowing.set()

    def produce_continuously() -> None:
        with broker.producer(linger_ms=0) as producer:
            i = 600
            while flowing.is_set():
                producer.send("t", b"%d" % i, key=f"key{i % 16}")
                i += 1
                time.sleep(0.005)

    fail = bool(variant.get("fail"))
    options: dict[str, Any] = {
        "lease_ttl_ms": DEADLINE_TTL_MS,
        "batch_size": 500,
        "ack_interval_ms": 1000,
        "key_concurrency": variant["key_concurrency"],
        "retry_backoff_ms": 50,
        "max_retry_backoff_ms": 50,
        "failure_policy": "block" if fail else "dead_letter",
    }
    a_handler = Handler(variant["sleep"], fail=fail)
    b_handler = Handler(0.0005)
    on_loop = api.name == "async"
    producing = threading.Thread(target=produce_continuously, daemon=True)
    try:
        a = api.broker.consumer("t", "g", "a", **options)
        running.append(a)
        run_in_thread(a, a_handler.handle if on_loop and variant.get("coroutine") else a_handler)
        producing.start()
        wait_until(cut.cut.is_set, what="A granted the lease")
        (lease,) = cut.grants["a"]
        parsed = parse_lease(lease.value)
        assert parsed is not None
        expiry = (parsed[2] + DEADLINE_TTL_MS) / 1000  # the lease's PX runs from its grant

        b = api.broker.consumer("t", "g", "b", **options)
        running.append(b)
        run_in_thread(b, b_handler.handle if on_loop else b_handler)
        wait_until(
            lambda: len([t for t in b_handler.starts if t > expiry]) >= 50,
            what="B handling the partition after A's lease ran out",
        )
    finally:
        flowing.clear()
        if producing.is_alive():
            producing.join(30)
    offsets = {m.offset for m in broker.read("t", 0)}
    wait_until(lambda: offsets <= a_handler.done | b_handler.done, what="every message handled")
    for consumer in running:
        consumer.close(timeout=10)

    assert a_handler.starts, "A handled nothing before its deadline"
    late = [round(t - expiry, 3) for t in a_handler.starts if t >= expiry]
    assert late == [], f"{len(late)} handler calls of A started after its lease ran out (s)"
    assert cut.grants["a"] == [lease], "A was granted the partition again"
    assert cut.grants.get("b"), "B never took the partition over"
    assert b.stats.leases_acquired >= 1, "B never took the partition over"


# -- retention by count on real servers ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_retention_by_count_keeps_the_newest_and_at_most_a_node_more(kind: str) -> None:
    """retention_messages=N with XTRIM MAXLEN ~ after every batch: N <= length <= N + node - 1
    (a whole node is dropped only if N remain), and the kept messages are the newest. A server
    of our own, with small stream nodes, so the bound is tight."""
    node_entries = 4
    server = ServerProcess(
        binary_for(kind), config={"stream-node-max-entries": str(node_entries)}
    ).start()
    try:
        broker = redisq.connect(server.url, namespace="retention")
        broker.create_topic("t", retention_messages=10, entry_format="message")  # entries
        lengths = []
        with broker.producer(max_batch_messages=5) as producer:
            for i in range(200):
                producer.send_async("t", b"%d" % i)
                if i % 5 == 4:
                    producer.flush()
                    lengths.append((i + 1, broker.describe_topic("t").partitions[0].length))
        kept = [int(m.value) for m in broker.read("t", 0)]
        broker.close()
    finally:
        server.stop()
    for sent, length in lengths:
        assert min(sent, 10) <= length <= 10 + node_entries - 1, (sent, length)
    assert kept == list(range(200 - len(kept), 200))
