"""Producer identities and fencing, written once as protocol operations that the thread and
the asyncio producers both run (see redisq.protocol.run_operation).

An anonymous producer: 63 random bits of id and an epoch from the server's clock. A named one:
the id derived from the name, and a new epoch from init_producer.lua (KIP-360: a renewal is
refused once a newer instance took the name), stored on every partition of every topic its
name wrote to before anything is sent, so older instances are refused there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from redisq.errors import UnsupportedServer
from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.protocol import Command, Operation
from redisq.protocol import produce as protocol
from redisq.protocol.produce import ProducerIdentity
from redisq.protocol.topics import read_config, server_ms, topic_config


def check_acks(acks: str, *, server: str) -> Operation[None]:
    """Refuse, when a producer starts (before it writes anything), an `acks=` the server cannot
    confirm: UnsupportedServer. "replicas" needs WAIT (a server may rename or disable it, or an
    ACL deny it), "fsync" needs WAITAOF (Redis >= 7.2, Valkey >= 8) on a server with appendonly
    yes. On Redis Cluster every primary is asked (the producer waits on each primary after its
    own writes); one that does not answer is not judged here (its batches fail or wait as any
    write there would). Each probe returns at once: it waits for nothing."""
    if acks == "leader":
        return
    probe: tuple[Any, ...] = ("WAIT", 0, 0) if acks == "replicas" else ("WAITAOF", 0, 0, 0)
    replies = yield Command(probe, nodes="primaries")
    for node, reply in replies.items():
        if isinstance(reply, redis.ResponseError):
            needs = "WAIT" if acks == "replicas" else "WAITAOF (Redis >= 7.2, Valkey >= 8)"
            raise UnsupportedServer(
                f'acks="{acks}" needs {needs}; {_where(server, node)} refused it: '
                f"{_first_line(reply)}"
            ) from reply
    if acks == "fsync":
        aof = yield Command(("INFO", "persistence"), _aof_enabled, nodes="primaries")
        without = sorted(node for node, enabled in aof.items() if enabled is False)
        if without:  # WAITAOF 1 would fail on every batch until the delivery timeout
            where = ", ".join(_where(server, node) for node in without)
            raise UnsupportedServer(
                f'acks="fsync" needs the server to run with appendonly yes ({where} does not)'
            )


def _where(server: str, node: str) -> str:
    return f"{server}, node {node}" if node else server


def _aof_enabled(info: Any) -> bool:
    return bool(int(info.get("aof_enabled", 0)))


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def new_identity(
    keys: KeySpace,
    name: str | None,
    *,
    fence: bool,
    held: ProducerIdentity | None = None,
) -> Operation[ProducerIdentity]:
    """A new epoch (and, for a new anonymous producer, a new id). held: the identity an instance
    renews (after batches of unknown outcome failed); ProducerFenced if a newer instance of its
    name started. fence: store a named producer's epoch on every partition its name wrote to."""
    if name is None:
        now = yield Command(("TIME",), server_ms)
        pid = held.producer_id if held else protocol.random_producer_id()
        return ProducerIdentity(pid, max(held.epoch + 1 if held else 0, now))
    epoch, topics = yield protocol.init_named_producer(keys, name, held.epoch if held else None)
    identity = ProducerIdentity(protocol.named_producer_id(name), epoch, name)
    if fence:
        for topic in topics:
            config = yield from read_config(keys, topic)
            if config is not None:
                yield from fence_partitions(keys, identity, config, range(config.partitions))
    return identity


def fence_partitions(
    keys: KeySpace, identity: ProducerIdentity, config: TopicConfig, partitions: Iterable[int]
) -> Operation[None]:
    """Store the identity's epoch on these partitions, pipelined; ProducerFenced if a newer
    epoch is stored on any of them."""
    results = yield [protocol.fence_partition(keys, identity, config, p) for p in partitions]
    for result in results:
        if isinstance(result, Exception):
            raise result


def prove_and_fence(
    keys: KeySpace, identity: ProducerIdentity, needed: Iterable[tuple[str, int]]
) -> Operation[None]:
    """After UNKNOWN_PRODUCER: prove the epoch against the name's registration (topic by topic),
    then store it on the partitions that did not carry it."""
    by_topic: dict[str, list[int]] = {}
    for topic, partition in sorted(needed):
        by_topic.setdefault(topic, []).append(partition)
    for topic, partitions in by_topic.items():
        config = yield from topic_metadata(keys, identity, topic, register=True)
        yield from fence_partitions(keys, identity, config, partitions)


def topic_metadata(
    keys: KeySpace, identity: ProducerIdentity, topic: str, *, register: bool
) -> Operation[TopicConfig]:
    """The topic's metadata for a producer; a named one also proves its epoch (a fenced
    instance learns it here even while it writes nowhere, and the registration stays alive)."""
    config = yield from topic_config(keys, topic)  # InvalidName, TopicNotFound
    if register:
        yield protocol.register_topic(keys, identity, topic)
    return config


def renew_identity(
    keys: KeySpace,
    identity: ProducerIdentity,
    abandoned: Iterable[tuple[str, int]],
    *,
    fence: bool,
) -> Operation[ProducerIdentity]:
    """After batches of unknown outcome failed: a new epoch, stored on every partition where a
    failed batch went on the wire (a named producer's renewal stores it on every partition its
    name wrote to), so none of them can land after what is sent next."""
    renewed = yield from new_identity(keys, identity.name, fence=fence, held=identity)
    if identity.name is None and fence:
        by_topic: dict[str, list[int]] = {}
        for topic, partition in sorted(abandoned):
            by_topic.setdefault(topic, []).append(partition)
        for topic, partitions in by_topic.items():
            config = yield from read_config(keys, topic)
            if config is not None:  # a deleted topic's batches cannot land anywhere
                yield from fence_partitions(keys, renewed, config, partitions)
    return renewed
