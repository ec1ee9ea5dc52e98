"""The consumer's ownership core: membership, assignment and partition leases. No I/O.

Every member heartbeats into its group's registry (per topic), and every member computes the
same assignment from the sorted list of live members (RocketMQ's averaging): no coordinator
process. The assignment says who *should* own a partition; the lease says who *does*, and Redis
checks it on every read and commit. A driver asks `due(now)` what to do (heartbeat, read the
metadata again, acquire, renew, hand over) and reports back what happened; `may_handle` says
whether a message of a partition may be handled now: a member whose renewals fail stops
handling before its lease runs out.

Concurrent mode holds no leases: every member reads every partition.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter

from redisq.errors import InvalidConfig
from redisq.model.records import Message
from redisq.protocol.group import Grant, Lease

TopicPartition = tuple[str, int]


def topic_partition(topics: Sequence[str], partition: int | TopicPartition) -> TopicPartition:
    """A consumer's partition argument as (topic, partition): a number names a partition of its
    only topic."""
    if isinstance(partition, tuple):
        return partition
    if len(topics) != 1:
        raise InvalidConfig("name the partition as (topic, partition): several topics")
    return (topics[0], partition)


def held_partition(
    topics: Sequence[str], partition: int | TopicPartition, member: str
) -> TopicPartition:
    """topic_partition for seek, position, pause and resume: a partition number is an int
    (True or 1.0 would find partition 1 by hash and equality, and act on it)."""
    tp = topic_partition(topics, partition)
    number = tp[1] if len(tp) == 2 else None
    if isinstance(number, bool) or not isinstance(number, int):
        raise InvalidConfig(f"{partition!r} is not assigned to {member}")
    return tp


def assign_partitions(partitions: int, members: Sequence[str], member: str) -> list[int]:
    """The partitions `member` should own: contiguous ranges over the sorted live members, the
    first `partitions % len(members)` members taking one extra (AllocateMessageQueueAveragely).

    Every member computes this from the same sorted list and gets the same answer.
    """
    ordered = sorted(set(members))
    if member not in ordered or partitions <= 0:
        return []
    index = ordered.index(member)
    count = len(ordered)
    base, extra = divmod(partitions, count)
    size = base + (1 if index < extra else 0)
    start = index * base + min(index, extra)
    return list(range(start, start + size))


@dataclass
class Owned:
    """One partition this member holds (orderly: under a lease) or reads (concurrent)."""

    tp: TopicPartition
    lease: Lease | None
    deadline: float  # monotonic: when the lease runs out unless renewed
    renew_due: float = 0.0
    revoked: bool = False  # assigned elsewhere: finish the current message, commit, hand over
    revoked_at: float = 0.0
    lost: bool = False  # the lease is gone (expired or granted to another member)
    finishing: bool = False  # the driver is handing it over (commit, release) right now
    finished: bool = False  # handed over (or given up): the driver forgets it
    paused: bool = False  # pause(): the lease is kept, nothing is read
    # on_assign has been told (orderly; from run()/poll() on): nothing is read before it is
    announced: bool = True
    announcing: bool = False  # on_assign is running for it (in run()'s or poll()'s caller)
    # handed over while on_assign ran: on_revoke is told once on_assign returned
    revoke_owed: bool = False

    @property
    def lease_value(self) -> str:
        return self.lease.value if self.lease else ""


@dataclass(frozen=True, slots=True)
class Due:
    """What the driver should do now."""

    heartbeat: bool = False
    refresh_metadata: bool = False
    acquire: list[TopicPartition] = field(default_factory=list)
    renew: list[TopicPartition] = field(default_factory=list)
    hand_over: list[TopicPartition] = field(default_factory=list)  # revoked or closing
    # acquires given up whose give-up is still to be answered (request id, partition): the
    # grant each made, if any, is released by it (the next owner need not wait for its ttl)
    give_up: list[tuple[str, TopicPartition]] = field(default_factory=list)


class OwnershipCore:
    """See the module docstring. The thread driver calls it under its lock."""

    def __init__(
        self,
        member: str,
        *,
        orderly: bool,
        lease_ttl_ms: int,
        heartbeat_ms: int,
        metadata_max_age_ms: int,
    ) -> None:
        self.member = member
        self.orderly = orderly
        self.lease_ttl_s = lease_ttl_ms / 1000
        self.renew_s = lease_ttl_ms / 3000
        # Stop handling a partition this long before its lease deadline (when renewals fail).
        self.margin_s = lease_ttl_ms / 10000
        self.heartbeat_s = heartbeat_ms / 1000
        self.metadata_s = metadata_max_age_ms / 1000
        self.members: dict[str, list[str]] = {}
        self.partitions: dict[str, int] = {}
        self.owned: dict[TopicPartition, Owned] = {}
        # pause() is the member's, not the lease's: a partition revoked while paused and
        # granted again later comes back paused, until resume()
        self.paused: set[TopicPartition] = set()
        self.stopping = False
        self.rebalances = 0
        # Acquire attempts not done with (no answer, an error, or a grant not yet taken up: the
        # call may have granted the lease): the next attempt on the partition sends the same
        # request id and gets that grant.
        self.requests: dict[TopicPartition, str] = {}
        # Requests given up (the partition no longer wanted), until Redis answers the give-up.
        # A request given up is never sent as an acquire again: a give-up still on its way
        # would release the grant that acquire took up.
        self.giving_up: dict[str, TopicPartition] = {}
        self._next_heartbeat = 0.0
        self._next_metadata = 0.0

    # -- what should happen ----------------------------------------------------------------------
    def target(self) -> set[TopicPartition]:
        """The partitions this member should hold now."""
        if self.stopping:
            return set()
        wanted: set[TopicPartition] = set()
        for topic, count in self.partitions.items():
            if self.orderly:
                members = self.members.get(topic, [])
                wanted.update((topic, p) for p in assign_partitions(count, members, self.member))
            else:
                wanted.update((topic, p) for p in range(count))
        return wanted

    def due(self, now: float) -> Due:
        heartbeat = not self.stopping and now >= self._next_heartbeat
        if heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
        refresh = not self.stopping and now >= self._next_metadata
        if refresh:
            self._next_metadata = now + self.metadata_s
        target = self.target()
        hand_over: list[TopicPartition] = []
        renew: list[TopicPartition] = []
        for tp, owned in self.owned.items():
            if owned.finished or owned.finishing or owned.lost:
                continue
            if tp not in target and not owned.revoked:
                owned.revoked = True
                owned.revoked_at = now
            if owned.revoked:
                hand_over.append(tp)
            if owned.lease is not None and now >= owned.renew_due:
                renew.append(tp)
        acquire = sorted(tp for tp in target if tp not in self.owned)
        for tp in [tp for tp in self.requests if tp not in target and tp not in self.owned]:
            self.give_up(tp)
        give_up = sorted(self.giving_up.items())
        return Due(heartbeat, refresh, acquire, renew, hand_over, give_up)

    def may_handle(self, tp: TopicPartition, now: float) -> bool:
        owned = self.owned.get(tp)
        if owned is None or owned.revoked or owned.lost or owned.finished or self.stopping:
            return False
        return owned.lease is None or now < owned.deadline - self.margin_s

    def handling_limit(self, tp: TopicPartition) -> float:
        """The monotonic time after which nothing of this partition may start."""
        owned = self.owned.get(tp)
        if owned is None or owned.lease is None:
            return float("inf")
        return owned.deadline - self.margin_s

    def acquire_request(self, tp: TopicPartition) -> str:
        """The request id of an acquire of tp about to be sent: the id of the attempt before,
        if that one was not done with (so a grant it made is answered now), else a new one.
        Call answered(tp) once it is done with."""
        request = self.requests.get(tp)
        if request is None:
            request = self.requests[tp] = secrets.token_hex(8)
        return request

    # -- what happened ---------------------------------------------------------------------------
    def give_up(self, tp: TopicPartition) -> str | None:
        """tp's acquire request, given up (None if there is none): the driver sends the give-up
        now, and again with every due() until given_up(request) says it was answered. The next
        acquire of tp takes a new request id."""
        request = self.requests.pop(tp, None)
        if request is not None:
            self.giving_up[request] = tp
        return request

    def given_up(self, request: str) -> None:
        self.giving_up.pop(request, None)

    def answered(self, tp: TopicPartition) -> None:
        """An acquire of tp is done with: refused, or its grant taken up."""
        self.requests.pop(tp, None)

    def members_seen(self, topic: str, members: list[str]) -> bool:
        """True if the live members changed (a rebalance)."""
        changed = self.members.get(topic) != members
        if changed and topic in self.members:
            self.rebalances += 1
        self.members[topic] = members
        return changed

    def partitions_seen(self, topic: str, partitions: int | None) -> None:
        """The topic's partition count (None: the topic is gone or no longer subscribed)."""
        if partitions is None:
            self.partitions.pop(topic, None)
            self.members.pop(topic, None)
        else:
            self.partitions[topic] = partitions

    def granted(self, tp: TopicPartition, grant: Grant | None, sent_at: float) -> Owned:
        """A lease granted (orderly; its deadline counts from when the request was sent), or
        a concurrent partition taken up (grant None)."""
        lease = grant.lease if grant else None
        owned = Owned(tp, lease, sent_at + self.lease_ttl_s if lease else float("inf"))
        owned.renew_due = sent_at + self.renew_s
        owned.announced = lease is None
        owned.paused = tp in self.paused
        self.owned[tp] = owned
        return owned

    def set_paused(self, tp: TopicPartition, paused: bool) -> None:
        """pause()/resume() of `tp`: kept across hand-overs until resume(). pause() needs the
        partition held now (InvalidConfig otherwise, as Kafka's IllegalStateException);
        resume() of one held elsewhere now forgets the pause."""
        owned = self.owned.get(tp)
        if owned is None and (paused or tp not in self.paused):
            raise InvalidConfig(f"{tp[0]}/{tp[1]} is not assigned to {self.member}")
        if owned is not None:
            owned.paused = paused
        if paused:
            self.paused.add(tp)
        else:
            self.paused.discard(tp)

    def readable(self) -> list[TopicPartition]:
        """What poll() reads: held, told to on_assign, not paused."""
        return sorted(tp for tp, o in self.owned.items() if o.announced and not o.paused)

    def to_announce(self) -> list[Owned]:
        """Partitions granted whose on_assign is still to come (and still held), marked as
        being announced (announce_done() when on_assign returned)."""
        owneds = sorted(
            (
                o
                for o in self.owned.values()
                if not (o.announced or o.announcing or o.lost or o.revoked)
                and not (o.finishing or o.finished)
            ),
            key=lambda o: o.tp,
        )
        for owned in owneds:
            owned.announcing = True
        return owneds

    def announce_done(
        self, owneds: list[Owned]
    ) -> tuple[list[TopicPartition], list[TopicPartition]]:
        """on_assign returned for owneds: (those still held, to read; those handed over while it
        ran, whose on_revoke their _finish left to the announcer)."""
        start: list[TopicPartition] = []
        owed: list[TopicPartition] = []
        for owned in owneds:
            owned.announcing, owned.announced = False, True
            if owned.revoke_owed:
                owed.append(owned.tp)
            elif self.owned.get(owned.tp) is owned and not (owned.finishing or owned.finished):
                start.append(owned.tp)
        return start, owed

    def announce_abandoned(self, owneds: list[Owned]) -> None:
        """on_assign did not return (cancelled): the next run()/poll() announces them again."""
        for owned in owneds:
            owned.announcing = owned.revoke_owed = False

    def revoke_now(self, owned: Owned) -> bool:
        """A hand-over's on_revoke: True to tell it now; an on_assign still running for it
        (another thread or task) tells it when it returns."""
        if owned.announcing:
            owned.revoke_owed = True
        return owned.announced

    def renewed(self, tp: TopicPartition, sent_at: float) -> None:
        owned = self.owned.get(tp)
        if owned is not None:
            owned.deadline = sent_at + self.lease_ttl_s
            owned.renew_due = sent_at + self.renew_s

    def renew_failed(self, tp: TopicPartition, now: float) -> None:
        """No answer: keep the deadline (the partition stops by itself if none lands in time)."""
        owned = self.owned.get(tp)
        if owned is not None:
            owned.renew_due = now + min(0.1, self.renew_s / 3)

    def lost(self, tp: TopicPartition) -> bool:
        """The lease is gone; True if this is news."""
        owned = self.owned.get(tp)
        if owned is None or owned.lost:
            return False
        owned.lost = True
        return True

    def finished(self, tp: TopicPartition) -> None:
        owned = self.owned.pop(tp, None)
        if owned is not None:
            owned.finished = True

    def held(self) -> list[TopicPartition]:
        """The partitions held now and not being handed over."""
        return sorted(tp for tp, o in self.owned.items() if not (o.lost or o.revoked or o.finished))


def messages_by_partition(
    items: Iterable[Message | Iterable[Message]],
) -> dict[tuple[str, int], list[Message]]:
    """What ack() or tx.ack() was given (Messages, or iterables of them) grouped by partition;
    TypeError for anything else: an offset alone does not say its topic and partition."""
    by_tp: dict[tuple[str, int], list[Message]] = {}
    for item in items:
        if isinstance(item, Message):
            by_tp.setdefault((item.topic, item.partition), []).append(item)
            continue
        if isinstance(item, str | bytes) or not isinstance(item, Iterable):
            raise TypeError(f"ack takes Messages or iterables of them, not {type(item).__name__}")
        batch = item if type(item) is list else list(item)
        for kind in set(map(type, batch)):  # told apart in C: a poll() batch is thousands
            if not issubclass(kind, Message):
                raise TypeError(f"ack takes Messages or iterables of them, not {kind.__name__}")
        # runs of one partition (a poll() reads partition after partition), each taken whole
        for tp, run in groupby(batch, _TP):
            by_tp.setdefault(tp, []).extend(run)
    return by_tp


_TP = attrgetter("topic", "partition")
