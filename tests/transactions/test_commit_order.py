"""A plain commit of an input partition on the wire, or whose answer was lost, and a
consume-transform-produce transaction that acks the next messages of that partition: the
group's position must stay where the transaction put it, whatever the plain commit does
afterwards (its late copy landing, its resend, or the commit itself arriving after the
transaction's hold). Before, the group went back behind the transaction's inputs, which were
then handled twice. Both APIs, Valkey and Redis 7.0, through a proxy that holds the commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess
from tests.txhelp import DRIVERS, values_of


class Setup:
    """Ten messages m0..m9 of one key on a one-partition topic; a consumer and a transactional
    producer through the proxy (socket_timeout `timeout`); m0..m4 polled and acked."""

    def __init__(self, api: str, server: ServerProcess, proxy: Proxy, timeout: float) -> None:
        self.proxy = proxy
        namespace = f"txco{time.monotonic_ns() % 10**9}"
        self.direct = redisq.connect(server.url, namespace=namespace)
        self.direct.create_topic("t", partitions=1)
        self.direct.create_topic("out", partitions=1)
        with self.direct.producer() as producer:
            self.offsets = [producer.send("t", b"m%d" % i, key="k").offset for i in range(10)]
        self.direct.scripts.load_all()  # a held call must run when released, not meet NOSCRIPT
        self.gstate = self.direct.keys.group_partition_state("t", 0, "g").encode()
        self.via = DRIVERS[api](proxy.url, namespace, socket_timeout=timeout)
        self.consumer = self.via.consumer("t", "g", "m1", ack_interval_ms=600_000)
        self.producer = self.via.producer("xf", transactional=True)
        self.errors: list[BaseException] = []
        first = self.consumer.poll(timeout=5, max_messages=5)
        assert [m.offset for m in first] == self.offsets[:5]
        self.consumer.ack(first)

    def hold_a_commit(self) -> threading.Thread:
        """consumer.commit() of m4 from a thread, its bytes held by the proxy."""

        def commit() -> None:
            try:
                self.consumer.commit()
            except BaseException as exc:  # noqa: BLE001 - looked at by the tests
                self.errors.append(exc)

        self.proxy.trap(self.gstate)
        thread = threading.Thread(target=commit)
        thread.start()
        wait_until(lambda: self.proxy.holds_for_server(self.gstate), what="the commit held")
        self.proxy.pass_through()  # that connection stays held; the others pass
        return thread

    def transaction_acks_the_rest(self) -> Any:
        """m5..m9 acked by an open transaction that writes one output message."""
        rest = self.consumer.poll(timeout=5, max_messages=5)
        assert [m.offset for m in rest] == self.offsets[5:]
        tx = self.producer.transaction()
        tx.send("out", b"out", key="k")
        tx.ack(self.consumer, rest)
        return tx

    def transaction_takes_the_rest(self) -> None:
        tx = self.transaction_acks_the_rest()
        tx.commit()
        assert tx.state == "committed"

    def committed(self) -> str:
        """The group's position as stored (read directly, not through the consumer)."""
        (group,) = self.direct.client.xinfo_groups(self.direct.keys.log("t", 0))
        position = group["last-delivered-id"].decode()
        return f"m{self.offsets.index(position)}" if position in self.offsets else position

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.via.close()
        self.direct.close()


@pytest.fixture(params=sorted(DRIVERS))
def api(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def setup_of(api: str, proxied: tuple[ServerProcess, Proxy]) -> Iterator[Any]:
    made: list[Setup] = []

    def make(timeout: float) -> Setup:
        made.append(Setup(api, *proxied, timeout))
        return made[-1]

    yield make
    for setup in made:
        setup.close()


def test_a_plain_commit_that_timed_out_does_not_take_back_a_transactions_position(
    setup_of: Any,
) -> None:
    """The m4 commit times out on the client while its bytes are held; m5..m9 go to a
    transaction, which commits (the group at m9). The consumer's next commit sends what the
    failed one carried again, without its position; the held copy then lands and is ignored
    (the transaction's hold is numbered after it). The group stays at m9 throughout."""
    setup = setup_of(timeout=1.0)
    early = setup.hold_a_commit()
    early.join(30)
    assert setup.errors, "the held commit timed out"
    setup.transaction_takes_the_rest()
    assert setup.committed() == "m9"
    setup.consumer.commit()  # before: sent m4 again
    assert setup.committed() == "m9"
    setup.proxy.release_held()  # the late copy of the m4 commit lands
    assert setup.proxy.wait_released(10)
    assert setup.committed() == "m9"  # before: m4
    setup.consumer.commit()
    assert setup.committed() == "m9"
    assert values_of(setup.direct, "out") == [b"out"]


def test_a_plain_commit_overtaken_by_a_transactions_hold_changes_nothing(
    setup_of: Any,
) -> None:
    """The m4 commit is on the wire (held, its answer still awaited) while a transaction
    takes m5..m9 and commits. When the held commit then arrives, Redis has applied the
    transaction's hold, numbered after it: the commit changes nothing and says so, and the
    consumer sends its records again without its position. The group stays at m9."""
    setup = setup_of(timeout=30.0)
    early = setup.hold_a_commit()
    setup.transaction_takes_the_rest()
    assert setup.committed() == "m9"
    assert setup.proxy.release_held() == 1
    early.join(30)
    assert not early.is_alive() and not setup.errors
    assert setup.committed() == "m9"  # before: m4
    setup.consumer.commit()
    assert setup.committed() == "m9"


def test_a_plain_commit_that_times_out_during_a_transaction_does_not_take_back_its_position(
    setup_of: Any,
) -> None:
    """The m4 commit is on the wire while a transaction acks m5..m9, and times out before the
    transaction commits. Its position is passed by the transaction's: the consumer's next
    commit does not send it again (before, it did, after the transaction had put the group at
    m9), and its late copy is ignored."""
    setup = setup_of(timeout=1.0)
    early = setup.hold_a_commit()
    tx = setup.transaction_acks_the_rest()
    early.join(30)
    assert setup.errors, "the held commit timed out"
    tx.commit()
    assert setup.committed() == "m9"
    setup.consumer.commit()
    assert setup.committed() == "m9"  # before: m4
    setup.proxy.release_held()
    assert setup.proxy.wait_released(10)
    setup.consumer.commit()
    assert setup.committed() == "m9"
