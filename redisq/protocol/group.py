"""Consumer-group scripts: membership, partition leases, fenced reads and acks, dead letters.

A lease is the fencing token: the scripts compare the holder's whole lease value with the lease
key, so a member that lost its lease (expired, or granted again to another member) changes
nothing. Concurrent mode holds no leases: its lease value is "" and the check is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redisq.model.batches import cut_entry
from redisq.model.keys import KeySpace
from redisq.model.offsets import offset_after
from redisq.protocol import ScriptCall, text

MAX_IDS_PER_CALL = 1000  # entry ids per script call: Lua's unpack() has a stack limit


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease on one partition of a group: the whole value is the fencing token."""

    topic: str
    group: str
    partition: int
    value: str

    @property
    def token(self) -> int:
        return int(self.value.split(":", 1)[0])


def parse_lease(value: bytes | str | None) -> tuple[int, str, int] | None:
    """(token, member, granted_ms) of a lease value, or None."""
    if value is None:
        return None
    token, member, granted = text(value).split(":", 2)
    return int(token), member, int(granted)


@dataclass(frozen=True, slots=True)
class GroupRef:
    """Which group of which topic: the keys every group script needs."""

    topic: str
    group: str


# -- membership ----------------------------------------------------------------------------------
def _join_reply(reply: Any) -> tuple[bool, str]:
    created, start_id, _now = reply
    return bool(created), text(start_id)


def join_group(
    keys: KeySpace, ref: GroupRef, member: str, *, mode: str, start: str, policy: str
) -> ScriptCall[tuple[bool, str]]:
    """join_group.lua: register the group (the first member fixes mode and start) and the
    member; returns (created now, the group's start id). GroupModeMismatch on another mode."""
    return ScriptCall(
        "join_group",
        (
            keys.groups(ref.topic),
            keys.group_meta(ref.topic, ref.group),
            keys.group_members(ref.topic, ref.group),
        ),
        (ref.group, mode, start, member, policy),
        _join_reply,
        ref.topic,
    )


def _members_reply(reply: Any) -> list[str]:
    return sorted(text(m) for m in reply[1:])


def heartbeat(
    keys: KeySpace, ref: GroupRef, member: str, session_timeout_ms: int, *, leave: bool = False
) -> ScriptCall[list[str]]:
    """heartbeat.lua: beat (or leave); returns the sorted live members (server clock)."""
    return ScriptCall(
        "heartbeat",
        (keys.group_members(ref.topic, ref.group),),
        (member, session_timeout_ms, "leave" if leave else "beat"),
        _members_reply,
        ref.topic,
    )


# -- leases --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Grant:
    """A granted lease, and where the group stands on the partition: its committed position
    (the Redis consumer group's last-delivered-id) and entries read (None: unknown)."""

    lease: Lease
    position: str
    entries_read: int | None
    takeovers: int = 0  # earlier grants that started at this same position
    pending_tx: str | None = None  # a transaction of the previous owner carrying its position


def _lease_keys(keys: KeySpace, ref: GroupRef, partition: int) -> tuple[str, ...]:
    return (
        keys.lease(ref.topic, partition, ref.group),
        keys.lease_fence(ref.topic, partition, ref.group),
        keys.log(ref.topic, partition),
        keys.group_partition_state(ref.topic, partition, ref.group),
    )


def acquire_lease(
    keys: KeySpace,
    ref: GroupRef,
    partition: int,
    member: str,
    lease_ttl_ms: int,
    start_id: str,
    request: str = "",
) -> ScriptCall[Grant | None]:
    """acquire_lease.lua: SET NX PX with a fresh fencing token (None while another member holds
    it); creates the Redis consumer group on the stream at the group's start if missing.

    request: this attempt's id (OwnershipCore.acquire_request). Sent again after an attempt got
    no answer, it is answered with the grant that attempt made, if that grant still holds the
    lease (see give_up_lease for a member that no longer wants it)."""

    def decode(reply: Any) -> Grant | None:
        if not int(reply[0]):
            return None
        entries_read = int(reply[3])
        return Grant(
            Lease(ref.topic, ref.group, partition, text(reply[1])),
            text(reply[2]),
            entries_read if entries_read >= 0 else None,
            int(reply[4]),
            text(reply[5]) or None if len(reply) > 5 else None,
        )

    return ScriptCall(
        "acquire_lease",
        _lease_keys(keys, ref, partition),
        (ref.group, member, lease_ttl_ms, start_id, request),
        decode,
        ref.topic,
    )


def give_up_lease(
    keys: KeySpace, ref: GroupRef, partition: int, member: str, request: str
) -> ScriptCall[bool]:
    """acquire_lease.lua with "give_up": an acquire attempt that got no answer is given up by a
    member that no longer wants the partition. The grant it made, if it still holds the lease,
    is released (True), and a late copy of the attempt is refused. Safe to send again."""
    return ScriptCall(
        "acquire_lease",
        _lease_keys(keys, ref, partition),
        (ref.group, member, 1, "0", request, "give_up"),
        lambda reply: bool(int(reply[1])),
        ref.topic,
    )


def _flag(reply: Any) -> bool:
    return bool(int(reply))


def renew_lease(keys: KeySpace, lease: Lease, lease_ttl_ms: int) -> ScriptCall[bool]:
    """extend_lease.lua: PEXPIRE while the value is still ours; False means lost."""
    return ScriptCall(
        "extend_lease",
        (keys.lease(lease.topic, lease.partition, lease.group),),
        (lease.value, lease_ttl_ms),
        _flag,
        lease.topic,
    )


def release_lease(keys: KeySpace, lease: Lease, untried_at: str | None = None) -> ScriptCall[bool]:
    """release_lease.lua: DEL while the value is still ours (the next owner need not wait).
    untried_at: the position an orderly owner was granted at and gave out no message from:
    its grant is not counted as a takeover of the message after it (a rebalance is not an
    attempt toward the failure policy). The acquire request the grant answered is marked
    given up (a late copy of it is refused)."""
    return ScriptCall(
        "release_lease",
        (
            keys.lease(lease.topic, lease.partition, lease.group),
            keys.group_partition_state(lease.topic, lease.partition, lease.group),
        ),
        (lease.value, untried_at or ""),
        _flag,
        lease.topic,
    )


def release_token(key: str, token: str, topic: str = "?") -> ScriptCall[bool]:
    """release_lease.lua on any key holding a token (the idempotent handler's marker)."""
    return ScriptCall("release_lease", (key,), (token,), _flag, topic)


def ensure_stream_group(
    keys: KeySpace, ref: GroupRef, partition: int, start_id: str
) -> ScriptCall[bool]:
    """create_group.lua: the Redis consumer group on one stream (concurrent mode)."""
    return ScriptCall(
        "create_group",
        (keys.log(ref.topic, partition),),
        (ref.group, start_id),
        _flag,
        ref.topic,
    )


# -- reading and acking --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Claimed:
    """claim_pending.lua's answer: raw entries (decode with records.decode_entries), their
    delivery counts, and the cursor to continue from ("0-0": done)."""

    cursor: str
    entries: list[Any]
    deliveries: list[Any]


def _claimed(reply: Any) -> Claimed:
    cursor, entries, deliveries = reply
    return Claimed(text(cursor), entries, deliveries)


def claim_pending(
    keys: KeySpace,
    ref: GroupRef,
    partition: int,
    member: str,
    lease_value: str,
    cursor: str,
    count: int,
    min_idle_ms: int = 0,
) -> ScriptCall[Claimed]:
    """claim_pending.lua: XAUTOCLAIM the partition's pending entries to `member`, in offset
    order, while it holds the lease (lease_value "" in concurrent mode, which claims only entries
    idle min_idle_ms)."""
    return ScriptCall(
        "claim_pending",
        (keys.log(ref.topic, partition), keys.lease(ref.topic, partition, ref.group)),
        (ref.group, member, lease_value, cursor, count, min_idle_ms),
        _claimed,
        ref.topic,
    )


@dataclass(frozen=True, slots=True)
class RangeRead:
    """A fenced read's answer: the lease value seen with the entries (compare it with yours)."""

    lease_value: str | None
    entries: list[Any]


def fenced_range_commands(
    keys: KeySpace,
    lease: Lease,
    after: str,
    count: int,
    end: str = "+",
    *,
    inclusive: bool = False,
    resume: bool = False,
) -> list[tuple[Any, ...]]:
    """An orderly owner's read: the lease and the next entries after its position (at it when
    inclusive, after a seek), in one MULTI/EXEC on the partition's node (one slot), so the
    entries come with the lease value that stood when they were read. The caller drops them
    unless that value is its own: a member that lost its lease reads nothing it could hand on.
    No Lua table round trip. After the largest stream ID nothing can come (Redis refuses an
    exclusive start there): the read is then the lease alone, no entries.

    resume: the position may be inside a batch entry (DESIGN §14.7): the entry holding it
    (XREVRANGE ... COUNT 1) is read first, and range_read_reply keeps what follows the position
    in it."""
    start = after if inclusive else offset_after(after)
    commands: list[tuple[Any, ...]] = [
        ("MULTI",),
        ("GET", keys.lease(lease.topic, lease.partition, lease.group)),
    ]
    stream = keys.log(lease.topic, lease.partition)
    if resume:
        commands.append(("XREVRANGE", stream, after, "-", "COUNT", 1))
    if start is not None:
        commands.append(("XRANGE", stream, start, end, "COUNT", count))
    commands.append(("EXEC",))
    return commands


def range_read_reply(replies: Sequence[Any], resume: tuple[str, bool] | None = None) -> RangeRead:
    """The reply to fenced_range_commands (the EXEC's: the last one; without an XRANGE after
    the largest stream ID, no entries). Check read_error first. resume: (position, inclusive)
    of a resume read: the rest of the entry holding the position comes first."""
    executed = replies[-1]
    lease_value = None if executed[0] is None else text(executed[0])
    if resume is None:
        entries = executed[1] if len(executed) > 1 else None
        return RangeRead(lease_value, entries or [])
    held = executed[1] or []
    entries = list(executed[2] or []) if len(executed) > 2 else []
    if held:
        head = cut_entry(held[0], *resume)
        if head and not (entries and text(entries[0][0]) == text(head[0][0])):
            entries[:0] = head
    return RangeRead(lease_value, entries)


def read_error(replies: Sequence[Any]) -> Exception | None:
    """The first error reply of a fenced read, at the top or inside the EXEC's array: Redis
    runs a MULTI's commands at EXEC and answers each failed one with its error in its place,
    which redis-py returns as an exception object among the results."""
    for reply in replies:
        if isinstance(reply, Exception):
            return reply
        if isinstance(reply, list):
            for item in reply:
                if isinstance(item, Exception):
                    return item
    return None


def fenced_wait_commands(
    keys: KeySpace, lease: Lease, after: str, count: int, block_ms: int
) -> list[tuple[Any, ...]]:
    """An orderly owner's read once it has caught up: XREAD BLOCK after its position, then GET
    of the lease, in one write on the partition's node. Redis runs the GET when the XREAD
    returns, and a lease granted again carries a new fencing token, so a value equal to the
    reader's own means the lease was held all the while the entries were read: the guarantee of
    fenced_range_commands, in one round trip where waiting for entries and then reading them by
    range takes two. block_ms >= 1 (0 would block for ever)."""
    if block_ms < 1:
        raise ValueError(f"block_ms={block_ms}: at least 1")
    stream = keys.log(lease.topic, lease.partition)
    return [
        ("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, after),
        ("GET", keys.lease(lease.topic, lease.partition, lease.group)),
    ]


def group_read_commands(
    stream: str,
    group: str,
    member: str,
    count: int,
    ack_ids: Sequence[str],
    block_ms: int | None,
    start: str,
    settled: Sequence[tuple[Any, ...]] = (),
) -> list[tuple[Any, ...]]:
    """A concurrent member's read, for one write: XACK what it handled (if anything) and the
    settled_writes of its batch entries, then XREADGROUP from `start` (">": new entries; "0":
    its own pending ones), with BLOCK when block_ms is not None. group_read_entries reads the
    replies."""
    read: tuple[Any, ...] = ("XREADGROUP", "GROUP", group, member, "COUNT", count)
    if block_ms is not None:
        read += ("BLOCK", block_ms)
    commands: list[tuple[Any, ...]] = [*settled, (*read, "STREAMS", stream, start)]
    if ack_ids:
        commands.insert(0, ("XACK", stream, group, *ack_ids))
    return commands


def settled_writes(
    settled_key: str, whole: Sequence[str], partial: Mapping[str, bytes]
) -> list[tuple[Any, ...]]:
    """The settled bitmaps of a concurrent group's batch entries brought up to date: HDEL of
    those XACKed whole, HSET of those partly settled (DESIGN §14.8)."""
    commands: list[tuple[Any, ...]] = []
    if whole:
        commands.append(("HDEL", settled_key, *whole))
    if partial:
        commands.append(("HSET", settled_key, *[x for pair in partial.items() for x in pair]))
    return commands


def group_read_entries(replies: Sequence[Any], start: str) -> list[Any]:
    """The raw entries of group_read_commands' replies (an error reply raises). A pending entry
    deleted since it was read comes without fields: it is left out."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    entries = stream_entries(replies[-1])
    if start != ">":
        entries = [entry for entry in entries if entry[1] is not None]
    return entries


def stream_entries(reply: Any) -> list[Any]:
    """The entries of a raw XREADGROUP reply for one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values())) or []
    return reply[0][1] or []


def script_command(sha: str, call: ScriptCall[Any]) -> tuple[Any, ...]:
    """A script call as one EVALSHA command, for a pipeline of plain commands (a commit sent
    with fenced_wait_commands in one write)."""
    return ("EVALSHA", sha, len(call.keys), *call.keys, *call.args)


def commit_then_wait_commands(
    keys: KeySpace,
    lease: Lease,
    commit: Commit,
    sha_of: Callable[[str], str],
    read_from: str,
    count: int,
    block_ms: int,
) -> list[tuple[Any, ...]]:
    """commit_position.lua as EVALSHA (sha_of: a script's SHA by name), then
    fenced_wait_commands, for one write: the commit runs before the XREAD. The first reply is
    the commit's; the others go to wait_read_reply."""
    call = commit_position(keys, lease, commit)
    return [
        script_command(sha_of(call.script), call),
        *fenced_wait_commands(keys, lease, read_from, count, block_ms),
    ]


def wait_read_reply(replies: Sequence[Any]) -> RangeRead:
    """The reply to fenced_wait_commands: XREAD's entries (none when it timed out; a RESP2
    list or a RESP3 map of the one stream) and the lease value read after them."""
    read, value = replies
    if not read:
        entries: list[Any] = []
    elif isinstance(read, dict):
        entries = next(iter(read.values())) or []
    else:
        entries = read[0][1] or []
    return RangeRead(None if value is None else text(value), entries)


@dataclass(slots=True)
class Commit:
    """What an orderly owner commits on a partition (commit_position.lua)."""

    position: str | None = None
    entries_read: int | None = None
    dead_letters: int = 0
    malformed: int = 0
    clear_blocked: bool = False
    seq: int = 0  # its number among the commits of its lease (a late older copy is ignored)
    parked: list[tuple[bytes, str]] = field(default_factory=list)  # (key, dead letter offset)
    held: list[tuple[str, bytes]] = field(default_factory=list)  # (offset, key)
    unheld: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.position
            or self.dead_letters
            or self.clear_blocked
            or self.parked
            or self.held
            or self.unheld
        )


def record_args(commit: Commit) -> list[Any]:
    """The parked keys, held messages and released ones a commit records (record_parked() in
    lua/includes/group.lua): P, H, U, then P (key, offset) pairs, H (offset, key), U offsets."""
    args: list[Any] = [len(commit.parked), len(commit.held), len(commit.unheld)]
    for key, offset in commit.parked:
        args += [key, offset]
    for offset, key in commit.held:
        args += [offset, key]
    args += commit.unheld
    return args


def parked_and_held(keys: KeySpace, lease: Lease, records: Commit) -> tuple[str, ...]:
    """The parked-keys and held-messages hashes, declared only when the call writes them: both
    are usually absent, and while a slot migrates the cluster answers TRYAGAIN to a script that
    declares a key its node does not hold, for as long as the migration lasts."""
    if not (records.parked or records.held or records.unheld):
        return ()
    topic, p, group = lease.topic, lease.partition, lease.group
    return (keys.parked_keys(topic, p, group), keys.held_messages(topic, p, group))


def commit_position(keys: KeySpace, lease: Lease, commit: Commit) -> ScriptCall[Any]:
    """commit_position.lua: the position and what changed with it, under the lease."""
    topic, p, group = lease.topic, lease.partition, lease.group
    args: list[Any] = [
        group,
        lease.value,
        commit.position or "",
        "" if commit.entries_read is None or not commit.position else commit.entries_read,
        commit.dead_letters,
        commit.malformed,
        "1" if commit.clear_blocked else "0",
        commit.seq,
        *record_args(commit),
    ]
    return ScriptCall(
        "commit_position",
        (
            keys.log(topic, p),
            keys.lease(topic, p, group),
            keys.group_partition_state(topic, p, group),
            *parked_and_held(keys, lease, commit),
        ),
        args,
        topic=topic,
    )


def ack(
    keys: KeySpace, ref: GroupRef, partition: int, lease_value: str, ids: Sequence[str]
) -> ScriptCall[int]:
    """ack.lua: XACK many entries while the caller holds the lease (LeaseLost: nothing acked)."""
    if len(ids) > MAX_IDS_PER_CALL:
        raise ValueError(f"at most {MAX_IDS_PER_CALL} ids per call")
    return ScriptCall(
        "ack",
        (keys.log(ref.topic, partition), keys.lease(ref.topic, partition, ref.group)),
        (ref.group, lease_value, *ids),
        int,
        ref.topic,
    )


def dead_letter(
    keys: KeySpace,
    ref: GroupRef,
    partition: int,
    lease_value: str,
    offset: str,
    park_key: bytes = b"",
) -> ScriptCall[bool]:
    """dead_letter.lua: after the copy to the dead-letter topic, ack the entry, count it and
    (park_key) park its key, while the caller holds the lease."""
    return ScriptCall(
        "dead_letter",
        (
            keys.log(ref.topic, partition),
            keys.lease(ref.topic, partition, ref.group),
            keys.group_partition_state(ref.topic, partition, ref.group),
            keys.parked_keys(ref.topic, partition, ref.group),
        ),
        (ref.group, lease_value, offset, park_key),
        _flag,
        ref.topic,
    )
