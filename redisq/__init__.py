"""redisq: an ordered, idempotent, partitioned message broker layer on Redis and Valkey.

import redisq
broker = redisq.connect()          # url= / REDIS_URL / embedded valkey-server
broker.create_topic("orders", partitions=4, exist_ok=True)
with broker.producer(name="order-service") as producer:
    meta = producer.send("orders", b"paid", key="order-42")
"""

from redisq import errors
from redisq.broker import Broker, connect
from redisq.consumer import Consumer
from redisq.errors import (
    CommitNotConfirmed,
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
    UnsupportedServer,
)
from redisq.idempotent import idempotent
from redisq.partitioner import partition_for_key
from redisq.producer import Producer, SendFuture
from redisq.records import MalformedEntry, MalformedMessage, Message, RecordMetadata
from redisq.topic import PartitionInfo, TopicConfig, TopicDescription
from redisq.transactional import Transaction
from redisq.transactions import TransactionResult, TxMessage, TxState

__version__ = "0.1.0"

__all__ = [
    "Broker",
    "Consumer",
    "DeliveryTimeout",
    "GroupInUse",
    "GroupNotFound",
    "InvalidConfig",
    "InvalidName",
    "LeaseLost",
    "MalformedEntry",
    "MalformedMessage",
    "Message",
    "MessageTooLarge",
    "CommitNotConfirmed",
    "NotEnoughReplicas",
    "OutOfOrderSequence",
    "PartitionInfo",
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
    "TransactionResult",
    "TxMessage",
    "TxState",
    "UnsupportedServer",
    "connect",
    "errors",
    "idempotent",
    "partition_for_key",
]
