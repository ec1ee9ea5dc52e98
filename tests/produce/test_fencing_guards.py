"""Two fencing guards, each defended by a test that fails without it (both APIs, Valkey and
Redis, a proxy between the producer under test and its server):

- KIP-360 (lua/init_producer.lua): an instance of a name that a newer instance superseded gets
  no new epoch when it renews its identity after a delivery timeout: it stays fenced, and the
  newer instance goes on sending.
- An anonymous producer that gave up on a batch (DeliveryTimeout) stores its new epoch on that
  batch's partition before it sends anything else (redisq.protocol.identity.renew_identity), so
  a late copy of the abandoned batch is refused when it reaches the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import redisq
from tests.apis import open_api
from tests.conftest import wait_until
from tests.history.proxy import Proxy
from tests.servers import ServerProcess

pytestmark = pytest.mark.fault

TIMEOUT = {"delivery_timeout_ms": 1500, "retry_backoff_ms": 20, "linger_ms": 0}


@pytest.fixture(params=["sync", "async"])
def api_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cut_off(
    proxied: tuple[ServerProcess, Proxy], namespace: str, api_name: str
) -> Iterator[tuple[redisq.Broker, Any, Proxy]]:
    """A direct broker, and the API under test connected through the proxy."""
    server, proxy = proxied
    direct = redisq.connect(server.url, namespace=namespace)
    api = open_api(api_name, proxy.url, namespace)
    try:
        yield direct, api, proxy
    finally:
        api.shutdown()
        direct.close()


def values(broker: redisq.Broker, partition: int) -> list[bytes]:
    return [m.value for m in broker.read("t", partition)]


def fail_one_send(api: Any, producer: Any, proxy: Proxy, key: str) -> None:
    """A send that goes on the wire and is held there until it fails with DeliveryTimeout; the
    proxy keeps holding its bytes."""
    proxy.blackhole()
    future = producer.send_async("t", b"abandoned", key=key)
    wait_until(lambda: proxy.holds_for_server(b"EVALSHA"), 10, "the batch held on its way")
    with pytest.raises(redisq.DeliveryTimeout):
        api.result(future)


def test_a_superseded_instance_renewing_its_identity_stays_fenced(
    cut_off: tuple[redisq.Broker, Any, Proxy],
) -> None:
    direct, api, proxy = cut_off
    direct.create_topic("t", partitions=2)
    old = api.broker.producer(name="svc", **TIMEOUT)
    first = old.send("t", b"before", key="k")
    fail_one_send(api, old, proxy, "k")
    # A newer instance of the name starts meanwhile: it fences the old one everywhere.
    with direct.producer(name="svc") as new:
        new.send("t", b"new-1", key="k")
        # The old instance reaches the server again; only the abandoned batch stays held (the
        # renewal of its identity, begun while the proxy blackholed, goes through).
        proxy.heal(keep=proxy.held_connections(b"abandoned"))
        # Its renewal (a new epoch after the DeliveryTimeout) is refused: the name is the new
        # instance's now, so the old one stays fenced...
        with pytest.raises(redisq.ProducerFenced):
            old.send("t", b"zombie", key="k")
        # ...and the new one is not fenced by it.
        new.send("t", b"new-2", key="k")
    proxy.release_held()
    assert proxy.wait_released(10)
    assert values(direct, first.partition) == [b"before", b"new-1", b"new-2"]
    old.close(timeout=5)


def test_an_anonymous_producer_fences_the_partition_it_gave_up_on(
    cut_off: tuple[redisq.Broker, Any, Proxy],
) -> None:
    direct, api, proxy = cut_off
    direct.create_topic("t", partitions=2)
    producer = api.broker.producer(**TIMEOUT)
    first = producer.send("t", b"before", key="k")
    old_epoch = producer.epoch
    state = direct.keys.producer_state("t", first.partition, producer.producer_id)
    assert int(direct.client.hget(state, "epoch")) == old_epoch
    fail_one_send(api, producer, proxy, "k")
    proxy.heal(keep=proxy.held_connections(b"abandoned"))  # the late copy stays on its way
    # Before anything else is sent, the partition carries the producer's new epoch.
    wait_until(
        lambda: int(direct.client.hget(state, "epoch")) > old_epoch, 15, "the new epoch stored"
    )
    assert producer.epoch > old_epoch
    # The late copy of the abandoned batch arrives now: refused (it carries the old epoch).
    assert proxy.release_held() == 1
    assert proxy.wait_released(10)
    assert values(direct, first.partition) == [b"before"]
    producer.send("t", b"after", key="k")
    assert values(direct, first.partition) == [b"before", b"after"]
    producer.close(timeout=5)
