"""Transactions under crashes (DESIGN §11, issue 12 item 5): a process killed at every step of a
transaction, from outside the library (tests/txhelp.py: the child's own Scripts.execute is
wrapped to SIGKILL it right after, or right before, the n-th call of a script), then recovered
by whoever comes next: a new instance of the producer's name, the sweeper of any transactional
producer, a consumer taking over an input partition, or another member of the transactional
group running the check-back. Plus: a consume-transform-produce loop SIGKILLed at random and
rebalanced, a member paused (SIGSTOP) past its lease, and the server SIGKILLed and restarted
from its AOF in the middle of a commit.

Every test asserts what a user would: a committed transaction's messages are each stored
exactly once, in send order per partition; an aborted or unresolved one never reaches its
topic; the unresolved topic holds what check-back gave up on; the consume-transform-produce
output holds each input exactly once, in key order.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
import redis

import redisq
from redisq.model.keys import unresolved_topic
from redisq.server.scripts import Scripts
from tests.conftest import wait_until
from tests.servers import ServerProcess, binary_for
from tests.txhelp import (
    Child,
    CrashAt,
    assert_exactly_once,
    committed_positions,
    ctp_child,
    half_child,
    kafka_child,
    partitions_of,
    registry,
    source_of,
    tx_state,
    values_of,
)

pytestmark = pytest.mark.fault

FAST = {"check_interval_ms": 100}  # background duties every 50 ms
LEASE = {"lease_ttl_ms": 1000, "ack_interval_ms": 50}


def kafka_sends(label: str) -> list[tuple[str, bytes, str | None]]:
    """10 keyed messages over out's 4 partitions and 3 unkeyed ones to audit; in batches of two
    they make several roll-forward rounds."""
    sends: list[tuple[str, bytes, str | None]] = [
        ("out", f"{label}:o{i}".encode(), f"k{i % 8}") for i in range(10)
    ]
    return sends + [("audit", f"{label}:a{i}".encode(), None) for i in range(3)]


def layout(sends: list[tuple[str, bytes, str | None]]) -> dict[tuple[str, int], list[bytes]]:
    partitions = {"out": 4, "audit": 1}
    where: dict[tuple[str, int], list[bytes]] = defaultdict(list)
    for topic, value, key in sends:
        p = 0 if key is None else redisq.partition_for_key(key.encode(), partitions[topic])
        where[(topic, p)].append(value)
    return dict(where)


def crashed(child: Child, crash: CrashAt) -> None:
    """The child died of the planned signal, at the planned call."""
    assert child.wait(30) == -crash.sig, child.events
    assert ("crash", crash.script, crash.nth) in child.events, child.events


# -- Kafka style: a producer killed at every step -------------------------------------------------

KAFKA_POINTS = {
    # crash: what was decided when the producer died
    "after-first-stage": (CrashAt("tx_stage", 1), "aborted"),
    "before-decide": (CrashAt("tx_decide", 1, before=True), "aborted"),
    "after-decide": (CrashAt("tx_decide", 1), "committed"),
    "after-first-apply": (CrashAt("tx_apply", 1), "committed"),
    # 10 batches in 3 rounds (5, 4, 1): standalone pipelines a round, a cluster sends each alone
    "after-sixth-apply": (CrashAt("tx_apply", 6), "committed"),
}


KAFKA_CASES = [("new-instance", point) for point in sorted(KAFKA_POINTS)] + [
    ("sweeper", point) for point in ("after-first-stage", "after-decide", "after-sixth-apply")
]


@pytest.mark.parametrize(("recovery", "point"), KAFKA_CASES)
def test_kafka_crash_at_every_step(
    broker: redisq.Broker, server_url: str, point: str, recovery: str
) -> None:
    """Producer "x" is SIGKILLed at a step of a 13-message transaction over two topics and five
    partitions. new-instance: the next instance of "x" completes (committed) or aborts (open)
    it before its constructor returns. sweeper: another transactional producer's background
    thread does it once the transaction's timeout has passed. Then the name works on."""
    crash, outcome = KAFKA_POINTS[point]
    broker.create_topic("out", partitions=4)
    broker.create_topic("audit", partitions=1)
    sends = kafka_sends("x")
    options = {"max_batch_messages": 2, "transaction_timeout_ms": 1000}
    spec = {"name": "x", "options": options, "sends": sends, "crash": crash}
    child = Child(kafka_child, server_url, broker.namespace, spec)
    _, tx_id = child.expect("tx")
    crashed(child, crash)
    assert tx_state(broker, tx_id) == ("open" if outcome == "aborted" else "committed")

    if recovery == "new-instance":
        successor = broker.producer("x", transactional=True)
    else:
        successor = broker.producer("sweeper", transactional=True, **FAST)
        wait_until(lambda: registry(broker) == [], 15, "the sweeper")
    assert tx_state(broker, tx_id) == outcome
    expected = layout(sends) if outcome == "committed" else {}
    assert_exactly_once(broker, expected, ["out", "audit"])
    assert registry(broker) == []

    with successor.transaction() as tx:  # the name (or the sweeper's) works on
        tx.send("out", b"after", key="k0")
    successor.close()
    p = redisq.partition_for_key(b"k0", 4)
    assert_exactly_once(
        broker, {**expected, ("out", p): [*expected.get(("out", p), []), b"after"]}, ["out"]
    )


def test_kafka_crash_after_apply_recovered_long_after_the_dedup_window(
    broker: redisq.Broker, server_url: str
) -> None:
    """The roll-forward's marks do not depend on the topics' dedup window: "x" is SIGKILLed
    after its first batch was appended, the topics remember message ids for 1 s only, and the
    next instance comes more than two windows later: it completes the transaction, and every
    message is stored once."""
    broker.create_topic("out", partitions=4, dedup_window_ms=1000)
    broker.create_topic("audit", partitions=1, dedup_window_ms=1000)
    sends = kafka_sends("x")
    crash = CrashAt("tx_apply", 1)
    options = {"max_batch_messages": 2, "transaction_timeout_ms": 1000}
    child = Child(
        kafka_child,
        server_url,
        broker.namespace,
        {"name": "x", "options": options, "sends": sends, "crash": crash},
    )
    _, tx_id = child.expect("tx")
    crashed(child, crash)
    time.sleep(2.5)  # both slices of the dedup ring have passed
    successor = broker.producer("x", transactional=True)
    assert tx_state(broker, tx_id) == "committed" and registry(broker) == []
    assert_exactly_once(broker, layout(sends), ["out", "audit"])
    successor.close()


# -- consume-transform-produce: killed at every step, the input taken over ------------------------

CTP_POINTS = {
    "after-hold": (CrashAt("tx_hold", 1), False),  # (crash, the child's batch committed)
    "after-decide": (CrashAt("tx_decide", 1), True),
    "after-first-apply": (CrashAt("tx_apply", 1), True),
    "after-position": (CrashAt("tx_position", 1), True),
}


def _inputs(broker: redisq.Broker, count: int, keys: int = 8) -> list[bytes]:
    """count input messages "k<k>:<n>" (n counts per key), keys k0..k<keys-1>."""
    values = []
    with broker.producer() as producer:
        for i in range(count):
            value = f"k{i % keys}:{i // keys}".encode()
            producer.send("in", value, key=f"k{i % keys}")
            values.append(value)
    return values


def _ctp_spec(member: str, **extra: Any) -> dict[str, Any]:
    return {
        "member": member,
        "producer": f"xf-{member}",
        "group": "xf",
        "input": "in",
        "output": "out",
        "batch": 6,
        "consumer": LEASE,
        "options": {"transaction_timeout_ms": 2000},
        **extra,
    }


def _transform_all(consumer: Any, producer: Any, label: bytes, want: int, broker: Any) -> list:
    """Run the loop in this process until the output holds `want` messages; what it handled."""
    handled = []
    deadline = time.monotonic() + 30
    while len(values_of(broker, "out")) < want:
        assert time.monotonic() < deadline, f"output stuck at {len(values_of(broker, 'out'))}"
        batch = consumer.poll(timeout=0.2, max_messages=6)
        if not batch:
            continue
        with producer.transaction() as tx:
            for m in batch:
                tx.send("out", label + b":" + m.value, key=m.key)
            tx.ack(consumer, batch)
        handled += [m.value for m in batch]
    return handled


def assert_output_exactly_once(broker: redisq.Broker, inputs: list[bytes]) -> None:
    """Each input in the output once; per key, in input order."""
    per_partition = partitions_of(broker, "out")
    sources = [source_of(m.value) for ms in per_partition.values() for m in ms]
    assert Counter(sources) == Counter(inputs), sorted(Counter(sources) - Counter(inputs))
    for messages in per_partition.values():
        order: dict[str, list[int]] = defaultdict(list)
        for m in messages:
            key, n = source_of(m.value).decode().split(":")
            order[key].append(int(n))
        for key, ns in order.items():
            assert ns == sorted(ns), f"key {key} out of order: {ns}"


@pytest.mark.parametrize("point", sorted(CTP_POINTS))
def test_ctp_crash_at_every_step_input_taken_over(
    broker: redisq.Broker, server_url: str, point: str
) -> None:
    """Member m1 polls 6 inputs, transforms them in a transaction with tx.ack and is SIGKILLed
    at a step of its commit. The heir (another member, after m1's lease ran out) settles m1's
    transaction when it is granted the partition: an open one is aborted and the heir handles
    those inputs again; a committed one is rolled forward and its position applied, and the
    heir goes on after it. The output holds each input exactly once, in key order."""
    crash, committed = CTP_POINTS[point]
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    inputs = _inputs(broker, 16)
    child = Child(ctp_child, server_url, broker.namespace, _ctp_spec("m1", crash=crash))
    crashed(child, crash)

    heir = broker.consumer("in", "xf", "heir", **LEASE)
    producer = broker.producer("xf-heir", transactional=True)
    handled = _transform_all(heir, producer, b"heir", len(inputs), broker)
    heir.close()
    producer.close()
    assert_output_exactly_once(broker, inputs)
    by_m1 = [source_of(v) for v in values_of(broker, "out") if v.startswith(b"m1:")]
    assert len(by_m1) == (6 if committed else 0)
    assert Counter(handled) == Counter(inputs) - Counter(by_m1)  # nothing handled twice
    # m1's transaction may still be listed (its position was applied, so the heir had nothing
    # to settle): the name's next instance finishes it, and nothing changes in the output
    broker.producer("xf-m1", transactional=True).close()
    assert registry(broker) == []
    assert_output_exactly_once(broker, inputs)


def test_ctp_new_producer_instance_applies_the_position(
    broker: redisq.Broker, server_url: str
) -> None:
    """m1 dies right after deciding "committed"; the next instance of its producer name rolls
    the transaction forward and applies its input position before its constructor returns;
    m1 restarted (same member, same producer name) goes on after those inputs."""
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    inputs = _inputs(broker, 16)
    crash = CrashAt("tx_decide", 1)
    child = Child(ctp_child, server_url, broker.namespace, _ctp_spec("m1", crash=crash))
    crashed(child, crash)
    assert values_of(broker, "out") == []
    broker.producer("xf-m1", transactional=True).close()
    done = {source_of(v) for v in values_of(broker, "out")}
    assert len(done) == 6
    positions = committed_positions(broker, "in", "xf")
    for p in range(2):
        before = {m.value for m in broker.read("in", p, end=positions.get(p, "0-0"))}
        assert before == {source_of(m.value) for m in broker.read("out", p)} & before
        assert before <= done
    assert sum(len(list(broker.read("in", p, end=positions[p]))) for p in positions) == 6
    ends = {p: list(broker.read("in", p))[-1].offset for p in range(2)}
    restarted = Child(ctp_child, server_url, broker.namespace, _ctp_spec("m1"))
    try:
        consumed = lambda: committed_positions(broker, "in", "xf") == ends  # noqa: E731
        wait_until(consumed, 30, "every input consumed")
    finally:
        restarted.kill()
    assert_output_exactly_once(broker, inputs)


def test_ctp_paused_member_cannot_commit_after_its_hold(
    broker: redisq.Broker, server_url: str
) -> None:
    """m1 is SIGSTOPped right after holding its input partitions for its commit (tx_hold), past
    its lease; the heir is granted the partitions, aborts m1's open transaction and handles
    the inputs. SIGCONT: m1's commit fails with TransactionAborted; none of m1's output ever
    appears."""
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    inputs = _inputs(broker, 16)
    crash = CrashAt("tx_hold", 1, signal.SIGSTOP)
    spec = _ctp_spec("m1", crash=crash, rounds=1)
    child = Child(ctp_child, server_url, broker.namespace, spec)
    try:
        child.expect("crash")
        heir = broker.consumer("in", "xf", "heir", **LEASE)
        producer = broker.producer("xf-heir", transactional=True)
        _transform_all(heir, producer, b"heir", len(inputs), broker)
        child.signal(signal.SIGCONT)
        event = child.expect("aborted")
        assert event[1] == "TransactionAborted", event
        child.expect("done")
        heir.close()
        producer.close()
    finally:
        child.kill()
    assert not [v for v in values_of(broker, "out") if v.startswith(b"m1:")]
    assert_output_exactly_once(broker, inputs)


def test_ctp_paused_member_cannot_commit_after_the_partition_moved(
    broker: redisq.Broker, server_url: str
) -> None:
    """m1 has transformed and tx.acked a batch when it is SIGSTOPped past its lease; the heir
    takes the partitions over and handles the inputs. SIGCONT, then m1 commits: refused
    (TransactionAborted), and none of its output appears."""
    broker.create_topic("in", partitions=2)
    broker.create_topic("out", partitions=2)
    inputs = _inputs(broker, 16)
    child = Child(ctp_child, server_url, broker.namespace, _ctp_spec("m1", gate=True, rounds=1))
    try:
        child.expect("acked")
        child.signal(signal.SIGSTOP)
        heir = broker.consumer("in", "xf", "heir", **LEASE)
        producer = broker.producer("xf-heir", transactional=True)
        _transform_all(heir, producer, b"heir", len(inputs), broker)
        child.signal(signal.SIGCONT)
        child.send("go")
        event = child.expect("aborted")
        assert event[1] == "TransactionAborted", event
        heir.close()
        producer.close()
    finally:
        child.kill()
    assert not [v for v in values_of(broker, "out") if v.startswith(b"m1:")]
    assert_output_exactly_once(broker, inputs)


def test_ctp_sigkill_and_rebalance_exactly_once(broker: redisq.Broker, server_url: str) -> None:
    """Consume-transform-produce in member processes SIGKILLed at random moments (mostly with
    a transaction open and part of it staged) and restarted (same member, same producer name),
    with a second member joining half way (a rebalance) and killed too: in the end the output
    holds each of the 300 inputs exactly once, in key order."""
    _ctp_soak(broker, server_url, inputs=300, kills=4, seed=12)


@pytest.mark.soak
def test_ctp_sigkill_and_rebalance_soak(broker: redisq.Broker, server_url: str) -> None:
    _ctp_soak(broker, server_url, inputs=1500, kills=20, seed=None)


def _ctp_soak(
    broker: redisq.Broker, server_url: str, *, inputs: int, kills: int, seed: int | None
) -> None:
    rng = random.Random(seed)
    broker.create_topic("in", partitions=4)
    broker.create_topic("out", partitions=4)
    values = _inputs(broker, inputs, keys=12)
    ends = {p: list(broker.read("in", p))[-1].offset for p in range(4)}

    def consumed() -> bool:
        return committed_positions(broker, "in", "xf") == ends

    def start(member: str) -> Child:
        spec = _ctp_spec(member, batch=5, pause_s=0.1, options={"max_batch_messages": 2})
        return Child(ctp_child, server_url, broker.namespace, spec)

    members = {"m1": start("m1")}
    killed = 0
    try:
        for kill in range(kills):
            if kill == kills // 2:
                members["m2"] = start("m2")
            victim = rng.choice(sorted(members))
            wait_until(lambda: _committed(members[victim]) or consumed(), 30, "progress")  # noqa: B023
            if consumed():
                break
            time.sleep(rng.uniform(0.0, 0.3))
            members[victim].kill()
            killed += 1
            members[victim] = start(victim)
        wait_until(consumed, 60, "every input consumed")
    finally:
        for child in members.values():
            child.kill()
    assert killed >= kills // 2, f"only {killed} kills landed while there was work"
    assert_output_exactly_once(broker, values)


def _committed(child: Child) -> bool:
    """The child has committed a transaction since it started."""
    return any(event[0] == "committed" for event in child.drain())


# -- RocketMQ style: half messages, their producer killed, check-back by another member -----------

GROUP = {"check_first_ms": 300, "check_interval_ms": 100, "transaction_timeout_ms": 1000}


class Check:
    def __init__(self, answer: redisq.TxState) -> None:
        self.answer = answer
        self.calls: list[str] = []

    def __call__(self, tx_id: str, messages: list[redisq.TxMessage]) -> redisq.TxState:
        self.calls.append(tx_id)
        return self.answer


def _half_spec(
    local: str, check: str, crash: CrashAt | None, group: str = "svc", topic: str = "orders",
    **options: Any,
) -> dict[str, Any]:  # fmt: skip
    return {
        "group": group,
        "topic": topic,
        "value": b"created",
        "key": "order-42",
        "local": local,
        "check": check,
        "crash": crash,
        "stay_s": 30,
        "options": {**GROUP, **options},
    }


def _outcome_of(
    broker: redisq.Broker, outcome: str, group: str = "svc", topic: str = "orders"
) -> None:
    """committed: in its topic once; aborted: nowhere; unresolved: in the group's unresolved
    topic once, never in its topic."""
    p = redisq.partition_for_key(b"order-42", 2)
    moved = unresolved_topic(group)
    if outcome == "committed":
        assert_exactly_once(broker, {(topic, p): [b"created"]}, [topic])
    else:
        assert_exactly_once(broker, {}, [topic])
    if outcome == "unresolved":
        [message] = partitions_of(broker, moved)[0]
        assert (message.value, message.headers["redisq.topic"]) == (b"created", topic.encode())
    else:
        assert moved not in broker.list_topics()


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [(redisq.TxState.COMMIT, "committed"), (redisq.TxState.ROLLBACK, "aborted"),
     (redisq.TxState.UNKNOWN, "unresolved")],
    ids=["commit", "rollback", "unknown"],
)  # fmt: skip
def test_half_message_producer_killed_before_local(
    broker: redisq.Broker, server_url: str, answer: redisq.TxState, outcome: str
) -> None:
    """A dies right after staging its half message (before its local transaction ran). B, a
    live member of the group, checks back and carries out its answer (UNKNOWN twice: the
    message goes to the unresolved topic)."""
    broker.create_topic("orders", partitions=2)
    crash = CrashAt("tx_stage", 1)
    child = Child(half_child, server_url, broker.namespace, _half_spec("commit", "commit", crash))
    crashed(child, crash)
    check = Check(answer)
    with broker.producer(transactional_group="svc", check=check, max_checks=2, **GROUP):
        wait_until(lambda: registry(broker) == [], 20, "B's check-back")
    assert len(check.calls) == (2 if outcome == "unresolved" else 1)
    _outcome_of(broker, outcome)


@pytest.mark.parametrize(
    "crash", [CrashAt("tx_decide", 1), CrashAt("tx_apply", 1)], ids=["after-decide", "after-apply"]
)
def test_half_message_committed_then_producer_killed(
    broker: redisq.Broker, server_url: str, crash: CrashAt
) -> None:
    """A's local transaction answered COMMIT and A died after the decision (or in the roll
    forward): B completes it without asking its check (which would roll back): once."""
    broker.create_topic("orders", partitions=2)
    child = Child(half_child, server_url, broker.namespace, _half_spec("commit", "commit", crash))
    crashed(child, crash)
    check = Check(redisq.TxState.ROLLBACK)
    with broker.producer(transactional_group="svc", check=check, **GROUP):
        wait_until(lambda: registry(broker) == [], 20, "B to carry out the commit")
    assert check.calls == []
    _outcome_of(broker, "committed")


COMMIT, ROLLBACK = redisq.TxState.COMMIT, redisq.TxState.ROLLBACK
CHECKER_POINTS = {
    # A is the group's checker; (A's check answer, crash, B's answer, outcome)
    "killed-in-check": ("kill", None, COMMIT, "committed"),
    "killed-after-commit": ("commit", CrashAt("tx_decide", 1), ROLLBACK, "committed"),
    "killed-after-giving-up": ("unknown", CrashAt("tx_decide", 1), COMMIT, "unresolved"),
}


@pytest.mark.parametrize(  # a lease wait each: the one-node cluster adds nothing to the three
    "backend", ["valkey", "redis", pytest.param("valkey-cluster3", marks=pytest.mark.cluster)]
)
def test_check_back_killed(broker: redisq.Broker, server_url: str) -> None:
    """A's local transaction answered UNKNOWN, so A's check-back asks A's check; A dies in
    the check, or right after the check-back's decision (commit, or giving up). B takes the
    checker's duty over once A's lease on it ran out: it asks its own check only if nothing
    was decided, and otherwise carries out A's decision, whatever B would answer. (The three
    cases run side by side, one transactional group each, to wait for the leases once.)"""
    children, checks = {}, {}
    for i, (point, (a_answer, crash, b_answer, _)) in enumerate(sorted(CHECKER_POINTS.items())):
        broker.create_topic(f"orders{i}", partitions=2)
        spec = _half_spec("unknown", a_answer, crash, f"svc{i}", f"orders{i}", max_checks=1)
        children[point] = Child(half_child, server_url, broker.namespace, spec)
        checks[point] = Check(b_answer)
    for child in children.values():
        child.expect("check", 20)
        assert child.wait(30) == -signal.SIGKILL, child.events
    members = [
        broker.producer(transactional_group=f"svc{i}", check=checks[point], **GROUP)
        for i, point in enumerate(sorted(CHECKER_POINTS))
    ]
    wait_until(lambda: registry(broker) == [], 20, "B's check-back")
    for member in members:
        member.close()
    for i, (point, (_, crash, _, outcome)) in enumerate(sorted(CHECKER_POINTS.items())):
        assert len(checks[point].calls) == (1 if crash is None else 0), point
        _outcome_of(broker, outcome, f"svc{i}", f"orders{i}")


# -- the server SIGKILLed and restarted from its AOF in the middle of a commit --------------------


@pytest.mark.parametrize(
    "crash", [CrashAt("tx_decide", 1), CrashAt("tx_apply", 2)], ids=["after-decide", "mid-apply"]
)
@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_server_killed_mid_commit_restarts_from_aof(
    kind: str, crash: CrashAt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """appendfsync always; the server is SIGKILLed right after it answered a step of the
    commit, and restarted on the same port from its AOF while the producer retries. The
    commit returns, and every message is stored once, in order, where records say."""
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    restarts: list[threading.Thread] = []
    original = Scripts.execute
    seen = [0]

    def execute(self: Any, steps: Any) -> Any:
        result = original(self, steps)
        calls = steps if isinstance(steps, list) else [steps]
        before = seen[0]
        seen[0] += sum(1 for c in calls if getattr(c, "script", None) == crash.script)
        if before < crash.nth <= seen[0]:
            server.kill()
            restarts.append(threading.Thread(target=_restart_later, args=(server,)))
            restarts[-1].start()
        return result

    try:
        with redisq.connect(server.url, namespace="aof") as broker:
            broker.create_topic("out", partitions=4)
            broker.create_topic("audit", partitions=1)
            sends = kafka_sends("aof")
            monkeypatch.setattr(Scripts, "execute", execute)
            with broker.producer("x", transactional=True, max_batch_messages=2) as producer:
                with producer.transaction() as tx:
                    for topic, value, key in sends:
                        tx.send(topic, value, key=key)
            monkeypatch.undo()
            assert restarts, "the server was never killed"
            restarts[0].join(30)
            assert_exactly_once(broker, layout(sends), ["out", "audit"])
            for record, (topic, value, _) in zip(tx.records, sends, strict=True):
                [stored] = list(broker.read(topic, record.partition, start=record.offset, count=1))
                assert stored.value == value
            assert registry(broker) == []
    finally:
        for thread in restarts:
            thread.join(30)
        server.stop()


def _restart_later(server: ServerProcess) -> None:
    time.sleep(0.3)  # the producer meets a dead server at least once
    server.start()


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_server_killed_at_random_under_transactions(kind: str) -> None:
    """Transactions of 13 messages in a loop while the server is SIGKILLed twice at random
    moments and restarted from its AOF (appendfsync always): every transaction whose commit
    returned is stored whole, once; no transaction is stored in part."""
    server = ServerProcess(
        binary_for(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    committed: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        with redisq.connect(server.url, namespace="aof") as broker:
            producer = broker.producer("x", transactional=True, max_batch_messages=2)
            n = 0
            while not stop.is_set():
                label = f"t{n}"
                n += 1
                try:
                    with producer.transaction() as tx:
                        for topic, value, key in kafka_sends(label):
                            tx.send(topic, value, key=key)
                    committed.append(label)
                except (redisq.RedisqError, redis.RedisError):
                    failed.append(label)
            producer.close()

    try:
        with redisq.connect(server.url, namespace="aof") as broker:
            broker.create_topic("out", partitions=4)
            broker.create_topic("audit", partitions=1)
        worker = threading.Thread(target=loop)
        worker.start()
        rng = random.Random(5)
        for _ in range(2):
            at = len(committed) + 3
            wait_until(lambda: len(committed) >= at, 30, "transactions")  # noqa: B023
            time.sleep(rng.uniform(0, 0.05))
            server.kill()
            time.sleep(0.2)
            server.start()
        at = len(committed) + 3
        wait_until(lambda: len(committed) >= at, 30, "transactions after the restarts")
        stop.set()
        worker.join(60)
        with redisq.connect(server.url, namespace="aof") as broker:
            with broker.producer("x", transactional=True):
                pass  # a new instance settles whatever the last one left
            stored = Counter(values_of(broker, "out", "audit"))
        by_label: dict[str, int] = Counter(v.split(b":")[0].decode() for v in stored)
        assert all(n == 1 for n in stored.values()), [v for v, n in stored.items() if n > 1]
        assert all(by_label.get(label) == 13 for label in committed), by_label
        assert all(n == 13 for n in by_label.values()), by_label
        assert not failed or all(by_label.get(label, 0) in (0, 13) for label in failed)
    finally:
        stop.set()
        server.stop()
