"""commit() racing another commit of the same partition (Kafka's commitSync from one thread,
an ack's commit or another commit() from another): the group's position must not go back to
an earlier commit that arrives after a later one."""

from __future__ import annotations

import threading
import time
from typing import Any

import redisq
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess


class Setup:
    def __init__(self, server: ServerProcess, proxy: Proxy, namespace: str, **options: Any):
        self.proxy = proxy
        self.direct = redisq.connect(server.url, namespace=namespace)
        self.direct.create_topic("t", partitions=1)
        with self.direct.producer() as producer:
            self.offsets = [producer.send("t", b"m%d" % i, key="k").offset for i in range(10)]
        self.direct.scripts.load_all()
        self.gstate = self.direct.keys.group_partition_state("t", 0, "g").encode()
        self.via = redisq.connect(proxy.url, namespace=namespace, **options)
        self.consumer = self.via.consumer("t", "g", ack_interval_ms=600_000)
        self.errors: list[BaseException] = []

    def commit_in_thread(self) -> threading.Thread:
        def commit() -> None:
            try:
                self.consumer.commit()
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)

        thread = threading.Thread(target=commit)
        thread.start()
        return thread

    def first_commit_held(self) -> threading.Thread:
        """m0..m4 polled and acked; their commit is held by the network; m5..m9 acked."""
        first: list[redisq.Message] = []
        wait_until(
            lambda: bool(first.extend(self.consumer.poll(timeout=0.2, max_messages=5)) or first)
        )
        self.consumer.ack(first)
        self.proxy.trap(self.gstate)
        early = self.commit_in_thread()
        wait_until(lambda: self.proxy.holds_for_server(self.gstate), what="the commit held")
        self.proxy.pass_through()  # that connection stays held; the others pass
        rest = self.consumer.poll(timeout=5, max_messages=5)
        assert [m.offset for m in rest] == self.offsets[5:]
        self.consumer.ack(rest)
        return early

    def committed(self) -> str:
        position = self.consumer.committed(0)
        return f"m{self.offsets.index(position)}" if position in self.offsets else str(position)

    def close(self) -> None:
        self.consumer.close()
        self.via.close()
        self.direct.close()


def test_a_commit_under_way_is_not_overtaken(
    proxied: tuple[ServerProcess, Proxy], namespace: str
) -> None:
    """The first commit (m4) is held by the network; commit() of m9 from another thread went
    ahead of it and the held one then landed: the group was back at m4 (and a later commit()
    had nothing to send: a clean close left m5..m9 to be handled again)."""
    setup = Setup(*proxied, namespace)
    try:
        early = setup.first_commit_held()
        late = setup.commit_in_thread()  # commitSync of m9
        deadline = time.monotonic() + 2  # before the fix it commits m9 at once
        while time.monotonic() < deadline and setup.committed() != "m9":
            time.sleep(0.05)
        assert setup.proxy.release_held() == 1  # the first commit (m4) arrives
        early.join(30)
        late.join(30)
        assert not early.is_alive() and not late.is_alive() and not setup.errors
        setup.consumer.commit()
        assert setup.committed() == "m9"
    finally:
        setup.close()


def test_a_commit_that_timed_out_and_lands_late_does_not_move_the_position_back(
    proxied: tuple[ServerProcess, Proxy], namespace: str
) -> None:
    """The first commit (m4) times out on the client (its outcome unknown) while its bytes are
    still in the network; commit() of m9 then succeeds; the late copy lands. Commits are
    numbered per lease: the late copy (number 1, number 2 applied) changes nothing, and the
    group stays at m9 (before, it went back to m4)."""
    setup = Setup(*proxied, namespace, socket_timeout=1.0)
    try:
        early = setup.first_commit_held()
        early.join(30)
        assert setup.errors, "the held commit timed out"
        setup.consumer.commit()  # m9 (with what the failed one carried)
        setup.proxy.release_held()  # the late copy of the m4 commit lands (if it has not yet)
        assert setup.proxy.wait_released(10)
        setup.consumer.commit()  # nothing left to commit
        assert setup.committed() == "m9"
    finally:
        setup.close()
