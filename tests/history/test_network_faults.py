"""Network faults through a loopback TCP proxy (tests/history/proxy.py), checked through the
history checker: a producer cut off past its delivery timeout whose abandoned batch arrives late,
a consumer cut off past its lease, and a flaky network (added latency, resets, short blackholes).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

import redisq
from tests.history.checker import Stored
from tests.history.faults import wait_until
from tests.history.harness import PRODUCER, TOPIC, Run, assert_no_violations, read_stored
from tests.history.proxy import Proxy
from tests.servers import ServerProcess, binary_for

pytestmark = pytest.mark.fault

KINDS = ["valkey", "redis"]
LEASE_TTL_MS = 1500


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> ServerProcess:
    """A server of its own, stopped by the Run that takes it over."""
    return ServerProcess(binary_for(request.param)).start()


def hold(seconds: float) -> None:
    """The duration of a fault (a network kept broken): not a wait for a condition."""
    time.sleep(seconds)


def stored_now(run: Run) -> list[Stored]:
    with redisq.connect(run.url, namespace=run.namespace) as reader:
        return read_stored(reader)


def setup(run: Run, partitions: int) -> None:
    with redisq.connect(run.url, namespace=run.namespace) as broker:
        broker.create_topic(TOPIC, partitions=partitions)


# -- the proxy itself ------------------------------------------------------------------------------


SET_K = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\nlate\r\n"
SET_J = b"*3\r\n$3\r\nSET\r\n$1\r\nj\r\n$6\r\nhealed\r\n"


def run_wait(condition: Callable[[], object]) -> None:
    wait_until(condition, 5, "the proxy")


def test_proxy_modes() -> None:
    """pass, delay, blackhole (held bytes arrive on release, after a healed new connection
    already works), reset: the proxy does what the scenarios rely on."""
    server = ServerProcess().start()
    proxy = Proxy(server.port).start()
    try:
        direct = server.client(socket_timeout=5)
        through = redis.Redis(port=proxy.port, socket_timeout=5)
        assert through.ping()
        proxy.delay(150)
        started = time.monotonic()
        assert through.ping()
        assert time.monotonic() - started >= 0.25  # both directions wait
        proxy.pass_through()

        proxy.blackhole()
        late = socket.create_connection(("127.0.0.1", proxy.port))
        late.sendall(SET_K)
        run_wait(lambda: len(proxy.held_connections()) == 1)
        [kept] = proxy.held_connections()
        other = socket.create_connection(("127.0.0.1", proxy.port))
        other.sendall(SET_J)
        run_wait(lambda: len(proxy.held_connections()) == 2)
        assert proxy.stats()["held_bytes"] == len(SET_K) + len(SET_J)
        late.close()  # the client gives up; its bytes are still on their way
        proxy.heal(keep=[kept])
        run_wait(lambda: direct.get("j") == b"healed")  # held elsewhere: delivered at heal
        fresh = redis.Redis(port=proxy.port, socket_timeout=5)
        assert fresh.ping()  # a new connection passes at once
        assert direct.get("k") is None  # the kept connection's SET has not arrived
        assert proxy.release_held() == 1
        assert proxy.wait_released(5)
        assert direct.get("k") == b"late"  # the late copy really arrived
        other.close()

        raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        raw.sendall(b"PING\r\n")
        assert raw.recv(100) == b"+PONG\r\n"
        assert proxy.reset_all() >= 1
        with pytest.raises(ConnectionResetError):
            raw.recv(100)  # an RST, not a clean close
        raw.close()
        for client in (direct, through, fresh):
            client.close()
    finally:
        proxy.stop()
        server.stop()


# -- a producer cut off past its delivery timeout --------------------------------------------------

DELIVERY_TIMEOUT_MS = 2000


@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_blackhole_past_delivery_timeout(
    server: ServerProcess, named: bool, tmp_path: Path
) -> None:
    """A producer (delivery_timeout_ms=2000) talks to the server through the proxy. The proxy
    blackholes while a send() is in flight: send() must fail with DeliveryTimeout within twice
    the delivery timeout. The network then heals for new connections and the producer sends
    newer messages of the same key; only then does the proxy deliver the bytes it held, so the
    abandoned batch really reaches the server late. It must not land after the newer messages
    of its key (the producer must have fenced its abandoned identity before moving on)."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run, partitions=2)
        proxy = run.proxy(server.port)
        options = {"delivery_timeout_ms": DELIVERY_TIMEOUT_MS, "linger_ms": 0}
        producer = run.producer("A", name="svc" if named else None, url=proxy.url, options=options)
        notes: list[str] = []

        def send(count: int) -> list[dict[str, object]]:
            reply = producer.command("send", key="k0", count=count, timeout=180)
            return list(reply["outcomes"])

        for outcome in send(3):
            assert "error" not in outcome, f"before any fault: {outcome}"
        run.driver.record("blackhole", "proxy")
        proxy.blackhole()
        producer.start_command("send", key="k0", count=1)
        run.wait(proxy.held_connections, 10, "the send to reach the blackhole")
        abandoned = proxy.held_connections()  # the batch the producer will give up on
        [cut_off] = producer.wait_reply("send", timeout=180)["outcomes"]
        limit = 2 * DELIVERY_TIMEOUT_MS / 1000
        if cut_off.get("error") != "DeliveryTimeout":
            notes.append(f"send() during the blackhole ended with {cut_off}, not DeliveryTimeout")
        if float(cut_off["elapsed"]) > limit:
            notes.append(
                f"send() failed after {cut_off['elapsed']:.1f} s, more than twice "
                f"delivery_timeout_ms={DELIVERY_TIMEOUT_MS}"
            )
        # The network heals: whatever the producer tried meanwhile goes through now, except the
        # abandoned batch's bytes, which stay on their way.
        run.driver.record("heal_except", "proxy", keep=abandoned)
        proxy.heal(keep=abandoned)
        for outcome in send(3):
            if "error" in outcome:
                notes.append(f"send() after the network healed failed: {outcome}")
        released = proxy.release_held()
        run.driver.record("release_held", "proxy", connections=released)
        assert released >= 1, "the blackhole held nothing for the server: no late copy"
        if not proxy.wait_released(15):
            notes.append("the server never answered the released bytes")
        notes += run.close_producers(["A"])
        stored = stored_now(run)
        run.finish_workers()
        results = run.check(stored, ("acknowledged_stored_once", "key_order_in_log"))
        assert_no_violations(results, notes)


# -- a consumer cut off past its lease -------------------------------------------------------------


def test_consumer_cut_off_past_lease(server: ServerProcess, tmp_path: Path) -> None:
    """Member c1 reaches the server through the proxy, c2 directly. The proxy blackholes c1 for
    twice the lease TTL, then heals and delivers what it held (late renewals, reads and acks).
    Handlers are slow (50 ms), batches big (60) and acks go with the next read, so c1 has more
    work in hand than its lease lasts and nothing to ask the server: it must stop handling
    before its lease runs out (nothing freezes it: no excuse), c2
    takes over, c1's late writes change nothing; every message is handled, in order per key."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run, partitions=2)
        proxy = run.proxy(server.port)
        run.producer("A", options=PRODUCER)
        run.workers["A"].command("stream", count=400, rate=2000, keys=8)
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])  # the backlog: every read is a full batch
        # Acks wait for the next read (ack_interval 10 s), so nothing but the lease deadline
        # stops c1 from handling what it holds.
        options = {"lease_ttl_ms": LEASE_TTL_MS, "batch_size": 60, "ack_interval_ms": 10_000}
        run.consumer("c1", url=proxy.url, options=options, work_ms=50)
        run.consumer("c2", options=options, work_ms=50)
        # c1 is inside its first batch of 60: 3 s of work, twice its lease.
        run.wait(lambda: run.count("handle_end", "c1") >= 5 and run.count("handle_end", "c2")
                 >= 5, 60, "both members handling")  # fmt: skip
        run.driver.record("blackhole", "proxy")
        proxy.blackhole()
        cut = time.time() * 1000
        run.wait(
            lambda: any(e["ev"] == "handle_end" and e["proc"] == "c2" and e["wall"] > cut
                        and e["partition"] in _partitions_of(run, "c1") for e in run.events()),
            60, "c2 to take c1's partitions over",
        )  # fmt: skip
        hold(max(0.0, 2 * LEASE_TTL_MS / 1000 - (time.time() * 1000 - cut) / 1000))
        proxy.heal()
        run.driver.record("heal", "proxy")
        stored = stored_now(run)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)


def _partitions_of(run: Run, proc: str) -> set[int]:
    return {e["partition"] for e in run.events() if e["ev"] == "handle_end" and e["proc"] == proc}


# -- a flaky network -------------------------------------------------------------------------------


def test_flaky_network(server: ServerProcess, tmp_path: Path) -> None:
    """A producer and two members go through the proxy while it adds latency, resets every
    connection and blackholes briefly (shorter than the lease), in turns: every property."""
    with Run(tmp_path, server.url, servers=[server]) as run:
        setup(run, partitions=4)
        proxy = run.proxy(server.port)
        run.producer("A", url=proxy.url, options=PRODUCER)
        for proc in ("c1", "c2"):
            run.consumer(proc, url=proxy.url, options={"lease_ttl_ms": LEASE_TTL_MS}, work_ms=2)
        run.workers["A"].command("stream", count=2000, rate=400, keys=16)
        run.wait_handled(100)
        for _ in range(3):
            run.driver.record("delay", "proxy", ms=30)
            proxy.delay(30)
            hold(0.6)
            run.driver.record("reset_all", "proxy", connections=proxy.reset_all())
            proxy.pass_through()
            hold(0.4)
            run.driver.record("blackhole", "proxy")
            proxy.blackhole()
            hold(0.3)
            proxy.heal()
            run.driver.record("heal", "proxy")
            hold(0.3)
        run.wait_streams(["A"])
        problems = run.close_producers(["A"])
        stored = stored_now(run)
        run.wait_all_handled(stored)
        run.finish_workers()
        assert_no_violations(run.check(stored), problems)
