"""The shortest path through the public API, on every backend."""

import redisq


def test_create_send_read(broker: redisq.Broker) -> None:
    broker.create_topic("orders", partitions=4)
    with broker.producer(name="svc") as producer:
        first = producer.send("orders", b"paid", key="order-42")
        again = producer.send("orders", b"shipped", key="order-42")
    assert first.partition == again.partition == redisq.partition_for_key(b"order-42", 4)
    assert not first.duplicate and not again.duplicate
    values = [m.value for m in broker.read("orders", first.partition)]
    assert values == [b"paid", b"shipped"]
