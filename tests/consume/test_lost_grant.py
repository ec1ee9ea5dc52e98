"""A lease grant whose answer is lost (the connection breaks after acquire_lease ran): the
partition must not sit idle until the lease runs out (30 s by default).

Each acquire attempt carries a request id; the instance that got no answer sends the same id
again, and acquire_lease.lua answers it with the grant it made (same lease value, same fencing
token, its ttl restarted). A member that no longer wants the partition (it closes, or a
rebalance moved it) gives the request up: Redis releases its grant in the same call and
refuses a late copy of it. An error reply to a resend keeps the id (it says nothing of the
first attempt), and close() releases a grant answered while it closes. The script's rules run on
every backend; the faults are real (a proxy forwards the call, keeps the answer, then resets
the connection), on a private Redis 7.0 and Valkey. The lost grant answered again, the error
reply to the resend and the give-up not held up by a failing acquire run through both APIs (the
`via` fixture, tests/apis.py); how close() meets an acquire still out differs by design (the
thread API's waits for the blocked call, the asyncio API's cancels it and gives the request up
at once), so those tests are per API, and so is close() cancelling a hand-over (asyncio only).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import redisq
import redisq.asyncio as rq
from redisq.consume.membership import GroupMembership
from redisq.model.records import Message
from redisq.protocol import group as calls
from tests.aio import aio
from tests.aio import wait_until as async_wait_until
from tests.apis import open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess

VALUES = [f"m{i}".encode() for i in range(5)]
TTL_MS = 30_000  # the default lease ttl: what the partition would wait without the fix
RECOVERED_S = 10.0  # well under TTL_MS: the lost grant is answered again on the next attempt
# No heartbeat or metadata read falls in a test's few seconds (not needed for the trap, which
# only holds an acquire; it keeps the logs of a run short).
QUIET = {
    "lease_ttl_ms": TTL_MS,
    "heartbeat_interval_ms": 60_000,
    "session_timeout_ms": 180_000,
    "metadata_max_age_ms": 120_000,
}


def send(broker: redisq.Broker, *values: bytes) -> None:
    with broker.producer() as producer:
        for value in values:
            producer.send("t", value, key="k")


# -- the script's rules, every backend ------------------------------------------------------------
def member(broker: redisq.Broker, name: str) -> GroupMembership:
    m = GroupMembership(
        broker,
        "t",
        "g",
        name,
        mode="orderly",
        start="earliest",
        policy="dead_letter",
        lease_ttl_ms=TTL_MS,
        session_timeout_ms=TTL_MS,
    )
    m.join()
    return m


def test_the_same_request_is_answered_with_its_grant(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, b = member(broker, "a"), member(broker, "b")
    lease_key = broker.keys.lease("t", 0, "g")
    first = a.acquire_lease(0, "r1")
    assert first is not None and first.takeovers == 0
    broker.client.pexpire(lease_key, 5_000)
    again = a.acquire_lease(0, "r1")  # the answer to the first was lost: sent again
    assert again == first  # the same grant: value, token, position, count
    assert broker.client.pttl(lease_key) > 10_000  # its ttl restarted for the holder
    assert int(broker.client.get(broker.keys.lease_fence("t", 0, "g"))) == first.lease.token
    assert a.acquire_lease(0, "r2") is None  # another attempt of the holder: refused
    assert a.acquire_lease(0) is None  # no request id: refused
    assert b.acquire_lease(0, "r3") is None  # another member: held


def test_a_request_given_up_releases_its_grant_and_refuses_late_copies(
    broker: redisq.Broker,
) -> None:
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, b = member(broker, "a"), member(broker, "b")
    lease_key = broker.keys.lease("t", 0, "g")
    assert a.acquire_lease(0, "r0") is not None  # an owner that died holding the message
    broker.client.delete(lease_key)
    lost = a.acquire_lease(0, "r1")
    assert lost is not None and lost.takeovers == 1
    assert a.give_up_lease(0, "r1")  # released, in the same call
    assert broker.client.get(lease_key) is None
    assert not a.give_up_lease(0, "r1")  # sent again (its answer lost too): nothing more
    assert a.acquire_lease(0, "r1") is None  # a late copy of r1: refused, nothing granted
    assert broker.client.get(lease_key) is None
    assert b.give_up_lease(0, "r9") is False  # a request that never reached Redis
    nxt = b.acquire_lease(0, "r3")
    assert nxt is not None and nxt.takeovers == 1  # r1's grant made no attempt: taken back


def test_a_request_counts_one_takeover_however_often_granted(broker: redisq.Broker) -> None:
    """A grant of r1 that expired unanswered, then granted anew to r1: one owner, one count;
    unless another grant came in between (a client without request ids, mid-upgrade)."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, old = member(broker, "a"), member(broker, "old")
    lease_key = broker.keys.lease("t", 0, "g")
    assert a.acquire_lease(0, "r0") is not None  # an owner that died holding the message
    broker.client.delete(lease_key)  # its lease ran out
    lost = a.acquire_lease(0, "r1")
    assert lost is not None and lost.takeovers == 1
    broker.client.delete(lease_key)  # r1's grant ran out before its answer came
    regranted = a.acquire_lease(0, "r1")
    assert regranted is not None and regranted.lease.token == lost.lease.token + 1
    assert regranted.takeovers == 1  # not 2: the same attempt
    broker.client.delete(lease_key)
    between = old.acquire_lease(0)  # a client that sends no request id, and dies
    assert between is not None and between.takeovers == 2
    broker.client.delete(lease_key)
    late = a.acquire_lease(0, "r1")
    assert late is not None and late.takeovers == 3  # an owner had it since: it counts


def test_giving_up_a_grant_that_ran_out_unseen_takes_its_count_back(
    broker: redisq.Broker,
) -> None:
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, b = member(broker, "a"), member(broker, "b")
    lease_key = broker.keys.lease("t", 0, "g")
    assert a.acquire_lease(0, "r0") is not None
    broker.client.delete(lease_key)
    assert a.acquire_lease(0, "r1") is not None  # counted: 1
    broker.client.delete(lease_key)  # ran out before its answer came; nobody granted since
    assert not a.give_up_lease(0, "r1")  # nothing held to release, but the count goes back
    nxt = b.acquire_lease(0, "r2")
    assert nxt is not None and nxt.takeovers == 1


# -- real faults: the answer lost with the connection ---------------------------------------------
class Setup:
    """A topic of five messages on the private server, and a foreign holder of the partition's
    lease, so the consumer keeps trying to acquire it (one attempt at a time, every tick)."""

    def __init__(self, server: ServerProcess, proxy: Proxy, namespace: str) -> None:
        self.proxy = proxy
        self.direct = redisq.connect(server.url, namespace=namespace)
        self.direct.create_topic("t", partitions=1)
        send(self.direct, *VALUES)
        self.client: redis.Redis = self.direct.client
        self.lease = self.direct.keys.lease("t", 0, "g")
        self.fence = self.direct.keys.lease_fence("t", 0, "g")
        self.client.set(self.lease, "1:someone-else:0", px=600_000)
        self.client.set(self.fence, 1)
        # As on a server in use, the scripts are loaded: the held EVALSHA runs (no NOSCRIPT).
        self.direct.scripts.load_all()

    def hold_next_acquire(self) -> None:
        """The consumer's next acquire attempt is held by the network (its connection alone)."""
        self.proxy.trap(self.fence.encode())

    def acquire_held(self) -> bool:
        return self.proxy.holds_for_server(self.fence.encode())

    def run_held_acquire(self) -> str:
        """The foreign lease goes, the held acquire runs on the server and is granted; its
        answer stays held. Returns the lease value it granted. (The consumer is waiting for
        that answer: no other attempt of its can be under way.)"""
        self.client.delete(self.lease)
        assert self.proxy.lose_answers(self.fence.encode()) == 1
        assert self.proxy.wait_released(10), "the server did not answer the acquire"
        granted = self.client.get(self.lease)
        assert granted is not None and granted.startswith(b"2:"), granted
        return granted.decode()

    def cut(self) -> None:
        """Every connection reset (the held answer is lost with its connection); the network
        works again."""
        self.proxy.reset_all()
        self.proxy.pass_through()

    def lose_the_answer(self) -> str:
        granted = self.run_held_acquire()
        self.cut()
        return granted

    def busy(self, seconds: float) -> threading.Thread:
        """Another client runs a script for `seconds`: meanwhile the server answers -BUSY
        (busy-reply-threshold 100 ms). Returns once it does."""
        self.client.config_set("busy-reply-threshold", 100)
        other = redis.Redis(port=self.client.connection_pool.connection_kwargs["port"])
        script = (
            "local t = redis.call('TIME') local start = t[1] * 1e6 + t[2] "
            "while true do local n = redis.call('TIME') "
            f"if n[1] * 1e6 + n[2] - start > {int(seconds * 1e6)} then return 1 end end"
        )
        runner = threading.Thread(target=lambda: other.eval(script, 0))
        runner.start()
        probe = redis.Redis(port=other.connection_pool.connection_kwargs["port"])

        def answers_busy() -> bool:
            try:
                probe.ping()
            except redis.ResponseError as exc:
                return str(exc).startswith("BUSY")
            return False

        wait_until(answers_busy, timeout=5, what="the server answering -BUSY")
        return runner

    def tokens(self) -> int:
        return int(self.client.get(self.fence) or 0)

    def close(self) -> None:
        self.direct.close()


@pytest.fixture
def setup(proxied: tuple[ServerProcess, Proxy], namespace: str) -> Iterator[Setup]:
    s = Setup(*proxied, namespace)
    yield s
    s.close()


@pytest.fixture(params=["sync", "async"])
def via(request: pytest.FixtureRequest, setup: Setup, namespace: str) -> Iterator[Any]:
    """Both APIs (tests/apis.py) connected through the proxy, in the test's namespace."""
    driver = open_api(str(request.param), setup.proxy.url, namespace)
    try:
        yield driver
    finally:
        driver.shutdown()


def poll_all(consumer: Any, timeout: float, what: str) -> list[Message]:
    """poll() (either API, nothing acked) until the five messages came."""
    got: list[Message] = []

    def more() -> bool:
        got.extend(consumer.poll(0.2))
        return len(got) >= len(VALUES)

    wait_until(more, timeout=timeout, what=what)
    return got


def test_lost_grant_is_answered_again(setup: Setup, via: Any) -> None:
    """Before: the acquire was refused (the lease held by its own lost grant) until the lease ran
    out, 30 s of an idle partition. Now the next attempt gets that grant at once."""
    consumer = via.broker.consumer("t", "g", **QUIET)
    try:
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        granted = setup.lose_the_answer()
        lost_at = time.monotonic()
        got = poll_all(consumer, RECOVERED_S, "the messages, before the lease ran out")
        assert time.monotonic() - lost_at < TTL_MS / 1000
        assert [m.value for m in got] == VALUES
        assert [m.attempt for m in got] == [1] * len(VALUES)
        assert setup.tokens() == 2  # one grant: the lost one, answered again
        assert setup.client.get(setup.lease).decode() == granted
    finally:
        consumer.close()
    assert setup.client.get(setup.lease) is None


def test_close_releases_a_lost_grant(setup: Setup, namespace: str) -> None:
    """The consumer closes while its acquire is out: the grant it never saw is released (before:
    it held the partition for 30 s after the close). Thread API: close() waits for the
    coordinator's acquire, still blocked in its call, while the answer is lost (an asyncio close()
    cancels that acquire at once and gives its request up first, so the grant is never made:
    test_asyncio_a_late_copy_of_an_acquire_given_up_grants_nothing)."""
    with redisq.connect(setup.proxy.url, namespace=namespace) as via:
        consumer = via.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        closer = threading.Thread(target=consumer.close)
        closer.start()
        wait_until(lambda: consumer.ownership.stopping, what="close() under way")
        setup.lose_the_answer()
        closer.join(RECOVERED_S)
        assert not closer.is_alive()
    assert setup.client.get(setup.lease) is None
    assert setup.tokens() == 2
    with setup.direct.consumer("t", "g", **QUIET) as next_owner:  # type: ignore[arg-type]
        got = poll_all(next_owner, RECOVERED_S, "the messages at the next owner")
    assert [m.attempt for m in got] == [1] * len(VALUES)  # the unseen grant was no attempt


@aio
async def test_asyncio_close_releases_a_grant_lost_while_the_loop_was_blocked(
    setup: Setup, namespace: str
) -> None:
    """Asyncio API: the acquire is granted and its answer lost while the event loop is blocked
    (the coordinator cannot try again before close() cancels it); close() gives the request up,
    which releases the grant it never saw."""
    broker = await rq.connect(setup.proxy.url, namespace=namespace)
    consumer = broker.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
    try:
        await consumer.poll(0.05)
        setup.hold_next_acquire()
        await async_wait_until(setup.acquire_held, what="the consumer's acquire held")
        setup.lose_the_answer()  # blocks the loop: the coordinator cannot try again before...
        await consumer.close()  # ...close() stops it
    finally:
        await broker.close()
    assert setup.client.get(setup.lease) is None
    assert setup.tokens() == 2


def busy_replies(caplog: pytest.LogCaptureFixture) -> int:
    return sum("BUSY" in r.getMessage() for r in caplog.records if r.name == "redisq.consumer")


def test_an_error_reply_to_the_resend_keeps_the_request(
    setup: Setup, via: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer to the grant is lost, and the attempt after it gets an error reply (-BUSY:
    another client's long script). The error says nothing of the first attempt: the request id
    is kept, and once the server is free the grant is answered again (before, the id was
    dropped with the error reply and the partition waited for the lease ttl)."""
    consumer = via.broker.consumer("t", "g", **QUIET)
    try:
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        granted = setup.run_held_acquire()
        runner = setup.busy(1.5)
        setup.cut()
        wait_until(lambda: busy_replies(caplog) > 0, timeout=5, what="a -BUSY reply")
        runner.join()
        got = poll_all(consumer, RECOVERED_S, "the messages, before the lease ran out")
        assert [m.value for m in got] == VALUES
        assert setup.tokens() == 2 and setup.client.get(setup.lease).decode() == granted
    finally:
        consumer.close()
    assert setup.client.get(setup.lease) is None


def test_close_releases_a_grant_answered_while_it_closes(setup: Setup, namespace: str) -> None:
    """close() finishes the partitions it holds, then waits for the coordinator, whose acquire
    is answered meanwhile (granted): that grant is released too (before, it was taken up after
    close() had finished the partitions, and held the partition for the lease ttl)."""
    with redisq.connect(setup.proxy.url, namespace=namespace) as via:
        consumer = via.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire held")
        setup.proxy.pass_through()  # the trap is off; the acquire's connection stays held
        closer = threading.Thread(target=consumer.close)
        closer.start()
        wait_until(lambda: consumer.ownership.stopping, what="close() under way")
        setup.client.delete(setup.lease)
        assert setup.proxy.release_held() == 1  # the acquire runs, its answer comes back
        closer.join(RECOVERED_S)
        assert not closer.is_alive()
    assert setup.tokens() == 2  # it was granted...
    assert setup.client.get(setup.lease) is None  # ...and released by close()


@aio
async def test_asyncio_a_late_copy_of_an_acquire_given_up_grants_nothing(
    setup: Setup, namespace: str
) -> None:
    """close() cancels the coordinator while its acquire is still on the wire, and gives the
    request up; the network then delivers the acquire late. Redis refuses it: nothing holds the
    partition (before, the late copy was granted and held it for the lease ttl, unseen)."""
    broker = await rq.connect(setup.proxy.url, namespace=namespace)
    consumer = broker.consumer("t", "g", **QUIET)  # type: ignore[arg-type]
    try:
        await consumer.poll(0.05)
        setup.hold_next_acquire()
        await async_wait_until(setup.acquire_held, what="the consumer's acquire held")
        setup.proxy.pass_through()  # the trap is off; the acquire's connection stays held
        setup.client.delete(setup.lease)
        await consumer.close()
    finally:
        await broker.close()
    assert setup.proxy.release_held() == 1  # the late copy reaches Redis now
    assert setup.proxy.wait_released(10)
    assert setup.tokens() == 1  # not granted
    assert setup.client.get(setup.lease) is None


# -- a request given up is never sent as an acquire again -----------------------------------------
def test_a_request_given_up_is_not_sent_again_as_an_acquire() -> None:
    """The core's bookkeeping (no I/O): a give-up still on its way could otherwise arrive after
    the same request's grant was taken up again, and release it under its holder."""
    from redisq.consume.ownership import OwnershipCore

    core = OwnershipCore(
        "m", orderly=True, lease_ttl_ms=TTL_MS, heartbeat_ms=1_000, metadata_max_age_ms=5_000
    )
    core.partitions_seen("t", 1)
    core.members_seen("t", ["m"])
    tp = ("t", 0)
    first = core.acquire_request(tp)
    assert core.acquire_request(tp) == first  # no answer yet: the same id again
    core.members_seen("t", ["a", "m"])  # the partition moves to a
    due = core.due(0.0)
    assert due.give_up == [(first, tp)] and due.acquire == []
    core.members_seen("t", ["m"])  # and back, before the give-up was answered
    due = core.due(0.0)
    assert due.give_up == [(first, tp)] and due.acquire == [tp]
    assert core.acquire_request(tp) != first
    core.given_up(first)
    assert core.due(0.0).give_up == []


def test_a_late_give_up_leaves_a_newer_grant_alone(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a = member(broker, "a")
    lease_key = broker.keys.lease("t", 0, "g")
    assert a.acquire_lease(0, "r1") is not None  # its answer lost; r1 is then given up...
    broker.client.delete(lease_key)  # ...but the give-up is slow, and r1's grant runs out
    newer = a.acquire_lease(0, "r2")
    assert newer is not None
    assert not a.give_up_lease(0, "r1")  # the give-up arrives: nothing of r2's is touched
    assert broker.client.get(lease_key).decode() == newer.lease.value


def test_a_late_copy_of_a_released_grants_request_is_refused(broker: redisq.Broker) -> None:
    """r1 granted, its answer taken up by a resend, then released on a hand-over; the first
    copy of r1 arrives late: refused (before, it granted the partition again, unseen)."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, b = member(broker, "a"), member(broker, "b")
    grant = a.acquire_lease(0, "r1")
    assert grant is not None and a.release_lease(grant.lease, grant.position)
    assert a.acquire_lease(0, "r1") is None
    assert broker.client.get(broker.keys.lease("t", 0, "g")) is None
    nxt = b.acquire_lease(0, "r2")
    assert nxt is not None and nxt.takeovers == 0  # the release took r1's count back once


def t1_acquires_time_out(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """t/1 (added, held by a foreign lease) cannot be acquired by z-consumer: every attempt
    times out (white-box: the call raises before it is sent, for both drivers)."""
    setup.direct.add_partitions("t", 2)
    setup.client.set(setup.direct.keys.lease("t", 1, "g"), "1:someone-else:0", px=600_000)
    build = calls.acquire_lease

    def failing(keys: Any, ref: Any, partition: int, member: str, *args: Any) -> Any:
        if partition == 1 and member == "z-consumer":
            raise redis.TimeoutError("t/1 times out (the test)")
        return build(keys, ref, partition, member, *args)

    monkeypatch.setattr(calls, "acquire_lease", failing)


FAILING = {**QUIET, "heartbeat_interval_ms": 100}


def test_a_failing_acquire_does_not_hold_up_a_give_up(
    setup: Setup, via: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t/0's grant is lost and t/0 moves to another member while every acquire of t/1 times
    out: the give-up of t/0 still goes, and the other member gets t/0 at once (before, the
    acquire's error ended the tick before any give-up was sent)."""
    t1_acquires_time_out(setup, monkeypatch)
    consumer = via.broker.consumer("t", "g", "z-consumer", **FAILING)
    try:
        setup.hold_next_acquire()
        wait_until(setup.acquire_held, what="the consumer's acquire of t/0 held")
        other = member(setup.direct, "a-other")  # sorts first: t/0 is its share
        other.heartbeat()
        setup.lose_the_answer()
        wait_until(
            lambda: setup.client.get(setup.lease) is None,
            timeout=RECOVERED_S,
            what="t/0's lost grant released",
        )
        assert other.acquire_lease(0, "o1") is not None
    finally:
        consumer.close()


@aio
async def test_asyncio_close_in_the_middle_of_a_hand_over_releases_the_lease(
    broker: redisq.Broker, server_url: str, namespace: str
) -> None:
    """The coordinator hands t/0 over (another member came) and awaits on_revoke; close()
    cancels it there. The hand-over is left to close(), which finishes it (on_revoke is called
    again) and releases the lease (before, the partition was forgotten with its lease held)."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    revoked: list[list[tuple[str, int]]] = []

    async def on_revoke(tps: list[tuple[str, int]]) -> None:
        revoked.append(tps)
        if len(revoked) == 1:
            await asyncio.sleep(60)  # close() comes in the middle

    aio_broker = await rq.connect(server_url, namespace=namespace)
    consumer = aio_broker.consumer(
        "t",
        "g",
        "z-member",
        on_revoke=on_revoke,
        heartbeat_interval_ms=100,
        session_timeout_ms=30_000,
    )
    try:
        got: list[Message] = []
        while len(got) < len(VALUES):
            got.extend(await consumer.poll(0.2))
        await consumer.ack(got)
        member(broker, "a-other").heartbeat()  # sorts first: t/0 is its share now
        await async_wait_until(lambda: bool(revoked), what="the hand-over under way")
        await consumer.close()
    finally:
        await aio_broker.close()
    assert len(revoked) == 2
    assert broker.client.get(broker.keys.lease("t", 0, "g")) is None
    (group,) = broker.client.xinfo_groups(broker.keys.log("t", 0))
    assert group["last-delivered-id"].decode() == got[-1].offset  # what was acked: committed


def test_a_late_copy_stays_refused_after_other_hand_overs(broker: redisq.Broker) -> None:
    """a gives up ra; o is granted the partition and hands it over as usual; then the late copy
    of ra arrives: still refused (Redis keeps the last 16 requests given up, not only one)."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    a, o = member(broker, "a"), member(broker, "o")
    assert not a.give_up_lease(0, "ra")  # its acquire never arrived (yet)
    for n in range(3):
        grant = o.acquire_lease(0, f"ro{n}")
        assert grant is not None and o.release_lease(grant.lease, grant.position)
    assert a.acquire_lease(0, "ra") is None
    assert broker.client.get(broker.keys.lease("t", 0, "g")) is None
    for n in range(16):  # the oldest are forgotten, the list stays bounded
        assert not a.give_up_lease(0, f"more{n}")
    given_up = broker.client.hget(broker.keys.group_partition_state("t", 0, "g"), "given_up")
    assert given_up is not None and len(given_up.split()) == 16


@aio
async def test_asyncio_close_in_the_middle_of_a_hand_overs_commit_commits(
    broker: redisq.Broker, server_url: str, namespace: str
) -> None:
    """close() cancels the hand-over while its commit is on the way: close() sends the commit
    again (before, the commit was lost with the cancel and the next owner got the acked
    messages again). White-box: the hand-over's commit is slowed down."""
    broker.create_topic("t", partitions=1)
    send(broker, *VALUES)
    aio_broker = await rq.connect(server_url, namespace=namespace)
    consumer = aio_broker.consumer(
        "t",
        "g",
        "z-member",
        heartbeat_interval_ms=100,
        session_timeout_ms=30_000,
    )
    try:
        got: list[Message] = []
        while len(got) < len(VALUES):
            got.extend(await consumer.poll(0.2))
        commit = consumer.io.commit
        committing = asyncio.Event()

        async def slow_commit(*args: Any) -> bool:
            if not committing.is_set():
                committing.set()
                await asyncio.sleep(2)
            return await commit(*args)

        consumer.io.commit = slow_commit  # type: ignore[method-assign]
        await consumer.ack(got)
        member(broker, "a-other").heartbeat()  # sorts first: t/0 is its share now
        await asyncio.wait_for(committing.wait(), 10)
        await consumer.close()
    finally:
        await aio_broker.close()
    (group,) = broker.client.xinfo_groups(broker.keys.log("t", 0))
    assert group["last-delivered-id"].decode() == got[-1].offset
    assert broker.client.get(broker.keys.lease("t", 0, "g")) is None
