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

from redisq.broker_async import Broker, connect
from redisq.consume.consumer_async import Consumer
from redisq.errors import (
    AlreadyAcked,
    CommitNotConfirmed,
    ConnectionLost,
    ConsumerClosed,
    DeliveryTimeout,
    GroupInUse,
    GroupNotFound,
    InvalidConfig,
    InvalidName,
    LeaseLost,
    MessageTooLarge,
    NotEnoughReplicas,
    OutOfOrderSequence,
    PartitionOutOfRange,
    ProducerClosed,
    ProducerFenced,
    ReadFailed,
    RedisqError,
    TopicExists,
    TopicInUse,
    TopicNotFound,
    TransactionAborted,
    TransactionDecided,
    TransactionInProgress,
    UnsupportedServer,
)
from redisq.model.groups import GroupDescription, MemberInfo, OffsetReset, PartitionLag
from redisq.model.partitioner import partition_for_key
from redisq.model.records import MalformedEntry, MalformedMessage, Message, RecordMetadata
from redisq.model.topic import PartitionInfo, TopicConfig, TopicDescription
from redisq.model.transactions import TransactionResult, TxMessage, TxState
from redisq.produce.producer_async import Producer
from redisq.produce.transactional_async import Transaction

__all__ = [
    "Broker",
    "CommitNotConfirmed",
    "ConsumerClosed",
    "ConnectionLost",
    "Consumer",
    "DeliveryTimeout",
    "GroupDescription",
    "GroupInUse",
    "GroupNotFound",
    "InvalidConfig",
    "InvalidName",
    "AlreadyAcked",
    "LeaseLost",
    "MalformedEntry",
    "MalformedMessage",
    "MemberInfo",
    "Message",
    "MessageTooLarge",
    "NotEnoughReplicas",
    "OffsetReset",
    "OutOfOrderSequence",
    "PartitionInfo",
    "PartitionLag",
    "PartitionOutOfRange",
    "Producer",
    "ProducerClosed",
    "ProducerFenced",
    "ReadFailed",
    "RecordMetadata",
    "RedisqError",
    "TopicConfig",
    "TopicDescription",
    "TopicExists",
    "TopicInUse",
    "TopicNotFound",
    "Transaction",
    "TransactionAborted",
    "TransactionDecided",
    "TransactionInProgress",
    "TransactionResult",
    "TxMessage",
    "TxState",
    "UnsupportedServer",
    "connect",
    "partition_for_key",
]
