"""The Redis calls of a consumer's partitions (`AsyncPartitionIO`; the thread API's
`PartitionIO` is generated from this module by tools/async_to_sync.py).

One method, one Redis idea: a fenced range read (MULTI GET lease / XRANGE / EXEC on the
partition's node), XREAD BLOCK to wait for new entries, the commit (commit_position.lua), the
group's Redis consumer group for concurrent mode (XREADGROUP, XACK, XAUTOCLAIM), the
dead-letter copy, and poll()'s screening of a read (malformed entries go to the policy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError

from redisq.consume.dispatch import OrderlyPartition
from redisq.consume.letters_async import AsyncDeadLetterWriter
from redisq.consume.malformed import MalformedLog
from redisq.consume.ownership import TopicPartition
from redisq.consume.policies import Backoff, DeadLetter, FailurePolicy, make_policy
from redisq.consume.reading import ReadRest, hashes, offset_entries, parked_reads
from redisq.consume.settling import EntrySettling, EntrySizes, Settled, batch_entry_ids
from redisq.errors import InvalidConfig, LeaseLost, PartitionOutOfRange, RedisqError, from_reply
from redisq.model.offsets import offset_parts
from redisq.model.records import (
    MalformedMessage,
    Message,
    decode_entries,
    decode_entries_py,
    decode_lazily,
)
from redisq.model.stats import ConsumerStats
from redisq.protocol import group as calls
from redisq.protocol.group import Commit, Lease
from redisq.protocol.redirect import REDIRECT_BUDGET_S, FollowedBatch, redirection
from redisq.runtime import AGuard, asleep
from redisq.server.connection_async import exchange, is_cluster
from redisq.settings import ConsumerSettings

if TYPE_CHECKING:
    from redisq.server.handle_async import AsyncBrokerHandle as Broker

log = logging.getLogger("redisq.consumer")


class AsyncPartitionIO:
    """The Redis calls of one consumer's partitions."""

    def __init__(
        self,
        broker: Broker,
        group: str,
        member: str,
        settings: ConsumerSettings,
        policy: FailurePolicy | None = None,
    ) -> None:
        self.broker = broker
        self.group = group
        self.member = member
        self.settings = settings
        self.policy = policy or make_policy(
            settings.failure_policy,
            settings.max_attempts,
            Backoff(settings.retry_backoff_ms, settings.max_retry_backoff_ms),
        )
        self._keys = broker.keys
        self._scripts = broker.scripts
        self._client = broker.client
        self._cluster = is_cluster(broker.client)
        self._writers: dict[str, AsyncDeadLetterWriter] = {}
        self._guard = AGuard()
        self._last_claim: dict[TopicPartition, float] = {}
        self._settling: dict[TopicPartition, EntrySettling] = {}
        # poll() in concurrent mode: messages of entries read beyond max_messages (a batch
        # entry holds many), given by the next poll() (still pending until acked)
        self._leftover: dict[TopicPartition, list[Message]] = {}
        self.rest = ReadRest()  # orderly poll(): the messages of a read past max_messages
        self.sizes = EntrySizes()  # entries to read for about poll()'s or run()'s messages
        self.malformed_log = MalformedLog(member)

    # -- a pooled connection on the partition's node ---------------------------------------------
    async def _exchange(
        self, key: str, commands: list[tuple[Any, ...]], *, follow: bool = True
    ) -> list[Any]:
        """Send commands in one write on a pooled connection of the node serving `key` and read
        their raw replies (redisq.server.connection_async.exchange). On a cluster, the commands
        that met a redirection (ASK, MOVED, TRYAGAIN, CLUSTERDOWN: they did not run) are sent
        again as protocol.redirect.FollowedBatch says, within its budget; follow=False for a
        batch that may have run in part (commit_then_wait sorts that out itself)."""
        if not self._cluster:
            return await exchange(self._client, None, commands)
        client = self._client
        node = client.get_node_from_key(key)
        batch, asked, attempt = FollowedBatch(commands), False, 0
        deadline = time.monotonic() + REDIRECT_BUDGET_S
        while True:
            found = batch.took(await exchange(client, node, batch.to_send(asked)), asked)
            if found is None or not follow or time.monotonic() >= deadline:
                return batch.replies
            attempt += 1
            await asleep(found.delay(attempt))
            if found.kind == "MOVED":  # handed over: the slot map is refreshed
                await client.nodes_manager.initialize()
                node, asked = client.get_node_from_key(key), False
            elif found.kind == "ASK":
                named = client.get_node(host=found.host, port=found.port)
                if named is None:  # a node the client does not know yet
                    await client.nodes_manager.initialize()
                    named = client.get_node(host=found.host, port=found.port)
                    if named is None:
                        return batch.replies
                node, asked = named, True

    # -- orderly: reading by range, committing ---------------------------------------------------
    async def read_range(self, reader: OrderlyPartition, count: int) -> list[Any]:
        """The next entries after the reader's position (raw, for decode_entries), with the lease
        value that stood when they were read: LeaseLost (nothing returned) unless it is the
        reader's."""
        lease = reader.lease
        start, inclusive = reader.next_range()
        resume = not reader.at_boundary
        commands = calls.fenced_range_commands(
            self._keys, lease, start, count, inclusive=inclusive, resume=resume
        )
        replies = await self._exchange(commands[1][1], commands)
        if not resume:
            return self.fenced(lease, replies, calls.range_read_reply)
        return self.fenced(
            lease, replies, lambda executed: calls.range_read_reply(executed, (start, inclusive))
        )

    async def read_waiting(self, reader: OrderlyPartition, count: int, block_ms: int) -> list[Any]:
        """read_range for a reader that has caught up: waits up to block_ms for entries after
        its position and returns them with the lease checked after they were read
        (calls.fenced_wait_commands), in one round trip; [] when nothing came."""
        if not reader.at_boundary:  # the rest of an entry first (XREAD would pass it over)
            return await self.read_range(reader, count)
        lease = reader.lease
        after = reader.wait_after()  # the position, or the ID before it after a seek
        commands = calls.fenced_wait_commands(self._keys, lease, after, count, block_ms)
        return self.waited(lease, await self._exchange(commands[1][1], commands))

    async def commit_then_wait(
        self, reader: OrderlyPartition, commit: Commit, count: int, block_ms: int
    ) -> tuple[bool, list[Any]]:
        """commit, then read_waiting's commands, in one write (commit_position.lua runs before
        the XREAD): the commit's error reply raises (LeaseLost, ...); (whether the commit was
        applied, the read's raw replies for waited())."""
        lease = reader.lease
        commands = calls.commit_then_wait_commands(
            self._keys,
            lease,
            commit,
            lambda name: self._scripts[name].sha,
            reader.wait_after(),
            count,
            block_ms,
        )
        key = commands[-1][1]
        replies = await self._exchange(key, commands, follow=False)
        if redirection(replies[:1]):  # the commit did not run: alone again, following
            replies[:1] = await self._exchange(key, commands[:1])
        if redirection(replies[1:]):  # nor did the read (after a commit that may have run)
            replies[1:] = await self._exchange(key, commands[1:])
        committed = replies.pop(0)
        if isinstance(committed, NoScriptError):  # a restarted server: load it, commit again
            return await self.commit(lease, commit), replies
        if isinstance(committed, Exception):
            raise from_reply(str(committed), lease.topic) or committed
        return committed == 1, replies

    @staticmethod
    def waited(lease: Lease, replies: list[Any]) -> list[Any]:
        """The raw entries of a waiting read's replies (see fenced)."""
        return AsyncPartitionIO.fenced(lease, replies, calls.wait_read_reply)

    @staticmethod
    def fenced(
        lease: Lease, replies: list[Any], parse: Callable[[list[Any]], calls.RangeRead]
    ) -> list[Any]:
        """The raw entries of a fenced read's replies (parse: range_read_reply or
        wait_read_reply): LeaseLost unless the lease read after the entries is the reader's.
        The caller decodes them (decode_entries, or chunks.admitted_chunks). An error reply
        (a stream replaced by another type, an ID Redis refuses) raises RedisqError naming the
        partition: it is not a read of no entries."""
        error = calls.read_error(replies)
        if redirection([error]):  # a slot migrating: the worker reads again (a warning)
            raise error  # type: ignore[misc]
        if error is not None:
            raise RedisqError(
                f"reading {lease.topic}/{lease.partition} failed: {type(error).__name__}: {error}"
            ) from error
        result = parse(replies)
        if result.lease_value != lease.value:
            raise LeaseLost(f"{lease.topic}/{lease.partition} lease is held by another grant")
        return result.entries

    async def commit(self, lease: Lease, commit: Commit) -> bool:
        """commit_position.lua: False when Redis had applied a later-numbered write of the
        lease first (a transaction's hold), so nothing of this commit was."""
        call = calls.commit_position(self._keys, lease, commit)
        if self._cluster:  # on the partition's node, redirections followed (_exchange)
            sha = self._scripts[call.script].sha
            reply = (await self._exchange(call.keys[0], [calls.script_command(sha, call)]))[0]
            if not isinstance(reply, NoScriptError):  # else: loaded and run by scripts.run
                if isinstance(reply, Exception):
                    raise from_reply(str(reply), lease.topic) or reply
                return bool(reply == 1)
        return await self._scripts.run(call) == 1

    async def load_parked(self, reader: OrderlyPartition) -> None:
        """The group's parked keys and the messages held behind them, whatever this member's
        policy (a park_key member may have parked them): its messages stay held, and the held
        ones are handed out once their key is released."""
        key = self._keys.log(*reader.tp)
        reads = parked_reads(self._keys, self.group, reader.tp)
        reader.parked_loaded(*hashes(await self._exchange(key, reads)))

    async def parked_now(self, tp: TopicPartition) -> set[bytes]:
        """The group's parked keys on the partition now (a `redisq dlq release` frees some)."""
        key = self._keys.parked_keys(tp[0], tp[1], self.group)
        reply = (await self._exchange(key, [("HKEYS", key)]))[0]
        if isinstance(reply, Exception):
            raise reply
        return set(reply)

    async def fetch_offsets(self, tp: TopicPartition, offsets: list[str]) -> list[Message]:
        """Held messages by offset (one pipelined read each of the entry at or before it, which
        holds it when it is inside a batch entry); a trimmed one is gone."""
        key = self._keys.log(*tp)
        commands = [("XREVRANGE", key, o, "-", "COUNT", 1) for o in offsets]
        return offset_entries(tp, await self._exchange(key, commands), offsets)

    async def committed(self, tp: TopicPartition) -> str | None:
        """The group's position on a partition of a topic it reads (InvalidConfig for another
        topic, PartitionOutOfRange for a partition the topic does not have)."""
        topic, p = self.group_topic(tp)
        if not await self._client.sismember(self._keys.groups(topic), self.group):
            raise self.not_read(topic, self.group)
        config = await self.broker.topic_config(topic)
        if not self.partition_in(p, config.partitions):  # added since it was cached?
            config = await self.broker.topic_config(topic, refresh=True)
            if not self.partition_in(p, config.partitions):
                raise PartitionOutOfRange(topic, p, config.partitions)
        for info in await self._client.xinfo_groups(self._keys.log(topic, p)):
            name = info.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == self.group:
                last = info.get("last-delivered-id")
                return last.decode() if isinstance(last, bytes) else last
        return None

    @staticmethod
    def group_topic(tp: object) -> tuple[str, Any]:
        """(topic, partition) of a committed() argument; InvalidConfig unless it names a topic."""
        if not isinstance(tp, tuple) or len(tp) != 2 or not isinstance(tp[0], str):
            raise InvalidConfig(f"{tp!r}: expected a partition or a (topic, partition) pair")
        return tp[0], tp[1]

    @staticmethod
    def not_read(topic: str, group: str) -> InvalidConfig:
        return InvalidConfig(f"topic {topic!r} is not read by group {group!r}")

    @staticmethod
    def partition_in(partition: object, partitions: int) -> bool:
        if isinstance(partition, bool) or not isinstance(partition, int):
            return False
        return 0 <= partition < partitions

    @staticmethod
    def check_offset(offset: object) -> str:
        """A seek's offset as Redis takes it: offsets.offset_parts, the one parser of stream
        IDs (ASCII digits, each part at most 2**64 - 1), as "<ms>-<seq>"."""
        try:
            ms, seq = offset_parts(offset if isinstance(offset, str) else "")
        except ValueError:
            raise InvalidConfig(
                f"offset {offset!r}: expected a stream ID <ms>-<seq> such as 1700000000000-0, "
                "each part 0..18446744073709551615"
            ) from None
        return f"{ms}-{seq}"

    # -- concurrent: the Redis consumer group ----------------------------------------------------
    async def read_group(
        self,
        tp: TopicPartition,
        count: int,
        ack_ids: list[str],
        block_ms: int | None,
        start: str = ">",
    ) -> list[Any]:
        """XACK what was handled and XREADGROUP from `start` in one write (BLOCK when
        waiting): the entries read, raw (for decode_entries or decode_lazily)."""
        stream = self._keys.log(*tp)
        with self.settling(tp).settling(ack_ids) as settled:  # undone if the read fails
            writes = self._settled_writes(tp, settled)
            commands = calls.group_read_commands(
                stream, self.group, self.member, count, settled.ready, block_ms, start, writes
            )
            return calls.group_read_entries(await self._exchange(stream, commands), start)

    def _settled_writes(self, tp: TopicPartition, settled: Settled) -> list[tuple[Any, ...]]:
        key = self._keys.settled_messages(*tp, self.group)
        return calls.settled_writes(key, settled.whole, settled.partial)

    def settling(self, tp: TopicPartition) -> EntrySettling:
        with self._guard:
            settling = self._settling.get(tp)
            if settling is None:
                settling = self._settling[tp] = EntrySettling()
            return settling

    def group_messages(
        self,
        tp: TopicPartition,
        entries: list[Any],
        deliveries: Any = None,
        *,
        lazily: bool = False,
        stored: Mapping[str, bytes] | None = None,
    ) -> Iterable[Message]:
        """The messages of entries given to a concurrent member, less those settled before (by
        it, or by a member it claimed them from: `stored` bitmaps; consume.settling)."""
        acked = self.settling(tp).given(entries, stored)
        if acked:
            return decode_entries_py(*tp, entries, deliveries, acked=acked)
        if lazily and deliveries is None:
            return decode_lazily(*tp, entries)
        return decode_entries(*tp, entries, deliveries)

    async def claim_idle(self, tp: TopicPartition, count: int) -> list[Message]:
        """XAUTOCLAIM entries pending longer than claim_idle_ms (a dead member's), now and
        then (every claim_idle_ms / 2)."""
        now = time.monotonic()
        idle_ms = self.settings.claim_idle
        if now - self._last_claim.get(tp, 0.0) < idle_ms / 2000:
            return []
        self._last_claim[tp] = now
        claimed = await self._scripts.run(
            calls.claim_pending(
                self._keys,
                calls.GroupRef(tp[0], self.group),
                tp[1],
                self.member,
                "",
                "0-0",
                count,
                idle_ms,
            )
        )
        stored = await self._stored_bitmaps(tp, claimed.entries)
        return list(self.group_messages(tp, claimed.entries, claimed.deliveries, stored=stored))

    async def _stored_bitmaps(self, tp: TopicPartition, entries: list[Any]) -> dict[str, bytes]:
        """The settled bitmaps Redis holds for the batch entries among entries just claimed."""
        ids = batch_entry_ids(entries)
        if not ids:
            return {}
        reply = await self._client.hmget(self._keys.settled_messages(*tp, self.group), ids)
        return {entry: bits for entry, bits in zip(ids, reply, strict=True) if bits}

    async def ack_group(self, tp: TopicPartition, ids: list[str]) -> int:
        """XACK on the partition's node (a connection the server dropped is replaced first) of
        the entries the messages `ids` settle (consume.settling); how many messages that
        acknowledged (a batch entry's messages count as each is settled)."""
        if not ids:
            return 0
        stream = self._keys.log(*tp)
        with self.settling(tp).settling(ids) as settled:  # undone if the XACK fails
            commands = self._settled_writes(tp, settled)
            if settled.ready:
                commands.insert(0, ("XACK", stream, self.group, *settled.ready))
            if not commands:
                return settled.messages
            replies = await self._exchange(stream, commands)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        acked = int(replies[0]) if settled.ready else 0
        return max(0, acked - len(settled.whole)) + settled.messages

    # -- failures --------------------------------------------------------------------------------
    async def dead_letter(
        self,
        reader: OrderlyPartition | None,
        message: Message,
        error: BaseException | str,
        attempts: int,
        *,
        park: bool = False,
    ) -> None:
        """The copy to the dead-letter topic (idempotent: its message id is the source's
        coordinates); concurrent mode then acks it with dead_letter.lua. Orderly mode passes
        over it with the next commit (the caller updates the reader; `park`: its key is parked
        with it)."""
        writer = self._writer(message.topic)
        await writer.write(message, error, attempts)
        if reader is None:
            # The entry is acked once every message of it is settled (consume.settling).
            tp = (message.topic, message.partition)
            ready = (settled := self.settling(tp).settle([message.offset])).ready
            await self._scripts.run(
                calls.dead_letter(
                    self._keys,
                    calls.GroupRef(message.topic, self.group),
                    message.partition,
                    "",
                    ready[0] if ready else "",
                )
            )
            writes = self._settled_writes(tp, settled)
            if writes:  # the settled bitmap of its entry, brought up to date
                await self._client.execute_command(*writes[0])
        if isinstance(message, MalformedMessage):
            self.note_malformed(message, f"dead-lettered to {writer.topic}")

    def _writer(self, topic: str) -> AsyncDeadLetterWriter:
        with self._guard:
            writer = self._writers.get(topic)
            if writer is None:
                writer = self._writers[topic] = AsyncDeadLetterWriter(
                    self.broker, topic, self.group
                )
            return writer

    async def mark_blocked(
        self, tp: TopicPartition, message: Message, error: BaseException, attempts: int
    ) -> None:
        """Policy block: the partition waits on this message; describe_group and lag show it."""
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

    # -- poll ------------------------------------------------------------------------------------
    async def fetch(
        self,
        tp: TopicPartition,
        reader: OrderlyPartition | None,
        count: int,
        guard: Any,
        moves: int,
    ) -> list[Message]:
        """poll(): the next messages of a partition (orderly: held keys' messages held back;
        nothing when the position moved since `moves` was taken, before the read)."""
        if reader is not None:
            now = time.monotonic()
            with guard:
                kept = self.rest.take(reader, now)
            if kept is not None:
                messages, start, read_at = kept
            else:
                read_at = now  # the fenced read below checks the lease no earlier than this
                entries = await self.read_range(reader, self.sizes.entries_for(tp, count))
                messages, start = decode_entries(*tp, entries), 0
                self.sizes.note(tp, entries, messages)
            # count entries may hold more messages (batch entries): poll() gives count at most,
            # and keeps the rest for the next poll() (read again if the position moves).
            end = start + count
            cut = len(messages) > end
            with guard:
                admitted = reader.admit_unless_moved(
                    messages[start:end], time.monotonic(), moves, boundary=not cut
                )
                if cut and reader.moves == moves:
                    self.rest.keep(reader, messages, end, read_at)
            return admitted
        with self._guard:
            messages = self._leftover.pop(tp, [])
        if not messages:
            messages = await self.claim_idle(tp, count)
        if not messages:
            entries = await self.read_group(tp, self.sizes.entries_for(tp, count), [], None)
            messages = list(self.group_messages(tp, entries))
            self.sizes.note(tp, entries, messages)
        if len(messages) > count:
            with self._guard:
                self._leftover[tp] = messages[count:]
            messages = messages[:count]
        return messages

    async def screen(
        self,
        reader: OrderlyPartition | None,
        messages: list[Message],
        stats: ConsumerStats,
        guard: Any,
        moves: int,
    ) -> list[Message]:
        """poll(): malformed entries go to the failure policy, never to the caller; a block stops
        the batch there (orderly: read again from it after a backoff). Orderly, the batch is
        given to the caller in order, the dead-lettered ones acked at once (the position passes
        them only with the messages before them), unless the position moved since the read was
        sent (`moves`: a seek, a hand-over): then nothing is given."""
        good: list[Message] = []
        given: list[Message] = []
        passed: list[str] = []
        block_at = None
        clean = MalformedMessage not in set(map(type, messages))  # told in C: thousands a poll
        if clean:
            good = given = messages
        for message in () if clean else messages:
            if message.__class__ is not MalformedMessage:
                good.append(message)
                given.append(message)
                continue
            if reader is not None and reader.moves != moves:
                return []  # dropped (screened() says so again under the guard): no I/O for it
            action = self.policy.malformed()
            if not (reader is not None and reader.blocked == message.offset):
                stats.malformed += 1
            if isinstance(action, DeadLetter):
                stats.dead_letters += 1
                await self.dead_letter(reader, message, message.error(), 0)  # type: ignore[attr-defined]
                given.append(message)
                passed.append(message.offset)
                continue
            if reader is not None:
                if reader.blocked != message.offset:
                    self.note_malformed(message, "blocking (policy block)")
                    await self.mark_blocked(reader.tp, message, message.error(), 0)  # type: ignore[attr-defined]
                block_at = message.offset
            else:
                self.note_malformed(message, "left pending (policy block)")
            break
        if reader is not None:
            with guard:
                now = time.monotonic()
                if not reader.screened(given, passed, block_at, now, moves):
                    return []
        return good

    async def close(self) -> None:
        with self._guard:
            writers = list(self._writers.values())
            self.rest.clear()
        for writer in writers:
            await writer.close()
        self.malformed_log.close()
