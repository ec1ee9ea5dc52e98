"""The Redis calls of an asyncio consumer's partitions (the twin of redisq.partition): a fenced
range read (MULTI GET lease / XRANGE / EXEC), XREAD BLOCK, the commit, the Redis consumer group
for concurrent mode, the dead-letter copy.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from redisq.asyncio.client import closed_mid_write
from redisq.deadletter import LETTER_PRODUCER_OPTIONS, letter
from redisq.dispatch import OrderlyPartition
from redisq.errors import PartitionOutOfRange, from_reply
from redisq.keys import dead_letter_topic
from redisq.malformed import MalformedLog
from redisq.ownership import TopicPartition
from redisq.partition import (
    PartitionIO,
    hashes,
    offset_entries,
    parked_reads,
)
from redisq.protocol import group as calls
from redisq.protocol.group import Commit, Lease
from redisq.protocol.redirect import REDIRECT_BUDGET_S, asking_batch, asking_replies, redirection
from redisq.protocol.resp import pack_commands
from redisq.records import MalformedMessage, Message, decode_entries
from redisq.settings import ConsumerSettings

from .producer import Producer

if TYPE_CHECKING:
    from redisq.asyncio.handle import AsyncBrokerHandle

log = logging.getLogger("redisq.consumer")

_NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class AsyncPartitionIO:
    """The Redis calls of one asyncio consumer's partitions."""

    def __init__(
        self,
        broker: AsyncBrokerHandle,
        group: str,
        member: str,
        settings: ConsumerSettings,
    ) -> None:
        self.broker = broker
        self.group = group
        self.member = member
        self.settings = settings
        self._keys = broker.keys
        self._client = broker.client
        self._cluster = isinstance(self._client, RedisCluster)
        self._letters: Producer | None = None
        self._letter_topics: set[str] = set()
        self._last_claim: dict[TopicPartition, float] = {}
        self.malformed_log = MalformedLog(member)

    async def _exchange(
        self, key: str, commands: list[tuple[Any, ...]], *, follow: bool = True
    ) -> list[Any]:
        """Commands in one write on a pooled connection of the node serving `key`, raw replies;
        on a cluster, redirections followed as redisq.partition.PartitionIO._exchange does."""
        if not self._cluster:
            pool = self._client.connection_pool
            return await self._send(await pool.get_connection(), pool.release, commands)
        client = self._client
        node = client.get_node_from_key(key)
        batch, asked, attempt = commands, False, 0
        deadline = time.monotonic() + REDIRECT_BUDGET_S
        while True:
            replies = await self._send(node.acquire_connection(), node.release, batch)
            if asked:
                replies = asking_replies(commands, replies)
            found = redirection(replies) if follow else None
            if found is None or time.monotonic() >= deadline:
                return replies
            attempt += 1
            await asyncio.sleep(found.delay(attempt))
            if found.kind == "MOVED":  # handed over: the slot map is refreshed
                await client.nodes_manager.initialize()
                node, batch, asked = client.get_node_from_key(key), commands, False
            elif found.kind == "ASK":
                named = client.get_node(host=found.host, port=found.port)
                if named is None:  # a node the client does not know yet
                    await client.nodes_manager.initialize()
                    named = client.get_node(host=found.host, port=found.port)
                    if named is None:
                        return replies
                node, batch, asked = named, asking_batch(commands), True

    @staticmethod
    async def _send(conn: Any, release: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One write of commands on conn (then given back with release); raw replies."""
        packed = [pack_commands(commands)]
        try:
            with closed_mid_write():  # the cluster client may close this connection meanwhile
                await conn.connect()
                await conn.send_packed_command(packed)
            replies = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()
            result = release(conn)
            if inspect.isawaitable(result):
                await result
            raise
        result = release(conn)
        if inspect.isawaitable(result):
            await result
        return replies

    async def read_range(self, reader: OrderlyPartition, count: int) -> list[Any]:
        """See redisq.partition.PartitionIO.read_range (raw entries)."""
        lease = reader.lease
        start, inclusive = reader.next_range()
        commands = calls.fenced_range_commands(self._keys, lease, start, count, inclusive=inclusive)
        replies = await self._exchange(commands[1][1], commands)
        return PartitionIO.fenced(lease, replies, calls.range_read_reply)

    async def read_waiting(self, reader: OrderlyPartition, count: int, block_ms: int) -> list[Any]:
        """See redisq.partition.PartitionIO.read_waiting."""
        lease = reader.lease
        after = reader.wait_after()  # the position, or the ID before it after a seek
        commands = calls.fenced_wait_commands(self._keys, lease, after, count, block_ms)
        return PartitionIO.waited(lease, await self._exchange(commands[1][1], commands))

    async def commit_then_wait(
        self, reader: OrderlyPartition, commit: Commit, count: int, block_ms: int
    ) -> tuple[bool, list[Any]]:
        """See redisq.partition.PartitionIO.commit_then_wait."""
        lease = reader.lease
        commands = calls.commit_then_wait_commands(
            self._keys,
            lease,
            commit,
            lambda name: self.broker.scripts[name].sha,
            reader.wait_after(),
            count,
            block_ms,
        )
        key = commands[-1][1]
        replies = await self._exchange(key, commands, follow=False)
        if redirection(replies[:1]):  # see PartitionIO.commit_then_wait
            replies[:1] = await self._exchange(key, commands[:1])
        if redirection(replies[1:]):
            replies[1:] = await self._exchange(key, commands[1:])
        committed = replies.pop(0)
        if isinstance(committed, NoScriptError):  # a restarted server: load it, commit again
            return await self.commit(lease, commit), replies
        if isinstance(committed, Exception):
            raise from_reply(str(committed), lease.topic) or committed
        return committed == 1, replies

    async def commit(self, lease: Lease, commit: Commit) -> bool:
        """See redisq.partition.PartitionIO.commit."""
        call = calls.commit_position(self._keys, lease, commit)
        if self._cluster:
            sha = self.broker.scripts[call.script].sha
            reply = (await self._exchange(call.keys[0], [calls.script_command(sha, call)]))[0]
            if not isinstance(reply, NoScriptError):
                if isinstance(reply, Exception):
                    raise from_reply(str(reply), lease.topic) or reply
                return bool(reply == 1)
        return await self.broker.scripts.run(call) == 1

    async def load_parked(self, reader: OrderlyPartition) -> None:
        """See redisq.partition.PartitionIO.load_parked."""
        key = self._keys.log(*reader.tp)
        reader.parked_loaded(
            *hashes(await self._exchange(key, parked_reads(self._keys, self.group, reader.tp)))
        )

    async def parked_now(self, tp: TopicPartition) -> set[bytes]:
        return set(await self._client.hkeys(self._keys.parked_keys(tp[0], tp[1], self.group)))

    async def fetch_offsets(self, tp: TopicPartition, offsets: list[str]) -> list[Message]:
        key = self._keys.log(*tp)
        return offset_entries(
            tp, await self._exchange(key, [("XRANGE", key, o, o) for o in offsets])
        )

    async def committed(self, tp: TopicPartition) -> str | None:
        """See redisq.partition.PartitionIO.committed."""
        topic, p = PartitionIO.group_topic(tp)
        if not await self._client.sismember(self._keys.groups(topic), self.group):
            raise PartitionIO.not_read(topic, self.group)
        config = await self.broker.topic_config(topic)
        if not PartitionIO.partition_in(p, config.partitions):  # added since it was cached?
            config = await self.broker.topic_config(topic, refresh=True)
            if not PartitionIO.partition_in(p, config.partitions):
                raise PartitionOutOfRange(topic, p, config.partitions)
        for info in await self._client.xinfo_groups(self._keys.log(topic, p)):
            name = info.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == self.group:
                last = info.get("last-delivered-id")
                return last.decode() if isinstance(last, bytes) else last
        return None

    # -- concurrent ------------------------------------------------------------------------------
    async def read_group(
        self,
        tp: TopicPartition,
        count: int,
        ack_ids: list[str],
        block_ms: int | None,
        start: str = ">",
    ) -> list[Any]:
        """See redisq.partition.PartitionIO.read_group (raw entries)."""
        stream = self._keys.log(*tp)
        commands = calls.group_read_commands(
            stream, self.group, self.member, count, ack_ids, block_ms, start
        )
        return calls.group_read_entries(await self._exchange(stream, commands), start)

    async def claim_idle(self, tp: TopicPartition, count: int) -> list[Message]:
        now = time.monotonic()
        idle_ms = self.settings.claim_idle
        if now - self._last_claim.get(tp, 0.0) < idle_ms / 2000:
            return []
        self._last_claim[tp] = now
        claimed = await self.broker.scripts.run(
            calls.claim_pending(
                self._keys, calls.GroupRef(tp[0], self.group), tp[1], self.member, "", "0-0",
                count, idle_ms,
            )
        )  # fmt: skip
        return decode_entries(tp[0], tp[1], claimed.entries, claimed.deliveries)

    async def ack_group(self, tp: TopicPartition, ids: list[str]) -> int:
        if not ids:
            return 0
        return int(await self._client.xack(self._keys.log(*tp), self.group, *ids))

    # -- failures --------------------------------------------------------------------------------
    async def dead_letter(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        error: BaseException | str,
        attempts: int,
    ) -> None:
        """The copy (idempotent, as redisq.deadletter.DeadLetterWriter writes it); concurrent
        mode then acks it with dead_letter.lua."""
        topic = dead_letter_topic(message.topic, self.group)
        if topic not in self._letter_topics:
            await self.broker.create_topic(topic, partitions=1, exist_ok=True)
            self._letter_topics.add(topic)
        if self._letters is None:
            self._letters = Producer(self.broker, **LETTER_PRODUCER_OPTIONS)  # type: ignore[arg-type]
        value, key, headers, message_id = letter(message, error, attempts, self.group)
        await self._letters.send(topic, value, key=key, headers=headers, message_id=message_id)
        if isinstance(message, MalformedMessage):
            self.malformed_log.note(message, f"dead-lettered to {topic}")
        if reader is None:
            await self.broker.scripts.run(
                calls.dead_letter(
                    self._keys, calls.GroupRef(message.topic, self.group), message.partition, "",
                    message.offset,
                )
            )  # fmt: skip

    async def mark_blocked(
        self, tp: TopicPartition, message: Message, error: BaseException, attempts: int
    ) -> None:
        try:
            await self._client.hset(
                self._keys.group_partition_state(tp[0], tp[1], self.group),
                mapping={
                    "blocked_offset": message.offset,
                    "blocked_error": f"{type(error).__name__}: {error}"[:500],
                    "blocked_attempts": attempts,
                },
            )
        except redis.RedisError as exc:
            log.warning("%s: could not record the blocked message: %s", self.member, exc)

    def note_malformed(self, message: Message, what: str) -> None:
        self.malformed_log.note(message, what)

    async def close(self) -> None:
        self.malformed_log.close()
        if self._letters is not None:
            await self._letters.close()
