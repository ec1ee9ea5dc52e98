"""Consumer groups: a member's membership calls; what a group looks like and its
administration (describe, list, delete: group_admin.py; reset offsets: group_offsets.py) are
re-exported here.

Membership: every member heartbeats into the group's registry (a zset scored by server time); a
member silent for session_timeout_ms is dead. Every member sorts the live members and computes
the same assignment (ownership.py), so no coordinator process exists.

Leases: one per (group, partition), a string set NX with a PX ttl whose value carries a fencing
token bumped on every grant. The assignment only says who *should* own a partition; the lease
says who *does*, and Redis checks it on every read and commit of that partition.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from redisq.group_admin import (
    GroupDescription,
    GroupInUse,
    MemberInfo,
    PartitionLag,
    delete_group,
    describe_group,
    group_exists,
    list_groups,
    live_members,
)
from redisq.group_offsets import OffsetReset, reset_offsets
from redisq.keys import validate_name, validate_topic
from redisq.ownership import assign_partitions
from redisq.protocol import group as calls
from redisq.protocol.group import Grant, Lease, parse_lease

if TYPE_CHECKING:
    from redisq.handle import BrokerHandle as Broker

log = logging.getLogger("redisq.group")

__all__ = [
    "GroupDescription",
    "GroupInUse",
    "GroupMembership",
    "Lease",
    "MemberInfo",
    "OffsetReset",
    "PartitionLag",
    "assign_partitions",
    "delete_group",
    "describe_group",
    "group_exists",
    "list_groups",
    "live_members",
    "parse_lease",
    "reset_offsets",
]


class GroupMembership:
    """Join, heartbeat, leave; and the lease operations of one member of one group of one topic
    (the thread driver's calls of redisq.protocol.group)."""

    def __init__(
        self,
        broker: Broker,
        topic: str,
        group: str,
        member: str,
        *,
        mode: str,
        start: str,
        policy: str,
        lease_ttl_ms: int,
        session_timeout_ms: int,
    ) -> None:
        self.broker = broker
        self.topic = validate_topic(topic)
        self.group = validate_name("group", group)
        self.member = validate_name("consumer", member)
        self.ref = calls.GroupRef(self.topic, self.group)
        self.mode = mode
        self.start = start
        self.policy = policy
        self.lease_ttl_ms = lease_ttl_ms
        self.session_timeout_ms = session_timeout_ms
        self.start_id = "0"
        self._keys = broker.keys
        self._scripts = broker.scripts

    def join(self) -> bool:
        """Register the group (the first member fixes mode and start) and this member. True if
        the group was created now."""
        created, self.start_id = self._scripts.run(
            calls.join_group(
                self._keys, self.ref, self.member, mode=self.mode, start=self.start,
                policy=self.policy,
            )
        )  # fmt: skip
        return created

    def heartbeat(self) -> list[str]:
        """Beat, and answer the sorted live members (server clock)."""
        return self._scripts.run(
            calls.heartbeat(self._keys, self.ref, self.member, self.session_timeout_ms)
        )

    def leave(self) -> None:
        self._scripts.run(
            calls.heartbeat(self._keys, self.ref, self.member, self.session_timeout_ms, leave=True)
        )

    def acquire_lease(self, partition: int, request: str = "") -> Grant | None:
        """SET NX PX with a fresh fencing token, and the group's position on the partition; None
        while another member holds it (request: see redisq.protocol.group.acquire_lease)."""
        return self._scripts.run(
            calls.acquire_lease(
                self._keys, self.ref, partition, self.member, self.lease_ttl_ms, self.start_id,
                request,
            )
        )  # fmt: skip

    def give_up_lease(self, partition: int, request: str) -> bool:
        """An acquire that got no answer, given up: True if the grant it made was released."""
        return self._scripts.run(
            calls.give_up_lease(self._keys, self.ref, partition, self.member, request)
        )

    def renew_lease(self, lease: Lease) -> bool:
        """PEXPIRE while the value is still ours; False means lost."""
        return self._scripts.run(calls.renew_lease(self._keys, lease, self.lease_ttl_ms))

    def release_lease(self, lease: Lease, untried_at: str | None = None) -> bool:
        """DEL while the value is still ours, so the next owner need not wait for the ttl
        (untried_at: see redisq.protocol.group.release_lease)."""
        return self._scripts.run(calls.release_lease(self._keys, lease, untried_at))

    def ensure_stream_group(self, partition: int) -> None:
        """Concurrent mode takes no leases: create the Redis consumer group directly."""
        self._scripts.run(calls.ensure_stream_group(self._keys, self.ref, partition, self.start_id))
