# WARNING: generated from membership_async.py by tools/async_to_sync.py; do not edit.
# Change membership_async.py and run `python tools/async_to_sync.py`.
"""A member's membership calls: join, heartbeat, leave, and its partitions' leases (what a
group looks like and its administration: redisq.protocol.groups and .offsets, run by the broker).

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

from redisq.model.keys import validate_name, validate_topic
from redisq.protocol import group as calls
from redisq.protocol.group import Grant, Lease
from redisq.runtime import sleep

if TYPE_CHECKING:
    from redisq.server.handle import BrokerHandle as Broker

# Long enough for the server's clock to pass the millisecond it joined in.
JOIN_MS_PASSED_S = 0.002

log = logging.getLogger("redisq.group")

__all__ = ["GroupMembership"]


class GroupMembership:
    """Join, heartbeat, leave; and the lease operations of one member of one group of one topic
    (the driver's calls of redisq.protocol.group)."""

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
                self._keys,
                self.ref,
                self.member,
                mode=self.mode,
                start=self.start,
                policy=self.policy,
            )
        )
        if created and self.start == "latest":
            # The group starts after the join's millisecond (join_group.lua): once the server's
            # clock has left it, whatever the caller sends next comes after the start.
            sleep(JOIN_MS_PASSED_S)
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
                self._keys,
                self.ref,
                partition,
                self.member,
                self.lease_ttl_ms,
                self.start_id,
                request,
            )
        )

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
