"""Typed errors of redisq.

Lua scripts answer with short error codes (``OUT_OF_ORDER expected=17``); `from_reply` turns them
into these exceptions, in this one place.
"""

from __future__ import annotations

import re
from typing import Any

import redis


class RedisqError(Exception):
    """Base class of every redisq error."""

    retriable = False


class InvalidName(RedisqError, ValueError):
    """A namespace, topic, producer or group name that redisq does not accept."""


class InvalidConfig(RedisqError, ValueError):
    """A parameter outside its allowed range."""


def log_text(value: object, limit: int = 500) -> str:
    """str(value) for one log line: what the user's code put in it (a handler's exception text)
    cannot start a line of its own or send terminal escapes: characters that do not print are
    escaped (a newline as \\n), and it is cut at `limit` characters."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """Validate an int parameter eagerly: TypeError for another type, InvalidConfig with the value
    and the allowed range when it is outside."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f"..{maximum}" if maximum is not None else " or more"
        raise InvalidConfig(f"{name}={value} is out of range: {minimum}{upper}")
    return value


def check_number(name: str, value: object, minimum: float, maximum: float) -> float:
    """As check_int, for parameters that may be fractional (milliseconds of linger, ...)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise InvalidConfig(f"{name}={value} is out of range: {minimum}..{maximum}")
    return value


class TopicNotFound(RedisqError):
    """The topic does not exist (never created, or deleted): nothing was written."""

    def __init__(self, topic: str) -> None:
        super().__init__(f"topic {topic!r} does not exist")
        self.topic = topic


class PartitionGone(TopicNotFound):
    """The partition a message was routed to no longer exists: the topic was deleted (and maybe
    re-created with fewer partitions) after the producer read its metadata. Nothing of the
    message was written. send() routes it once more with the metadata read again; a send_async
    future fails with this error (re-routing queued messages could reorder a key's messages)."""

    def __init__(self, topic: str, partition: int, partitions: int) -> None:
        RedisqError.__init__(
            self,
            f"topic {topic!r} has no partition {partition} (routed with {partitions} partitions, "
            "as read before): deleted, or re-created with fewer partitions; nothing of the "
            "message was written, send it again",
        )
        self.topic = topic
        self.partition = partition


class TopicExists(RedisqError):
    """create_topic of a topic that exists (exist_ok=True returns it instead)."""

    def __init__(self, topic: str) -> None:
        super().__init__(f"topic {topic!r} already exists")
        self.topic = topic


class PartitionOutOfRange(RedisqError, ValueError):
    """A partition number the topic does not have (0 .. partitions - 1): nothing was queued."""

    def __init__(self, topic: str, partition: object, partitions: int) -> None:
        super().__init__(
            f"partition {partition!r} out of range for topic {topic!r}: 0..{partitions - 1}"
        )
        self.topic = topic
        self.partition = partition
        self.partitions = partitions


class MessageTooLarge(RedisqError, ValueError):
    """A message bigger than the producer's max_message_bytes: nothing was queued."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds max_message_bytes={limit}")
        self.size = size
        self.limit = limit


class ProducerFenced(RedisqError):
    """A newer instance of this named producer started: this one may not write any more."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(
            "producer fenced: a newer instance with the same name has started"
            + (f" ({detail})" if detail else "")
        )


class OutOfOrderSequence(RedisqError):
    """The broker expected another sequence number: a batch before this one is missing.

    Retriable: the producer re-sends its unacknowledged batches in order.
    """

    retriable = True

    def __init__(self, expected: int) -> None:
        super().__init__(f"out of order sequence: the broker expects sequence {expected}")
        self.expected = expected


class UnknownProducer(RedisqError):
    """A named producer's epoch is not stored on the partition it wrote to (the state expired,
    the partition was added later, or Redis lost it): nothing was written. Handled inside the
    producer, which proves its epoch against its name's registration and stores it there."""

    retriable = True


class TransactionDecided(RedisqError):
    """A transaction was already committed, aborted or given up: its decision is final."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the transaction was already decided: {state}")
        self.state = state


class TransactionInProgress(RedisqError):
    """A plain send from a transactional producer while its transaction is open: the message
    would land at once, before the transaction's earlier messages of its key, so it is refused
    (as Kafka's transactional producer refuses a send outside its transaction). Send it in the
    transaction (tx.send), or after commit() or abort()."""


class TransactionAborted(RedisqError):
    """The transaction was aborted (by the caller, an exception, a lost input lease, its timeout
    or a newer instance of the producer): none of its messages or acks took effect."""


class ProducerClosed(RedisqError):
    """send() after close(), or a message still buffered when the producer was closed."""


class DeliveryTimeout(RedisqError):
    """A batch could not be acknowledged within delivery_timeout_ms.

    The outcome is unknown: the batch may or may not have been written.
    """

    retriable = False


class NotEnoughReplicas(RedisqError):
    """acks="replicas": fewer replicas than required acknowledged the write in time. Retriable."""

    retriable = True


class CommitNotConfirmed(NotEnoughReplicas):
    """A transaction is committed on the primary, but its acks ("replicas" / "fsync") were not
    confirmed within delivery_timeout_ms: a failover may lose it. Not retriable (sending it again
    would write it twice); calling commit() again tries the confirmation again."""

    retriable = False

    def __init__(self, message: str, transaction_id: str) -> None:
        super().__init__(message)
        self.transaction_id = transaction_id


class UnsupportedServer(RedisqError):
    """The server lacks a command or version that the requested feature needs."""


class WorkerIdUnavailable(RedisqError):
    """No Snowflake worker id could be leased (all 1024 are held by live producers)."""


class LeaseLost(RedisqError):
    """This consumer no longer holds the lease on the partition: its ack or read was refused.

    Another member owns the partition now (or the lease expired); nothing was changed.
    """

    def __init__(self, detail: str = "") -> None:
        super().__init__("lease lost" + (f": {detail}" if detail else ""))


class AlreadyAcked(RedisqError, ValueError):
    """A transaction was given a message this consumer acknowledged already under its current
    lease (by ack(), commit(), auto-commit, or an earlier transaction): the group's position is
    past it, so no transaction can commit it again. Nothing was changed."""


class GroupNotFound(RedisqError):
    """A consumer group no member ever joined on this topic (or one deleted)."""

    def __init__(self, topic: str, group: str) -> None:
        super().__init__(f"group {group!r} of topic {topic!r} does not exist")
        self.topic = topic
        self.group = group


class TopicInUse(RedisqError):
    """delete_topic while a group still has live members (force=True deletes anyway)."""

    def __init__(self, topic: str, group: str, members: list[str]) -> None:
        shown = ", ".join(members[:5]) + (" ..." if len(members) > 5 else "")
        super().__init__(
            f"topic {topic!r}: group {group!r} has live members ({shown}); stop them, or "
            "delete with force=True"
        )
        self.topic = topic
        self.group = group
        self.members = members


class GroupInUse(TopicInUse):
    """The group has live members (or a partition lease is still held): deleting it or
    resetting its offsets under them would be overwritten by their next commit."""

    def __init__(
        self, topic: str, group: str, members: list[str], action: str, note: str = ""
    ) -> None:
        super().__init__(topic, group, members)
        shown = ", ".join(members[:5]) + (" ..." if len(members) > 5 else "")
        self.args = (
            f"group {group!r} of topic {topic!r} has live members ({shown}): stop them before "
            f"you {action}" + (f" ({note})" if note else ""),
        )


class GroupModeMismatch(RedisqError, ValueError):
    """A consumer asked for another mode (orderly/concurrent) than the group was created with."""


class ConsumerClosed(RedisqError):
    """poll(), ack() or run() after close()."""


class ConnectionLost(RedisqError, redis.ConnectionError):
    """The server could not be reached, or dropped the connection, and redisq could not recover:
    a connection found closed before a command was sent is replaced and the command sent again,
    but a command that may have run before the connection broke is not repeated blindly (its
    outcome is unknown). Also a redis.ConnectionError, so code written for redis-py still
    catches it."""


class ReadFailed(RedisqError):
    """A command of a read behind a view (describe, lag, metrics, the console) was answered
    with an error (a lost connection, a slot moving in a cluster, a key of another type): the
    view shows this instead of a number it did not read. `cause` is the error."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"could not read {what}: {type(cause).__name__}: {log_text(cause)}")
        self.what = what
        self.cause = cause


def read_reply(reply: Any, what: str) -> Any:
    """A pipelined reply, or ReadFailed when the step left an error in its place."""
    if isinstance(reply, Exception):
        raise ReadFailed(what, reply) from reply
    return reply


_OUT_OF_ORDER = re.compile(r"OUT_OF_ORDER expected=(\d+)")


def from_reply(message: str, topic: str = "?") -> RedisqError | None:
    """Map a Lua error reply to a typed exception, or None if it is not one of ours."""
    if message.startswith("OUT_OF_ORDER"):
        match = _OUT_OF_ORDER.search(message)
        return OutOfOrderSequence(int(match.group(1)) if match else -1)
    if message.startswith("TX_DECIDED"):
        return TransactionDecided(message.removeprefix("TX_DECIDED state=").strip())
    if message.startswith("UNKNOWN_PRODUCER"):
        return UnknownProducer(message.removeprefix("UNKNOWN_PRODUCER").strip())
    if message.startswith("PRODUCER_FENCED"):
        return ProducerFenced(message.removeprefix("PRODUCER_FENCED").strip())
    if message.startswith("TOPIC_NOT_FOUND"):
        return TopicNotFound(topic)
    if message.startswith("TOPIC_EXISTS"):
        return TopicExists(topic)
    if message.startswith("LEASE_LOST"):
        return LeaseLost(f"topic {topic!r} " + message.removeprefix("LEASE_LOST").strip())
    if message.startswith("INVALID_CONFIG"):
        detail = message.removeprefix("INVALID_CONFIG").strip()
        return InvalidConfig(f"topic {topic!r}: {detail}")
    if message.startswith("GROUP_MODE"):
        return GroupModeMismatch(f"topic {topic!r}: " + message.removeprefix("GROUP_MODE").strip())
    return None
