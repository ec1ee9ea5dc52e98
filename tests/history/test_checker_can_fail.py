"""The history checker can fail: each property, fed a hand-made history that breaks it, reports
the violation, and stays quiet on a history that keeps it. No server needed."""

from __future__ import annotations

from typing import Any

from tests.history import checker
from tests.history.checker import History, Stored

T0 = 1_700_000_000_000.0


class Builder:
    """Hand-made events, with times in ms after T0."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.seq: dict[str, int] = {}
        self.calls = 0

    def add(self, ev: str, proc: str, at: float, **fields: Any) -> None:
        self.events.append({"ev": ev, "proc": proc, "wall": T0 + at, "mono": at, **fields})

    def init(self, inst: str, at: float, name: str | None = None) -> None:
        self.add("init_done", inst, at, inst=inst, name=name, server_ms=T0 + at)

    def send(
        self,
        inst: str,
        key: str,
        at: float,
        ok: tuple[int, str] | None = None,
        dup: bool = False,
        fail: str | None = None,
    ) -> str:
        n = self.seq.get(inst, 0)
        self.seq[inst] = n + 1
        value = f"{inst}:{n}"
        self.add("send_invoke", inst, at, inst=inst, key=key, value=value, seq=n)
        if ok is not None:
            self.add("send_ok", inst, at + 1, inst=inst, value=value, partition=ok[0],
                     offset=ok[1], dup=dup)  # fmt: skip
        if fail is not None:
            self.add("send_fail", inst, at + 1, inst=inst, value=value, error=fail, message="")
        return value

    def send_delayed(
        self, inst: str, key: str, at: float, delay_ms: int, partition: int, due: float | None
    ) -> str:
        """A delayed send (delay_ms), acknowledged in `partition` with due time `due` (ms after
        T0; None: answered "already delivered")."""
        n = self.seq.get(inst, 0)
        self.seq[inst] = n + 1
        value = f"{inst}:{n}"
        self.add("send_invoke", inst, at, inst=inst, key=key, value=value, seq=n,
                 delay_ms=delay_ms)  # fmt: skip
        self.add("send_ok", inst, at + 1, inst=inst, value=value, partition=partition,
                 offset=None, dup=due is None, schedule_id=f"s:1:1:{n:012x}",
                 deliver_at_ms=None if due is None else int(T0 + due))  # fmt: skip
        return value

    def handle(
        self, member: str, s: Stored, start: float, end: float | None, proc: str | None = None
    ) -> None:
        self.calls += 1
        where = {"member": member, "call": self.calls, "partition": s.partition, "offset": s.offset}
        self.add("handle_start", proc or member, start, **where, key=s.key, value=s.value,
                 server_ms=T0 + start)  # fmt: skip
        if end is not None:
            self.add("handle_end", proc or member, end, **where, server_ms=T0 + end)

    def fault(self, action: str, target: str, at: float) -> None:
        self.add("fault", "driver", at, action=action, target=target, server_ms=None)

    def history(self) -> History:
        return History(self.events)


def offset(at: float, seq: int = 0) -> str:
    return f"{int(T0 + at)}-{seq}"


def test_clean_history_has_no_violations() -> None:
    b = Builder()
    b.init("A", 0, name="svc")
    stored = []
    for i in range(4):
        value = b.send("A", "k0", 10 + i, ok=(0, offset(20 + i)))
        stored.append(Stored(0, offset(20 + i), "k0", value))
    for i, s in enumerate(stored):
        b.handle("c1", s, 100 + 10 * i, 105 + 10 * i)
    results = checker.check(b.history(), stored)
    assert results == {name: [] for name in checker.ALL}, checker.report(results)


def test_duplicate_stored() -> None:
    b = Builder()
    value = b.send("A", "k0", 0, ok=(0, offset(5)))
    stored = [Stored(0, offset(5), "k0", value), Stored(0, offset(6), "k0", value)]
    violations = checker.acknowledged_stored_once(b.history(), stored)
    assert len(violations) == 1 and "stored 2 times" in violations[0]


def test_duplicate_of_an_unacknowledged_send_is_caught_too() -> None:
    b = Builder()
    value = b.send("A", "k0", 0, fail="DeliveryTimeout")
    stored = [Stored(0, offset(5), "k0", value), Stored(0, offset(6), "k0", value)]
    assert "stored 2 times" in checker.acknowledged_stored_once(b.history(), stored)[0]


def test_lost_acknowledgement() -> None:
    b = Builder()
    kept = b.send("A", "k0", 0, ok=(0, offset(5)))
    lost = b.send("A", "k0", 1, ok=(0, offset(6)))
    dup_lost = b.send("B", "k1", 2, ok=(1, ""), dup=True)  # "duplicate" of nothing stored
    stored = [Stored(0, offset(5), "k0", kept)]
    violations = checker.acknowledged_stored_once(b.history(), stored)
    assert len(violations) == 2
    assert "acknowledged but not stored" in violations[0] and lost in violations[0]
    assert dup_lost in violations[1] and "duplicate" in violations[1]


def test_stored_elsewhere_than_answered_or_never_sent() -> None:
    b = Builder()
    value = b.send("A", "k0", 0, ok=(0, offset(5)))
    stored = [Stored(0, offset(7), "k0", value), Stored(0, offset(8), None, "ghost")]
    violations = checker.acknowledged_stored_once(b.history(), stored)
    assert any("acknowledged at 0/" in v and "but stored at 0/" in v for v in violations)
    assert any("never sent" in v and "ghost" in v for v in violations)
    assert not any(
        "never sent" in v
        for v in checker.acknowledged_stored_once(b.history(), stored, foreign_ok=True)
    )


def test_order_inversion_in_the_log() -> None:
    b = Builder()
    first = b.send("A", "k0", 0, fail="DeliveryTimeout")  # abandoned, lands late
    second = b.send("A", "k0", 10, ok=(0, offset(20)))
    other = b.send("A", "k1", 11, ok=(0, offset(21)))
    stored = [
        Stored(0, offset(20), "k0", second),
        Stored(0, offset(21), "k1", other),
        Stored(0, offset(30), "k0", first),
    ]
    violations = checker.key_order_in_log(b.history(), stored)
    assert len(violations) == 1 and second in violations[0] and "before" in violations[0]
    # Lost messages are skipped, not inversions: only what is stored must keep its order.
    assert checker.key_order_in_log(b.history(), stored[:2]) == []


def test_order_inversion_in_handling() -> None:
    b = Builder()
    m0, m1 = (Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in (1, 2))
    b.handle("c1", m1, 100, 110)  # m1 first
    b.handle("c1", m0, 120, 130)
    violations = checker.key_order_in_handling(b.history(), [m0, m1])
    assert len(violations) == 1 and "before any handling of the previous" in violations[0]


def test_handling_before_the_predecessor_ended_is_an_inversion() -> None:
    b = Builder()
    m0, m1 = (Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in (1, 2))
    b.handle("c1", m0, 100, None)  # killed mid-call: never completed
    b.handle("c2", m1, 200, 210)
    b.fault("kill", "c1", 150)
    assert len(checker.key_order_in_handling(b.history(), [m0, m1])) == 1


def test_redelivery_after_takeover_is_accepted() -> None:
    b = Builder()
    msgs = [Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in (1, 2, 3)]
    b.handle("c1", msgs[0], 100, 110)
    b.handle("c1", msgs[1], 111, 120)
    b.fault("kill", "c1", 125)  # its acks were lost: c2 handles both again, then goes on
    b.handle("c2", msgs[0], 200, 210)
    b.handle("c2", msgs[1], 211, 220)
    b.handle("c2", msgs[2], 221, 230)
    history = b.history()
    assert checker.key_order_in_handling(history, msgs) == []
    assert checker.one_handler_per_partition(history) == []
    assert checker.all_handled(history, msgs) == []


def test_overlapping_handlers() -> None:
    b = Builder()
    msgs = [Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in (1, 2)]
    b.handle("c1", msgs[0], 100, 150)
    b.handle("c2", msgs[1], 140, 160)
    violations = checker.one_handler_per_partition(b.history())
    assert len(violations) == 1 and "overlaps" in violations[0]


def test_a_killed_handler_overlaps_until_its_process_died() -> None:
    b = Builder()
    msgs = [Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in (1, 2)]
    b.handle("c1", msgs[0], 100, None)
    b.handle("c2", msgs[0], 140, 150)
    assert len(checker.one_handler_per_partition(b.history())) == 1  # c1 never died
    b.fault("kill", "c1", 130)
    assert checker.one_handler_per_partition(b.history()) == []


def test_sigstop_excuses_one_frozen_call_not_the_next() -> None:
    b = Builder()
    msgs = [Stored(0, offset(i), "k0", b.send("A", "k0", i, ok=(0, offset(i)))) for i in range(4)]
    b.handle("c1", msgs[0], 100, 105)
    b.handle("c1", msgs[1], 106, 3000)  # frozen mid-call from 110 to 2900
    b.fault("stop", "c1", 110)
    b.fault("cont", "c1", 2900)
    b.handle("c2", msgs[1], 2000, 2010)  # took over after the lease ran out
    b.handle("c2", msgs[2], 2011, 2020)
    history = b.history()
    assert checker.one_handler_per_partition(history) == []
    b.handle("c2", msgs[3], 3005, 3100)
    b.handle("c1", msgs[2], 3010, 3020)  # c1 goes on past its lease after SIGCONT: caught
    violations = checker.one_handler_per_partition(b.history())
    assert len(violations) == 1 and "c1" in violations[0] and "c2" in violations[0]


def test_unhandled_messages() -> None:
    b = Builder()
    msgs = [Stored(p, offset(i), "k0", b.send("A", f"k{p}", i, ok=(p, offset(i)))) for p, i in
            [(0, 1), (0, 2), (1, 3)]]  # fmt: skip
    b.handle("c1", msgs[0], 100, 110)
    b.handle("c1", msgs[1], 120, None)  # started, never finished
    violations = checker.all_handled(b.history(), msgs)
    assert len(violations) == 2
    assert violations[0].startswith("partition 0: 1 stored") and msgs[1].value in violations[0]
    assert violations[1].startswith("partition 1: 1 stored")


def test_fenced_write() -> None:
    b = Builder()
    b.init("A", 0, name="svc")
    before = b.send("A", "k0", 10, ok=(0, offset(11)))
    b.init("B", 100, name="svc")
    late_append = b.send("A", "k0", 50, fail="DeliveryTimeout")  # invoked before, lands after
    late_ok = b.send("A", "k0", 200, ok=(0, offset(201)))  # invoked after B's start: refused?
    b_value = b.send("B", "k0", 210, ok=(0, offset(211)))
    stored = [
        Stored(0, offset(11), "k0", before),
        Stored(0, offset(150), "k0", late_append),
        Stored(0, offset(201), "k0", late_ok),
        Stored(0, offset(211), "k0", b_value),
    ]
    violations = checker.no_fenced_writes(b.history(), stored)
    assert len(violations) == 3
    assert late_append in violations[0] and "after instance B started" in violations[0]
    assert late_ok in violations[1] and late_ok in violations[2]
    # Anonymous instances do not fence each other.
    for event in b.events:
        event.pop("name", None)
    assert checker.no_fenced_writes(b.history(), stored) == []


def test_report_lists_each_property() -> None:
    text = checker.report({"a": ["x"] * 20, "b": []}, limit=3)
    assert text.splitlines()[0] == "a: 20 violation(s)"
    assert "... and 17 more" in text and "b:" not in text


def test_lost_before_excuses_only_sends_invoked_before_the_restart() -> None:
    b = Builder()
    early = b.send("A", "k0", 0, ok=(0, offset(1)))  # acknowledged, then the server forgot it
    late = b.send("A", "k0", 500, ok=(0, offset(501)))  # invoked after the server came back
    violations = checker.acknowledged_stored_once(b.history(), [], lost_before=T0 + 100)
    assert len(violations) == 1 and late in violations[0] and early not in violations[0]


# -- delayed sends: acknowledged once scheduled (offset None), stored when delivered -------------


def test_delayed_sends_stored_once_in_the_partition_answered() -> None:
    b = Builder()
    kept = b.send_delayed("A", "k0", 0, delay_ms=300, partition=2, due=301)
    moved = b.send_delayed("A", "k1", 1, delay_ms=300, partition=2, due=302)
    lost = b.send_delayed("A", "k2", 2, delay_ms=300, partition=2, due=303)
    twice = b.send_delayed("A", "k3", 3, delay_ms=300, partition=2, due=304)
    stored = [
        Stored(2, offset(301), "k0", kept),
        Stored(1, offset(302), "k1", moved),
        Stored(2, offset(304), "k3", twice),
        Stored(2, offset(305), "k3", twice),
    ]
    violations = checker.acknowledged_stored_once(b.history(), stored)
    assert len(violations) == 3, violations
    assert any("stored 2 times" in v and twice in v for v in violations)
    assert any(moved in v and "acknowledged at 2/scheduled" in v and "stored at 1/" in v
               for v in violations)  # fmt: skip
    assert any("acknowledged but not stored" in v and lost in v and "due" in v for v in violations)
    clean = Builder()
    value = clean.send_delayed("A", "k0", 0, delay_ms=300, partition=2, due=301)
    assert (
        checker.acknowledged_stored_once(clean.history(), [Stored(2, offset(320), "k0", value)])
        == []
    )


def test_delivered_not_early() -> None:
    b = Builder()
    on_time = b.send_delayed("A", "k0", 0, delay_ms=300, partition=0, due=300)
    early = b.send_delayed("A", "k0", 1, delay_ms=300, partition=0, due=301)
    delivered = b.send_delayed("A", "k0", 2, delay_ms=300, partition=0, due=None)
    plain = b.send("A", "k0", 3, ok=(0, offset(4)))
    stored = [
        Stored(0, offset(4), "k0", plain),
        Stored(0, offset(250), "k0", delivered),  # "already delivered": no due time answered
        Stored(0, offset(300), "k0", on_time),  # in the due millisecond
        Stored(0, offset(300, 1), "k0", early),  # a millisecond early
    ]
    violations = checker.delivered_not_early(b.history(), stored)
    assert len(violations) == 1 and early in violations[0] and "1 ms before" in violations[0]


def test_key_order_of_delayed_sends_per_delay() -> None:
    """Same key, same delay: send order. A plain send of the key, or a delayed one with another
    delay, is not ordered against them."""
    b = Builder()
    d1 = b.send_delayed("A", "k0", 0, delay_ms=300, partition=0, due=300)
    plain = b.send("A", "k0", 1, ok=(0, offset(2)))
    d2 = b.send_delayed("A", "k0", 2, delay_ms=300, partition=0, due=302)
    short = b.send_delayed("A", "k0", 3, delay_ms=10, partition=0, due=13)
    stored = [
        Stored(0, offset(2), "k0", plain),
        Stored(0, offset(13), "k0", short),
        Stored(0, offset(300), "k0", d1),
        Stored(0, offset(302), "k0", d2),
    ]
    assert checker.key_order_in_log(b.history(), stored) == []
    swapped = [*stored[:2], Stored(0, offset(302), "k0", d1), Stored(0, offset(300), "k0", d2)]
    violations = checker.key_order_in_log(b.history(), swapped)
    assert len(violations) == 1 and d2 in violations[0] and "delay_ms=300" in violations[0]
