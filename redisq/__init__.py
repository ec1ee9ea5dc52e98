"""redisq: an ordered, idempotent, partitioned message broker layer on Redis and Valkey.

import redisq
broker = redisq.connect()          # url= / REDIS_URL / embedded valkey-server
broker.create_topic("orders", partitions=4, exist_ok=True)
with broker.producer(name="order-service") as producer:
    meta = producer.send("orders", b"paid", key="order-42")
"""

from redisq import errors
from redisq.broker import Broker, connect
from redisq.consume.consumer import Consumer
from redisq.consume.idempotent import idempotent
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
from redisq.produce.futures import SendFuture
from redisq.produce.producer import Producer
from redisq.produce.transactional import Transaction

__version__ = "0.1.0"

__all__ = [
    "Broker",
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
    "CommitNotConfirmed",
    "ConsumerClosed",
    "ConnectionLost",
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
    "SendFuture",
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
    "errors",
    "idempotent",
    "partition_for_key",
]
