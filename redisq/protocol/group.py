"""Consumer-group scripts: membership, partition leases, fenced reads and acks, dead letters.

A lease is the fencing token: the scripts compare the holder's whole lease value with the lease
key, so a member that lost its lease (expired, or granted again to another member) changes
nothing. Concurrent mode holds no leases: its lease value is "" and the check is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redisq.keys import KeySpace
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
def acquire_lease(
    keys: KeySpace, ref: GroupRef, partition: int, member: str, lease_ttl_ms: int, start_id: str
) -> ScriptCall[Lease | None]:
    """acquire_lease.lua: SET NX PX with a fresh fencing token (None while another member holds
    it); creates the Redis consumer group on the stream at the group's start if missing."""

    def decode(reply: Any) -> Lease | None:
        granted, value = reply
        return Lease(ref.topic, ref.group, partition, text(value)) if granted else None

    return ScriptCall(
        "acquire_lease",
        (
            keys.lease(ref.topic, partition, ref.group),
            keys.lease_fence(ref.topic, partition, ref.group),
            keys.log(ref.topic, partition),
        ),
        (ref.group, member, lease_ttl_ms, start_id),
        decode,
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


def release_lease(keys: KeySpace, lease: Lease) -> ScriptCall[bool]:
    """release_lease.lua: DEL while the value is still ours (the next owner need not wait)."""
    return ScriptCall(
        "release_lease",
        (keys.lease(lease.topic, lease.partition, lease.group),),
        (lease.value,),
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
class ReadResult:
    """read_partition.lua's answer: raw entries, or none and the stream's last ID to wait from."""

    acked: int
    tail: str
    entries: list[Any]


def _read_reply(reply: Any) -> ReadResult:
    acked, tail, entries = reply
    return ReadResult(int(acked), text(tail), entries)


def read_partition(
    keys: KeySpace,
    ref: GroupRef,
    partition: int,
    member: str,
    lease_value: str,
    count: int,
    ack_ids: Sequence[str] = (),
) -> ScriptCall[ReadResult]:
    """read_partition.lua: ack what was handled and XREADGROUP the next new entries, in one
    fenced call (LeaseLost: nothing acked, nothing read)."""
    if len(ack_ids) > MAX_IDS_PER_CALL:
        raise ValueError(f"at most {MAX_IDS_PER_CALL} ids per call")
    return ScriptCall(
        "read_partition",
        (keys.log(ref.topic, partition), keys.lease(ref.topic, partition, ref.group)),
        (ref.group, member, lease_value, count, *ack_ids),
        _read_reply,
        ref.topic,
    )


def fenced_read_commands(
    keys: KeySpace,
    ref: GroupRef,
    partition: int,
    member: str,
    count: int,
    ack_ids: Sequence[str] = (),
) -> tuple[str, list[tuple[Any, ...]]]:
    """The standalone servers' fenced read as a transaction (no Lua table round trip for the
    entries): the caller sends WATCH <lease key> and GET it, compares the value with its lease
    (LeaseLost if it differs), then sends these commands; EXEC answers nil if the lease key was
    written (a new grant, a release, a renewal) or expired after the WATCH, and the caller then
    checks again. Returns (the lease key, [MULTI, XACK?, XREADGROUP, XREVRANGE, EXEC])."""
    stream = keys.log(ref.topic, partition)
    commands: list[tuple[Any, ...]] = [("MULTI",)]
    if ack_ids:
        commands.append(("XACK", stream, ref.group, *ack_ids))
    commands.append(
        ("XREADGROUP", "GROUP", ref.group, member, "COUNT", count, "STREAMS", stream, ">")
    )
    commands.append(("XREVRANGE", stream, "+", "-", "COUNT", 1))
    commands.append(("EXEC",))
    return keys.lease(ref.topic, partition, ref.group), commands


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
