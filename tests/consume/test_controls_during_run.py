"""Kafka's consumer controls while an orderly run() is under way, through both APIs (thread and
asyncio, tests/apis.py; on the asyncio API the handler is a coroutine function awaited on the
loop): a seek made while a read is in flight wins over it (in run() and in poll()); a seek past
the end waits (XREAD BLOCK) instead of reading by range again and again, and still delivers an
entry appended at the seek's offset; pause() stops handling from the next message, and what was
read but not handled comes after resume(). Thread API only: a seek from a handler with key lanes,
and a seek made inside poll()'s screening step (white-box). The worker's state is observed, never
slept on: CLIENT LIST shows its connection blocked in XREAD (the consumer's connections carry a
client name of the test's own), INFO commandstats counts its reads on a private server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import redisq
from redisq.model.offsets import MAX_STREAM_ID_PART, offset_after, offset_before
from redisq.model.records import Message
from tests.apis import coroutine_on_asyncio, open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess


@pytest.fixture(params=["valkey", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    """Standalone servers only: CLIENT LIST is asked of the one node."""
    return str(request.param)


@pytest.fixture(params=["sync", "async"])
def named_api(
    request: pytest.FixtureRequest, server_url: str, namespace: str, broker: redisq.Broker
) -> Iterator[Any]:
    """Both APIs (tests/apis.py), their connections named after the test's namespace (`broker`,
    of the same namespace and unnamed, empties it afterwards)."""
    api = open_api(str(request.param), server_url, namespace, client_name=namespace)
    try:
        yield api
    finally:
        api.shutdown()


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    """Both APIs, for a test on a server of its own (opened with tests.apis.open_api)."""
    return str(request.param)


def blocked_in_xread(client: redis.Redis, name: str) -> bool:
    """A connection named `name` is blocked in XREAD: the worker has caught up and waits."""
    return any(
        c.get("name") == name and c.get("cmd") == "xread" and "b" in c.get("flags", "")
        for c in client.client_list()
    )


def send(broker: redisq.Broker, *values: bytes) -> list[str]:
    with broker.producer() as producer:
        return [producer.send("t", value, key="k").offset for value in values]  # type: ignore[misc]


class Running:
    """consumer.run(handler) in a thread (either API: on the asyncio API the handler is a
    coroutine function awaited on the loop), recording each handled value."""

    def __init__(
        self, api: Any, consumer: Any, on_message: Callable[[Message], None] | None = None
    ) -> None:
        self.consumer = consumer
        self.seen: list[bytes] = []
        self.on_message = on_message
        handler = coroutine_on_asyncio(api, self.handle)
        self.thread = threading.Thread(target=consumer.run, args=(handler,), daemon=True)

    def handle(self, message: Message) -> None:
        self.seen.append(message.value)
        if self.on_message is not None:
            self.on_message(message)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


# -- stream IDs ------------------------------------------------------------------------------------
def test_offset_before_is_offset_afters_inverse() -> None:
    assert offset_before("5-3") == "5-2"
    assert offset_before("5-0") == f"4-{MAX_STREAM_ID_PART}"  # a sequence of 0: the ms before
    assert offset_before("0-1") == "0-0"
    assert offset_before("0-0") is None
    for offset in ("5-3", "5-0", "1-0", f"7-{MAX_STREAM_ID_PART}"):
        assert offset_after(offset_before(offset) or "") == offset


# -- a seek while a read is in flight ------------------------------------------------------------
VALUES = [f"m{i}".encode() for i in range(5)]


def test_seek_while_waiting_wins_over_the_entries_the_wait_returns(
    named_api: Any, broker: redisq.Broker, namespace: str
) -> None:
    """The worker waits in XREAD BLOCK; a seek back to the first message, then an append that
    ends the wait: the read it returns was sent before the seek and is dropped, and everything
    is handled again from the seek's offset."""
    broker.create_topic("t", partitions=1)
    offsets = send(broker, *VALUES)
    consumer = named_api.broker.consumer("t", "g", block_ms=3_000)
    with Running(named_api, consumer) as running:
        wait_until(lambda: len(running.seen) == 5, what="the five handled")
        wait_until(lambda: blocked_in_xread(broker.client, namespace), what="waiting in XREAD")
        consumer.seek(0, offsets[0])
        assert consumer.position(0) == offsets[0]
        send(broker, b"new")
        wait_until(lambda: b"new" in running.seen, what="the new message handled")
        wait_until(lambda: blocked_in_xread(broker.client, namespace), what="waiting again")
    assert running.seen == VALUES + VALUES + [b"new"]


def test_seek_from_the_handler_with_key_lanes_takes_effect_within_a_chunk(
    broker: redisq.Broker,
) -> None:
    """key_concurrency: the lanes take a read 64 messages at a time (records.DECODE_CHUNK), so
    a seek from a handler takes effect once the chunk under way is handled."""
    broker.create_topic("t", partitions=1)
    with broker.producer() as producer:
        first = producer.send("t", b"0", key="k0").offset
        for n in range(1, 500):
            producer.send_async("t", str(n).encode(), key=f"k{n % 8}")
    seen: list[int] = []
    lock = threading.Lock()
    holder: list[redisq.Consumer] = []

    def handler(message: Message) -> None:
        with lock:
            seen.append(int(message.value))
            if len(seen) == 1:
                holder[0].seek(0, first or "")

    with broker.consumer("t", "g", batch_size=1000, key_concurrency=4) as consumer:
        holder.append(consumer)
        consumer.run(handler, idle_timeout=1.5)
    # The first handler call seeks (whichever lane makes it): then the old read's chunk of 64
    # is finished, and all 500 are handled again from the seek's offset.
    old = len(seen) - 500
    assert old <= 64, f"{old} messages of the old read handled"
    assert sorted(seen[old:]) == list(range(500))


# -- poll(): a seek while its read is in flight ----------------------------------------------------
LATER = [f"m{i}".encode() for i in range(5, 10)]


def test_poll_seek_while_its_read_is_in_flight_wins(
    api_name: str, proxied: tuple[ServerProcess, Proxy], namespace: str
) -> None:
    """poll() in one thread, its read held by the network; seek() back to the first message
    from another thread; the read's reply then arrives: it was sent before the seek and is
    dropped, and poll() returns the messages from the seek's offset (before, the read's end
    overwrote the seek: m5..m9 came back and the seek was lost)."""
    server, proxy = proxied
    with redisq.connect(server.url, namespace=namespace) as direct:
        direct.create_topic("t", partitions=1)
        offsets = send(direct, *VALUES)
        api = open_api(api_name, proxy.url, namespace)
        try:
            consumer = api.broker.consumer("t", "g")
            first: list[Message] = []

            def first_five() -> bool:
                first.extend(consumer.poll(0.2, 5 - len(first)))
                return len(first) == 5

            wait_until(first_five, what="the first five polled")
            consumer.ack(first)
            consumer.commit()
            send(direct, *LATER)
            polled: list[Message] = []
            poller = threading.Thread(target=lambda: polled.extend(consumer.poll(10, 5)))
            proxy.blackhole()
            poller.start()
            wait_until(lambda: proxy.holds_for_server(b"XRANGE"), what="the poll's read held")
            consumer.seek(0, offsets[0])
            proxy.heal()
            poller.join(15)
            assert not poller.is_alive()
            assert [m.value for m in polled] == VALUES
            consumer.ack(polled)
            assert [m.value for m in consumer.poll(5, 10)] == LATER
            consumer.close()
        finally:
            api.shutdown()


def test_poll_seek_after_the_read_was_admitted_wins(broker: redisq.Broker) -> None:
    """A seek from another thread after poll()'s read was admitted but before it was given
    out (the window where malformed entries are dead-lettered): the read is dropped and poll()
    returns the messages from the seek's offset. Before, it returned the read (m3..m5), made it
    outstanding again, and acking it committed past the seek (white-box: the seek is made from
    inside the consumer's screening step)."""
    broker.create_topic("t", partitions=1)
    values = [f"m{i}".encode() for i in range(6)]
    offsets = send(broker, *values)
    consumer = broker.consumer("t", "g")
    first = consumer.poll(10, 3)
    assert [m.value for m in first] == values[:3]
    consumer.ack(first)
    consumer.commit()
    real_screen = consumer.io.screen

    def seek_then_screen(*args: Any) -> Any:
        consumer.io.screen = real_screen  # type: ignore[method-assign]
        seeker = threading.Thread(target=consumer.seek, args=(0, offsets[0]))
        seeker.start()
        seeker.join()
        return real_screen(*args)

    consumer.io.screen = seek_then_screen  # type: ignore[method-assign]
    polled = consumer.poll(5, 3)
    assert [m.value for m in polled] == values[:3]  # before: m3..m5
    assert consumer.ack(polled) == 3
    consumer.commit()
    assert consumer.committed(0) == offsets[2]
    consumer.close()


# -- a seek past the end -------------------------------------------------------------------------
@pytest.fixture
def private_server() -> Iterator[ServerProcess]:
    server = ServerProcess().start()
    yield server
    server.stop()


def reads(client: redis.Redis) -> int:
    """XRANGE and XREAD calls the server has answered."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("xrange", "xread"))


def entry_at(client: redis.Redis, broker: redisq.Broker, offset: str) -> None:
    """Append a copy of the partition's last entry at exactly `offset` (XADD with an ID)."""
    stream = broker.keys.log("t", 0)
    [(_, fields)] = client.xrevrange(stream, count=1)  # type: ignore[misc]
    client.xadd(stream, fields, id=offset)  # type: ignore[arg-type]


def future_offset(client: redis.Redis) -> str:
    seconds, _ = client.time()
    return f"{(int(seconds) + 60) * 1000}-0"


SPIN_BOUND = 20  # reads in one second: a wait of block_ms=200 makes about 5


def test_seek_past_the_end_waits_and_delivers_the_entry_at_the_offset(
    api_name: str, private_server: ServerProcess
) -> None:
    """seek_to_time(a minute ahead): no entry is there yet. The worker waits for one (a few
    reads a second, not thousands), and an entry appended at exactly the seek's offset, whose
    sequence is 0, is handled (XREAD waits after the ID just before it)."""
    client = private_server.client()
    broker = redisq.connect(private_server.url, namespace="spin")
    api = open_api(api_name, private_server.url, "spin")
    try:
        broker.create_topic("t", partitions=1)
        send(broker, b"before")
        consumer = api.broker.consumer("t", "g", block_ms=200)
        with Running(api, consumer) as running:
            wait_until(lambda: running.seen == [b"before"], what="the first message")
            target = future_offset(client)
            consumer.seek(0, target)
            start = reads(client)
            wait_until(lambda: reads(client) > start + 1, what="reads after the seek")
            start = reads(client)
            time.sleep(1.0)  # the interval the reads are counted over
            assert reads(client) - start <= SPIN_BOUND, "reading again and again"
            entry_at(client, broker, target)
            wait_until(lambda: len(running.seen) == 2, what="the entry at the seek's offset")
        assert running.seen == [b"before", b"before"]
    finally:
        api.shutdown()
        broker.close()
        client.close()


# -- pause ---------------------------------------------------------------------------------------
def rewound_to(consumer: Any, offset: str) -> Callable[[], bool]:
    """The worker stopped before `offset` for a pause: the next read starts at it."""

    def stopped() -> bool:
        reader = consumer._readers.get(("t", 0))
        return reader is not None and (reader.read_from, reader.inclusive) == (offset, True)

    return stopped


def test_pause_while_waiting_stops_the_entries_the_wait_returns(
    named_api: Any, broker: redisq.Broker, namespace: str
) -> None:
    """pause() while the worker waits in XREAD BLOCK, then an append that ends the wait: the
    message read is not handled while paused, and is handled once after resume()."""
    broker.create_topic("t", partitions=1)
    send(broker, b"before")
    consumer = named_api.broker.consumer("t", "g", block_ms=3_000)
    with Running(named_api, consumer) as running:
        wait_until(lambda: running.seen == [b"before"], what="the first message")
        wait_until(lambda: blocked_in_xread(broker.client, namespace), what="waiting in XREAD")
        consumer.pause(0)
        [after] = send(broker, b"after")
        stopped = rewound_to(consumer, after)
        wait_until(lambda: stopped() or len(running.seen) > 1, what="the wait's read")
        assert running.seen == [b"before"] and consumer.position(0) == after
        consumer.resume(0)
        wait_until(lambda: len(running.seen) == 2, what="the message after resume()")
        wait_until(lambda: blocked_in_xread(broker.client, namespace), what="waiting again")
    assert running.seen == [b"before", b"after"]


MANY = [f"m{i}".encode() for i in range(400)]


def fill(broker: redisq.Broker) -> list[str]:
    with broker.producer() as producer:
        futures = [producer.send_async("t", value, key=f"k{i % 8}") for i, value in enumerate(MANY)]
    return [f.result().offset for f in futures]  # type: ignore[misc]


@pytest.mark.parametrize("key_concurrency", [1, 4])
def test_pause_from_the_handler_stops_the_rest_of_the_read(
    api: Any, broker: redisq.Broker, key_concurrency: int
) -> None:
    """pause() from the first message's handler: no further message starts (with key lanes,
    the chunk of 64 the lanes are handling is finished); the rest of the read comes after
    resume(), each message once."""
    broker.create_topic("t", partitions=1)
    offsets = fill(broker)
    holder: list[Any] = []
    lock = threading.Lock()

    def pause_first(message: Message) -> None:
        with lock:
            if message.offset == offsets[0]:
                holder[0].pause(0)

    consumer = api.broker.consumer("t", "g", batch_size=1000, key_concurrency=key_concurrency)
    holder.append(consumer)
    with Running(api, consumer, pause_first) as running:
        if key_concurrency == 1:
            wait_until(rewound_to(consumer, offsets[1]), what="stopped for the pause")
            assert running.seen == [MANY[0]]
        else:  # stops between chunks of 64
            wait_until(rewound_to(consumer, offsets[64]), what="stopped for the pause")
            assert sorted(running.seen) == sorted(MANY[:64])
        consumer.resume(0)
        wait_until(lambda: len(running.seen) >= 400, what="the rest after resume()")
        consumer.commit()
    assert sorted(running.seen) == sorted(MANY)
    if key_concurrency == 1:
        assert running.seen == MANY
