"""Helpers for the transaction tests (tests/transactions/: test_transactions.py,
test_crash_at_every_step.py and the others).

What the tests check is read back through a separate sync broker (`broker.read`, XINFO GROUPS),
never through the producer under test. Three pieces:

- readers: a topic's partitions as stored, the group's committed positions, the transactions
  still in the registry;
- drivers: the same test body runs the thread API (`SyncDriver`: the objects themselves) and
  the asyncio API (`AsyncDriver`: thin sync facades whose calls run on an event loop thread);
- children: a scenario run in a spawned process whose `Scripts.execute` is wrapped, in the
  child only, to SIGKILL (or SIGSTOP) the process right after the n-th call of a given script
  returned (`CrashAt`); no hook in redisq. Children report through a pipe: ("tx", id) when a
  transaction id is known, ("crash", script, n) just before the signal, ("done", ...) at the end.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import redisq
from redisq.model.records import Message
from redisq.protocol import ScriptCall

# Children fork from a server process that imported redisq once (fast, and single-threaded:
# nothing of the test process's threads or connections is inherited).
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload(["tests.txhelp"])


# -- readers ---------------------------------------------------------------------------------------
def partitions_of(broker: redisq.Broker, topic: str) -> dict[int, list[Message]]:
    """Every message of every partition of `topic`, in offset order."""
    config = broker.topic_config(topic, refresh=True)
    return {p: list(broker.read(topic, p)) for p in range(config.partitions)}


def values_of(broker: redisq.Broker, *topics: str) -> list[bytes]:
    """Every value stored in these topics (partition by partition, offset order)."""
    return [m.value for t in topics for ms in partitions_of(broker, t).values() for m in ms]


def registry(broker: redisq.Broker) -> list[str]:
    """Transactions still in the namespace's registry (open, or decided but not carried out)."""
    return [r.decode() for r in broker.client.zrange(broker.keys.transactions(), 0, -1)]


def tx_state(broker: redisq.Broker, tx_id: str) -> str | None:
    """The stored decision of a transaction (None: nothing stored)."""
    state = broker.client.hget(broker.keys.transaction(tx_id), "state")
    return None if state is None else state.decode()


def committed_positions(broker: redisq.Broker, topic: str, group: str) -> dict[int, str]:
    """The group's committed position per partition (XINFO GROUPS last-delivered-id)."""
    positions = {}
    config = broker.topic_config(topic, refresh=True)
    for p in range(config.partitions):
        for info in broker.client.xinfo_groups(broker.keys.log(topic, p)):
            if info["name"].decode() == group:
                positions[p] = info["last-delivered-id"].decode()
    return positions


def assert_exactly_once(
    broker: redisq.Broker, expected: dict[tuple[str, int], list[bytes]], topics: Iterable[str]
) -> None:
    """Each partition of `topics` holds exactly `expected[(topic, p)]` (values, in this order;
    partitions not named hold nothing)."""
    for topic in topics:
        for p, messages in partitions_of(broker, topic).items():
            got = [m.value for m in messages]
            want = expected.get((topic, p), [])
            assert got == want, f"{topic}/{p}: stored {got}, expected {want}"


# -- drivers ---------------------------------------------------------------------------------------
class SyncDriver:
    """The thread API as it is."""

    name = "sync"

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        self.broker = redisq.connect(url, namespace=namespace, **options)

    def producer(self, name: str | None = None, **options: Any) -> Any:
        return self.broker.producer(name, **options)

    def consumer(self, topic: str, group: str, name: str, **options: Any) -> Any:
        return self.broker.consumer(topic, group, name, **options)

    def close(self) -> None:
        self.broker.close()


class AsyncDriver:
    """The asyncio API behind sync facades: each call runs on one event loop thread, so a test
    body reads the same for both APIs and exceptions come out unchanged."""

    name = "async"

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        import redisq.asyncio as rq

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.broker = self.call(rq.connect(url, namespace=namespace, **options))
        self._open: list[Any] = []

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def in_loop(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return self.call(run())

    def producer(self, name: str | None = None, **options: Any) -> Any:
        async def start() -> Any:
            producer = self.broker.producer(name, **options)
            await producer.start()
            return producer

        facade = _AsyncProducer(self, self.call(start()))
        self._open.append(facade)
        return facade

    def consumer(self, topic: str, group: str, name: str, **options: Any) -> Any:
        async def start() -> Any:
            consumer = self.broker.consumer(topic, group, name, **options)
            await consumer.start()
            return consumer

        facade = _AsyncConsumer(self, self.call(start()))
        self._open.append(facade)
        return facade

    def close(self) -> None:
        for facade in reversed(self._open):
            try:
                facade.close()
            except Exception:
                pass
        self.call(self.broker.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class _AsyncConsumer:
    def __init__(self, driver: AsyncDriver, inner: Any) -> None:
        self.d, self.inner = driver, inner

    @property
    def assignment(self) -> Any:
        return self.d.in_loop(lambda: self.inner.assignment)

    def poll(self, timeout: float = 1.0, max_messages: int = 100) -> list[Message]:
        return list(self.d.call(self.inner.poll(timeout, max_messages)))

    def ack(self, messages: Any) -> Any:
        return self.d.call(self.inner.ack(messages))

    def commit(self) -> Any:
        return self.d.call(self.inner.commit())

    def committed(self, partition: int) -> Any:
        return self.d.call(self.inner.committed(partition))

    def pause(self, *partitions: Any) -> None:
        self.d.in_loop(lambda: self.inner.pause(*partitions))

    def resume(self, *partitions: Any) -> None:
        self.d.in_loop(lambda: self.inner.resume(*partitions))

    def paused(self) -> Any:
        return self.d.in_loop(self.inner.paused)

    def close(self) -> None:
        self.d.call(self.inner.close())


class _AsyncProducer:
    def __init__(self, driver: AsyncDriver, inner: Any) -> None:
        self.d, self.inner = driver, inner

    def __enter__(self) -> _AsyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self) -> _AsyncTransaction:
        return _AsyncTransaction(self.d, self.d.in_loop(self.inner.transaction))

    def send_in_transaction(self, *args: Any, **kwargs: Any) -> Any:
        return self.d.call(self.inner.send_in_transaction(*args, **kwargs))

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self.d.call(self.inner.send(*args, **kwargs))

    def close(self) -> None:
        self.d.call(_close_producer(self.inner))


async def _close_producer(producer: Any) -> None:
    """producer.close(), cancelling the transactions' background task again if the first
    cancel was swallowed. WORKAROUND (reported by helper-9, remove once fixed): on Python 3.11
    a cancel that lands while a redis call completes is lost, and Transactions.close() then
    waits for the task forever (reproduction in the helper's report)."""
    closing = asyncio.ensure_future(producer.close())
    while True:
        done, _ = await asyncio.wait([closing], timeout=2)
        if done:
            closing.result()
            return
        transactions = getattr(producer, "_transactions", None)
        task = getattr(transactions, "_task", None)
        if task is None:
            raise AssertionError("the asyncio producer's close() hangs")
        task.cancel()


class _AsyncTransaction:
    def __init__(self, driver: AsyncDriver, inner: Any) -> None:
        self.d, self.inner = driver, inner

    transaction_id = property(lambda self: self.inner.transaction_id)
    state = property(lambda self: self.inner.state)
    records = property(lambda self: self.inner.records)

    def __enter__(self) -> _AsyncTransaction:
        self.d.call(self.inner.__aenter__())
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.d.call(self.inner.__aexit__(*exc))
        return False

    def send(self, *args: Any, **kwargs: Any) -> None:
        self.d.call(self.inner.send(*args, **kwargs))

    def ack(self, consumer: Any, messages: Any) -> None:
        inner = consumer.inner if isinstance(consumer, _AsyncConsumer) else consumer
        self.d.call(self.inner.ack(inner, messages))

    def commit(self) -> Any:
        return self.d.call(self.inner.commit())

    def abort(self) -> None:
        self.d.call(self.inner.abort())


DRIVERS = {"sync": SyncDriver, "async": AsyncDriver}


# -- crashes from outside the library (child processes only) --------------------------------------
@dataclass(frozen=True)
class CrashAt:
    """Signal the process right after the n-th call of `script` was answered (before: right
    before the round trip that carries it is sent), counted over every Scripts.execute of the
    process, pipelined calls included."""

    script: str
    nth: int = 1
    sig: int = signal.SIGKILL
    before: bool = False


def install_crash(crash: CrashAt, conn: Any) -> None:
    """Wrap redisq.server.scripts.Scripts.execute in this process (the test's own monkeypatch)."""
    from redisq.server.scripts import Scripts

    original = Scripts.execute
    depth = threading.local()
    lock = threading.Lock()
    seen = [0]

    def fire() -> None:
        conn.send(("crash", crash.script, crash.nth))
        os.kill(os.getpid(), crash.sig)

    def execute(self: Any, steps: Any) -> Any:
        outermost = getattr(depth, "n", 0) == 0  # a cluster runs a list one by one through here
        hit = False
        if outermost:
            calls = steps if isinstance(steps, list) else [steps]
            hits = sum(1 for c in calls if isinstance(c, ScriptCall) and c.script == crash.script)
            with lock:
                hit = seen[0] < crash.nth <= seen[0] + hits
                seen[0] += hits
            if hit and crash.before:
                fire()
        depth.n = getattr(depth, "n", 0) + 1
        try:
            result = original(self, steps)
        finally:
            depth.n -= 1
        if hit and not crash.before:
            fire()
        return result

    Scripts.execute = execute  # type: ignore[method-assign]


def _connect(url: str, namespace: str, crash: CrashAt | None, conn: Any) -> redisq.Broker:
    if crash is not None:
        install_crash(crash, conn)
    return redisq.connect(url, namespace=namespace)


def kafka_child(url: str, namespace: str, spec: dict[str, Any], conn: Any) -> None:
    """One Kafka-style transaction: spec["sends"] = [(topic, value, key)], producer
    spec["name"] with spec["options"]; reports ("tx", id) at begin and ("done", offsets)."""
    broker = _connect(url, namespace, spec.get("crash"), conn)
    producer = broker.producer(spec["name"], transactional=True, **spec.get("options", {}))
    with producer.transaction() as tx:
        conn.send(("tx", tx.transaction_id))
        for topic, value, key in spec["sends"]:
            tx.send(topic, value, key=key)
    conn.send(("done", [(r.topic, r.partition, r.offset) for r in tx.records]))
    producer.close()


_ANSWERS = {"commit": redisq.TxState.COMMIT, "rollback": redisq.TxState.ROLLBACK}


def _answer(answer: str, conn: Any, what: str, tx_id: str) -> redisq.TxState:
    conn.send((what, tx_id))
    if answer == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return _ANSWERS.get(answer, redisq.TxState.UNKNOWN)


def half_child(url: str, namespace: str, spec: dict[str, Any], conn: Any) -> None:
    """A member of transactional group spec["group"] sends one half message whose local
    transaction answers spec["local"], then stays (running check-back, answering
    spec["check"]: commit, rollback, unknown or kill) for spec["stay_s"]."""
    broker = _connect(url, namespace, spec.get("crash"), conn)
    producer = broker.producer(
        transactional_group=spec["group"],
        check=lambda tx_id, _: _answer(spec["check"], conn, "check", tx_id),
        **spec.get("options", {}),
    )
    result = producer.send_in_transaction(
        spec["topic"],
        spec["value"],
        key=spec.get("key"),
        local=lambda tx_id, _: _answer(spec["local"], conn, "local", tx_id),
    )
    conn.send(("done", result.state.value))
    time.sleep(spec.get("stay_s", 0))
    producer.close()


def transform(member: str, message: Message) -> bytes:
    """The output of the consume-transform-produce loop for an input: its value, prefixed with
    the member that wrote it ("m1:<value>")."""
    return member.encode() + b":" + message.value


def source_of(output: bytes) -> bytes:
    """The input value an output came from."""
    return output.split(b":", 1)[1]


def ctp_child(url: str, namespace: str, spec: dict[str, Any], conn: Any) -> None:
    """Consume-transform-produce: member spec["member"] of group spec["group"] on
    spec["input"] writes transform(message) to spec["output"] (same key) and tx.acks the input,
    spec["batch"] messages per transaction; producer name spec["producer"]. Runs until killed
    (or spec["rounds"] transactions tried). spec["gate"]: wait for a line on the pipe before
    each commit (the test stops the process meanwhile); spec["pause_s"]: sleep that long in
    each transaction before its commit."""
    broker = _connect(url, namespace, spec.get("crash"), conn)
    consumer = broker.consumer(spec["input"], spec["group"], spec["member"], **spec["consumer"])
    producer = broker.producer(spec["producer"], transactional=True, **spec.get("options", {}))
    conn.send(("ready", os.getpid()))
    rounds = 0
    while spec.get("rounds") is None or rounds < spec["rounds"]:
        messages = consumer.poll(timeout=0.2, max_messages=spec["batch"])
        if not messages:
            continue
        rounds += 1
        try:
            with producer.transaction() as tx:
                for m in messages:
                    tx.send(spec["output"], transform(spec["member"], m), key=m.key)
                tx.ack(consumer, messages)
                time.sleep(spec.get("pause_s", 0))  # an open transaction, something staged
                if spec.get("gate"):
                    conn.send(("acked", tx.transaction_id, [m.value for m in messages]))
                    conn.recv()
            conn.send(("committed", tx.transaction_id, [m.value for m in messages]))
        except (redisq.TransactionAborted, redisq.LeaseLost) as exc:
            conn.send(("aborted", type(exc).__name__, str(exc)))
    conn.send(("done", rounds))
    consumer.close()
    producer.close()


class Child:
    """A scenario in a spawned process (see the *_child functions) and its pipe."""

    def __init__(self, target: Callable[..., None], url: str, namespace: str, spec: Any) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.process = SPAWN.Process(target=target, args=(url, namespace, spec, child_conn))
        self.process.start()
        child_conn.close()
        self.events: list[tuple[Any, ...]] = []

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def expect(self, kind: str, timeout: float = 30) -> tuple[Any, ...]:
        """The next event of this kind (earlier ones are kept in `events`)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.conn.poll(remaining):
                raise AssertionError(f"no {kind!r} from the child; events: {self.events}")
            try:
                event = self.conn.recv()
            except EOFError:
                raise AssertionError(
                    f"child ended before {kind!r}; events: {self.events}"
                ) from None
            self.events.append(event)
            if event[0] == kind:
                return tuple(event)

    def drain(self) -> list[tuple[Any, ...]]:
        """Every event sent so far."""
        while self.conn.poll(0):
            try:
                self.events.append(self.conn.recv())
            except EOFError:
                break
        return self.events

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float = 30) -> int | None:
        """The exit code (-N: killed by signal N)."""
        self.process.join(timeout)
        self.drain()
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it has just ended by itself
                pass
        self.process.join(10)
        self.drain()
