"""Misuse of a producer, and bad input around it, fails with a typed error and changes nothing.

A closed producer (thread or asyncio, started or not) refuses every entry point, takes no new
identity (so the live instance of its name is not fenced) and writes nothing; a transaction
left open by close() is aborted. A bad timeout is refused before the message is queued. A url
whose password holds an unencoded '/', '?' or '#' is refused naming only the redacted url.
A done-callback added while the sender finishes the batch runs once.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

import redisq
import redisq.asyncio as rq
from redisq.model.records import RecordMetadata
from redisq.produce.futures import SendFuture, Waiter, finished
from redisq.server.connection import redact_url
from tests.aio import Env, aio
from tests.marks import ONE_BACKEND


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    """Standalone servers only: nothing here depends on where a partition lives."""
    return str(request.param)


def stored(broker: redisq.Broker, topic: str = "t") -> list[bytes]:
    partitions = broker.describe_topic(topic).config.partitions
    return [m.value for p in range(partitions) for m in broker.read(topic, p)]


def commit(_tx_id: str, _messages: Any) -> redisq.TxState:
    return redisq.TxState.COMMIT


# -- 1, 2: a closed producer ---------------------------------------------------------------------


def test_closed_thread_producer_refuses_everything(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=2)
    producer = broker.producer(name="svc")
    producer.send("t", b"before", key="k")
    producer.close()
    epoch = producer.epoch
    with pytest.raises(redisq.ProducerClosed):
        producer.send("t", b"late", key="k")
    with pytest.raises(redisq.ProducerClosed):
        producer.send_async("t", b"late", key="k")
    with pytest.raises(redisq.ProducerClosed):
        producer.send("t", b"late", key="k", delay_ms=10)
    with pytest.raises(redisq.ProducerClosed):
        producer.send_async("t", b"late", key="k", delay_ms=10)
    producer.flush()  # nothing is buffered: returns at once
    producer.close()  # idempotent
    assert producer.epoch == epoch
    assert stored(broker) == [b"before"]


def test_closed_transactional_thread_producers_write_nothing(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    kafka = broker.producer(name="txp", transactional=True)
    kafka.close()
    with pytest.raises(redisq.ProducerClosed):
        kafka.transaction()
    rocket = broker.producer(transactional_group="tg", check=commit)
    rocket.close()
    with pytest.raises(redisq.ProducerClosed):
        rocket.send_in_transaction("t", b"half", local=commit)
    assert stored(broker) == []


def test_thread_close_aborts_the_open_transaction(broker: redisq.Broker) -> None:
    broker.create_topic("t", partitions=1)
    producer = broker.producer(name="txp", transactional=True)
    tx = producer.transaction()
    tx.send("t", b"staged", key="k")
    tx._stage()  # on the server, so that the abort has something to undo
    producer.close()
    assert tx.state == "aborted"
    with pytest.raises(redisq.TransactionAborted):
        tx.commit()
    assert stored(broker) == []


@aio
async def test_asyncio_producer_closed_before_start_takes_no_identity(env: Env) -> None:
    """The repro: an instance closed before it started must not take a new epoch on send()
    (fencing the live instance of its name) nor leave a sender task running."""
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        live = broker.producer(name="svc")
        await live.send("t", b"first", key="k")
        zombie = broker.producer(name="svc")
        await zombie.close()
        with pytest.raises(redisq.ProducerClosed):
            await zombie.send("t", b"x", key="k")
        with pytest.raises(redisq.ProducerClosed):
            zombie.send_async("t", b"x", key="k")
        with pytest.raises(redisq.ProducerClosed):
            await zombie.send("t", b"x", key="k", delay_ms=10)
        with pytest.raises(redisq.ProducerClosed):
            await zombie.start()
        with pytest.raises(redisq.ProducerClosed):
            async with zombie:
                pass
        await zombie.flush()  # nothing buffered
        assert zombie.identity is None and zombie._sender is None
        await live.send("t", b"second", key="k")  # not fenced
        await live.close()
    assert stored(env.sync) == [b"first", b"second"]


@aio
async def test_closed_transactional_asyncio_producers_write_nothing(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        for started in (True, False):
            kafka = broker.producer(name=f"txp{started}", transactional=True)
            if started:
                await kafka.start()
            await kafka.close()
            with pytest.raises(redisq.ProducerClosed):
                kafka.transaction()
            rocket = broker.producer(transactional_group=f"tg{started}", check=commit)
            if started:
                await rocket.start()
            await rocket.close()
            with pytest.raises(redisq.ProducerClosed):
                await rocket.send_in_transaction("t", b"half", local=commit)
            assert rocket._sender is None or rocket._sender.done()
    assert stored(env.sync) == []


@aio
async def test_asyncio_close_aborts_or_refuses_the_open_transaction(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        producer = broker.producer(name="txp", transactional=True)
        tx = producer.transaction()
        await tx.send("t", b"staged", key="k")
        await tx._stage()
        await producer.close()
        assert tx.state == "aborted"
        with pytest.raises(redisq.TransactionAborted):
            await tx.commit()
        # Begun on an instance that never started: after close() it cannot start it either.
        live = broker.producer(name="other", transactional=True)
        async with live.transaction() as live_tx:
            await live_tx.send("t", b"live", key="k")
        unstarted = broker.producer(name="other", transactional=True)
        stale = unstarted.transaction()
        await unstarted.close()
        with pytest.raises(redisq.ProducerClosed):
            await stale.send("t", b"stale", key="k")
        with pytest.raises(redisq.ProducerClosed):
            await stale.commit()
        assert unstarted.identity is None
        async with live.transaction() as live_tx:  # not fenced
            await live_tx.send("t", b"live2", key="k")
        await live.close()
    assert stored(env.sync) == [b"live", b"live2"]


# -- 3: timeouts ---------------------------------------------------------------------------------

BAD_TIMEOUTS = [
    ("1", TypeError),
    ([1], TypeError),
    (True, TypeError),
    (-1, redisq.InvalidConfig),
    (-0.5, redisq.InvalidConfig),
    (math.nan, redisq.InvalidConfig),
    (math.inf, redisq.InvalidConfig),
]


@ONE_BACKEND
@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS, ids=repr)
def test_bad_send_timeout_queues_nothing(
    broker: redisq.Broker, timeout: object, error: type[Exception]
) -> None:
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        with pytest.raises(error, match="timeout"):
            producer.send("t", b"x", key="k", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(error, match="timeout"):
            producer.send("t", b"x", key="k", timeout=timeout, delay_ms=10)  # type: ignore[arg-type]
        with pytest.raises(error, match="timeout"):
            producer.flush(timeout)  # type: ignore[arg-type]
        with pytest.raises(error, match="timeout"):
            producer.close(timeout)  # type: ignore[arg-type]
        future = producer.send_async("t", b"ok", key="k")
        with pytest.raises(error, match="timeout"):
            future.result(timeout)  # type: ignore[arg-type]
        with pytest.raises(error, match="timeout"):
            future.exception(timeout)  # type: ignore[arg-type]
        assert future.result(10).offset is not None  # still open after the refused close()
        assert producer.send("t", b"ok2", key="k", timeout=0.0 + 10).offset is not None
    assert stored(broker) == [b"ok", b"ok2"]


@aio
async def test_bad_asyncio_timeouts_refused(env: Env) -> None:
    async with env.connect() as broker:
        await broker.create_topic("t", partitions=1)
        producer = broker.producer()
        future = producer.send_async("t", b"ok", key="k")
        for timeout, error in BAD_TIMEOUTS:
            with pytest.raises(error, match="timeout"):
                await producer.flush(timeout)  # type: ignore[arg-type]
            with pytest.raises(error, match="timeout"):
                await producer.close(timeout)  # type: ignore[arg-type]
        await producer.send("t", b"ok2", key="k")  # not closed by the refused close()
        await producer.close(10)
        assert (await future).offset is not None
    assert stored(env.sync) == [b"ok", b"ok2"]


# -- 4: passwords in urls ------------------------------------------------------------------------

SLASHED = [
    ("redis://:Ab/Cd+ef==@127.0.0.1:1/0", "Ab/Cd+ef=="),
    ("redis://:Ab?Cdef@127.0.0.1:1/0", "Ab?Cdef"),
    ("redis://:Ab#Cdef@127.0.0.1:1/0", "Ab#Cdef"),
    ("redis://user:Ab/Cdef@127.0.0.1:1/0", "Ab/Cdef"),
    ("rediss://user:pQ@sZ/wY?rdK#xJ@127.0.0.1:1/0", "pQ@sZ/wY?rdK#xJ"),
    ("redis+cluster://:Ab/Cdef@127.0.0.1:1", "Ab/Cdef"),
    ("redis+sentinel://:Ab/Cdef@127.0.0.1:1/mymaster", "Ab/Cdef"),
    ("redis+sentinel://u:Ab?Cdef@127.0.0.1:1/mymaster", "Ab?Cdef"),
    ("unix://:Ab/Cdef@/tmp/redis.sock", "Ab/Cdef"),
]


def pieces(password: str) -> list[str]:
    """The password and every run of 2+ characters between its '/', '?', '#' and '@'."""
    runs = password.replace("?", "/").replace("#", "/").replace("@", "/").split("/")
    return [password] + [run for run in runs if len(run) >= 2]


def assert_hidden(error: BaseException, password: str) -> None:
    chain: list[object] = []
    current: BaseException | None = error
    while current is not None:
        chain += [str(current), repr(current), current.args]
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    for text in chain:
        for piece in pieces(password):
            assert piece not in str(text), f"{piece!r} leaked in {text!r}"


@pytest.mark.parametrize(("url", "password"), SLASHED)
def test_unencoded_password_never_shows(url: str, password: str) -> None:
    redacted = redact_url(url)
    assert "***" in redacted
    for piece in pieces(password):
        assert piece not in redacted
    with pytest.raises(redisq.InvalidConfig) as caught:
        redisq.connect(url, namespace="never", socket_connect_timeout=1)
    assert_hidden(caught.value, password)
    assert redacted in str(caught.value)

    async def connect() -> None:
        await rq.connect(url, namespace="never", socket_connect_timeout=1)

    with pytest.raises(redisq.InvalidConfig) as caught:
        aio(connect)()
    assert_hidden(caught.value, password)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///tmp/redis.sock?db=1", "unix:///tmp/redis.sock?db=1"),
        ("unix:///run/user@1/redis.sock", "unix:///run/user@1/redis.sock"),
        ("unix://:pw@/tmp/redis.sock", "unix://:***@/tmp/redis.sock"),
        ("redis://h:1/0?password=se&cret&db=2", "redis://h:1/0?password=***&db=2"),
        ("redis://h:1/0?client_name=c&password=s#x", "redis://h:1/0?client_name=c&password=***"),
        ("host:6379", "host:6379"),
        ("u:pw@host:6379", "u:***@host:6379"),
    ],
)
def test_redact_url_shapes(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_a_sentinel_url_with_a_port_that_is_not_a_number_is_invalid_config() -> None:
    with pytest.raises(redisq.InvalidConfig, match="port"):
        redisq.connect("redis+sentinel://127.0.0.1:notaport/mymaster", namespace="never")


def test_an_at_in_the_query_of_a_plain_url_is_accepted() -> None:
    from redisq.server.connection import url_kind

    url = "redis://127.0.0.1:1/0?client_name=a@b"
    assert url_kind(url) == ("plain", url)


# -- 5: add_done_callback racing the sender ------------------------------------------------------


class _Batch:
    def __init__(self) -> None:
        self.waiter = Waiter()
        self.error: BaseException | None = None

    def metadata(self, index: int) -> RecordMetadata:
        return RecordMetadata("t", 0, str(index))


class _FinishesWhileChecked(threading.Event):
    """An event whose first is_set() answers "not yet" and then lets the sender thread finish
    the batch before returning: the interleaving that lost a callback. Where finished() waits
    for the callback lock that add_done_callback holds, it finishes once the lock is free."""

    def __init__(self, batch: _Batch) -> None:
        super().__init__()
        self.batch = batch
        self.sender: threading.Thread | None = None

    def is_set(self) -> bool:
        answer = super().is_set()
        if self.sender is None:
            self.sender = threading.Thread(target=finished, args=(self.batch,))
            self.sender.start()
            self.sender.join(1.0)  # returns early only if finished() did not wait for the lock
        return answer


def test_done_callback_added_while_the_batch_finishes_runs_once() -> None:
    batch = _Batch()
    event = _FinishesWhileChecked(batch)
    batch.waiter.event = event
    calls: list[SendFuture] = []
    SendFuture(batch, 3).add_done_callback(calls.append)
    assert event.sender is not None
    event.sender.join(10)
    assert not event.sender.is_alive()
    assert [future.result(0).offset for future in calls] == ["3"]
    SendFuture(batch, 4).add_done_callback(calls.append)  # done: called at once, here
    assert [future.result(0).offset for future in calls] == ["3", "4"]


@pytest.mark.parametrize("idempotence", ["sequence", None])
def test_a_message_id_a_producer_would_not_deduplicate_is_refused(
    api: Any, broker: redisq.Broker, idempotence: str | None
) -> None:
    """A message id is deduplicated (idempotence="message_id") or refused with a clear error,
    never stored twice while each copy is answered duplicate=False: send, send_async and a
    delayed send, both APIs; nothing is written."""
    api.broker.create_topic("t", 1)
    producer = api.broker.producer(idempotence=idempotence)
    try:
        with pytest.raises(redisq.InvalidConfig, match="idempotence='message_id'"):
            producer.send("t", b"pay", message_id="pay-1")
        with pytest.raises(redisq.InvalidConfig, match="would not be deduplicated"):
            producer.send_async("t", b"pay", message_id="pay-1")
        with pytest.raises(redisq.InvalidConfig, match="would not be deduplicated"):
            producer.send("t", b"pay", message_id="pay-1", delay_ms=1000)
        producer.send("t", b"no id")
    finally:
        producer.close()
    assert [m.value for m in broker.read("t", 0)] == [b"no id"]
    assert broker.describe_topic("t").total_scheduled == 0
