"""redisq's asyncio API: the same guarantees with the same names, on redis.asyncio.

    import redisq.asyncio as rq

    broker = await rq.connect(url)                # url / REDIS_URL / the embedded server
    await broker.create_topic("orders", partitions=4, exist_ok=True)
    async with broker.producer(name="svc") as producer:
        meta = await producer.send("orders", b"paid", key="order-42")
        future = producer.send_async("orders", b"shipped", key="order-42")
        await producer.flush()
    async with broker.consumer("orders", group="billing", mode="orderly") as consumer:
        async for message in consumer:
            ...
            await consumer.ack(message)
    await broker.close()

The producer and consumer run the cores the thread API runs (accumulator.py, the consumer's
core) and the same protocol layer; only the I/O differs.
"""

from redisq.asyncio.broker import Broker, connect
from redisq.asyncio.consumer import Consumer
from redisq.asyncio.producer import Producer
from redisq.asyncio.transactional import Transaction
from redisq.errors import (
    DeliveryTimeout,
    InvalidConfig,
    InvalidName,
    LeaseLost,
    MessageTooLarge,
    OutOfOrderSequence,
    PartitionOutOfRange,
    ProducerClosed,
    ProducerFenced,
    RedisqError,
    TopicExists,
    TopicNotFound,
    TransactionAborted,
)
from redisq.records import Message, RecordMetadata
from redisq.transactions import TransactionResult, TxMessage, TxState

__all__ = [
    "Broker",
    "Consumer",
    "DeliveryTimeout",
    "InvalidConfig",
    "InvalidName",
    "LeaseLost",
    "Message",
    "MessageTooLarge",
    "OutOfOrderSequence",
    "PartitionOutOfRange",
    "Producer",
    "ProducerClosed",
    "ProducerFenced",
    "RecordMetadata",
    "RedisqError",
    "TopicExists",
    "TopicNotFound",
    "Transaction",
    "TransactionAborted",
    "TransactionResult",
    "TxMessage",
    "TxState",
    "connect",
]
