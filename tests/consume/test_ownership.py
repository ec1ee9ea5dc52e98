"""The consumer's ownership core (redisq.consume.ownership.OwnershipCore) without a server: the
assignment every member computes alike, what due() asks a driver to do and when, the handling
margin before a lease's deadline, acquire request ids kept until answered, hand-overs on a
rebalance, pause() kept across a hand-over, and on_assign's announcements. Time is passed in,
so nothing here waits."""

from __future__ import annotations

import pytest

from redisq.consume.ownership import OwnershipCore, assign_partitions, held_partition
from redisq.errors import InvalidConfig
from redisq.protocol.group import Grant, Lease

TTL_MS = 3_000  # renew every second, stop handling 0.3 s before the deadline


def core(member: str = "a", *, orderly: bool = True) -> OwnershipCore:
    return OwnershipCore(
        member, orderly=orderly, lease_ttl_ms=TTL_MS, heartbeat_ms=500, metadata_max_age_ms=2_000
    )


def grant(partition: int, topic: str = "t") -> Grant:
    return Grant(Lease(topic, "g", partition, f"{partition + 1}:x"), "0-0", 0)


def seen(c: OwnershipCore, members: list[str], partitions: int = 4, topic: str = "t") -> None:
    c.partitions_seen(topic, partitions)
    c.members_seen(topic, members)


def test_every_member_computes_the_same_disjoint_complete_assignment() -> None:
    for count in range(1, 6):
        members = [f"m{i}" for i in range(count)]
        for partitions in range(0, 12):
            parts = [p for m in members for p in assign_partitions(partitions, members[::-1], m)]
            assert sorted(parts) == list(range(partitions))
            sizes = [len(assign_partitions(partitions, members, m)) for m in members]
            assert max(sizes) - min(sizes) <= 1
    assert assign_partitions(4, ["a", "b"], "stranger") == []


def test_due_asks_for_heartbeat_and_metadata_on_their_own_intervals() -> None:
    c = core()
    first = c.due(0.0)
    assert first.heartbeat and first.refresh_metadata
    assert not c.due(0.4).heartbeat
    assert c.due(0.5).heartbeat
    assert not c.due(1.9).refresh_metadata
    assert c.due(2.0).refresh_metadata


def test_orderly_acquires_its_share_and_concurrent_takes_every_partition() -> None:
    orderly = core("a")
    seen(orderly, ["a", "b"])
    assert orderly.due(0.0).acquire == [("t", 0), ("t", 1)]
    concurrent = core("a", orderly=False)
    seen(concurrent, ["a", "b"])
    assert concurrent.due(0.0).acquire == [("t", p) for p in range(4)]


def test_a_lease_is_renewed_a_third_into_its_ttl_and_handling_stops_before_its_deadline() -> None:
    c = core()
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=10.0)
    assert c.due(10.5).renew == []
    assert c.due(11.0).renew == [("t", 0)]
    assert c.may_handle(("t", 0), 12.6)
    assert not c.may_handle(("t", 0), 12.7)  # 0.3 s margin before 13.0
    assert c.handling_limit(("t", 0)) == pytest.approx(12.7)
    c.renewed(("t", 0), sent_at=12.0)  # the deadline counts from when the renewal was sent
    assert c.may_handle(("t", 0), 14.6)


def test_a_failed_renewal_keeps_the_deadline_and_retries_soon() -> None:
    c = core()
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=0.0)
    c.renew_failed(("t", 0), now=1.0)
    assert c.due(1.05).renew == []
    assert c.due(1.2).renew == [("t", 0)]
    assert not c.may_handle(("t", 0), 2.8)


def test_an_acquire_not_done_with_is_sent_again_with_its_request_id() -> None:
    c = core()
    first = c.acquire_request(("t", 0))
    assert c.acquire_request(("t", 0)) == first  # no answer yet: the same id
    c.answered(("t", 0))
    assert c.acquire_request(("t", 0)) != first


def test_an_acquire_no_longer_wanted_is_given_up_until_answered() -> None:
    c = core()
    seen(c, ["a"], partitions=2)
    request = c.acquire_request(("t", 1))
    seen(c, ["a", "b"], partitions=2)  # t/1 is b's now
    due = c.due(0.0)
    assert due.give_up == [(request, ("t", 1))]
    assert c.due(0.1).give_up == [(request, ("t", 1))]  # again, until answered
    c.given_up(request)
    assert c.due(0.2).give_up == []
    assert c.acquire_request(("t", 1)) != request


def test_a_rebalance_revokes_what_is_now_anothers_and_stops_its_handling() -> None:
    c = core()
    seen(c, ["a"], partitions=2)
    for p in (0, 1):
        c.granted(("t", p), grant(p), sent_at=0.0)
    assert c.members_seen("t", ["a", "b"])
    assert c.rebalances == 1
    due = c.due(0.1)
    assert due.hand_over == [("t", 1)]
    assert not c.may_handle(("t", 1), 0.1)
    assert c.may_handle(("t", 0), 0.1)
    assert c.held() == [("t", 0)]
    c.finished(("t", 1))
    assert c.due(0.2).hand_over == []
    assert not c.members_seen("t", ["a", "b"])  # no change, no rebalance


def test_a_lost_lease_is_news_once_and_stops_handling() -> None:
    c = core()
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=0.0)
    assert c.lost(("t", 0))
    assert not c.lost(("t", 0))
    assert not c.may_handle(("t", 0), 0.1)
    assert c.held() == []


def test_stopping_hands_everything_over_and_heartbeats_no_more() -> None:
    c = core()
    seen(c, ["a"], partitions=2)
    for p in (0, 1):
        c.granted(("t", p), grant(p), sent_at=0.0)
    c.stopping = True
    due = c.due(5.0)
    assert due.hand_over == [("t", 0), ("t", 1)]
    assert not due.heartbeat and not due.refresh_metadata and due.acquire == []


def test_a_pause_is_kept_across_a_hand_over_until_resume() -> None:
    c = core()
    with pytest.raises(InvalidConfig, match="not assigned"):
        c.set_paused(("t", 0), True)
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=0.0)
    c.set_paused(("t", 0), True)
    c.finished(("t", 0))
    assert c.granted(("t", 0), grant(0), sent_at=1.0).paused  # granted again: still paused
    c.set_paused(("t", 0), False)
    c.finished(("t", 0))
    assert not c.granted(("t", 0), grant(0), sent_at=2.0).paused


def test_nothing_is_read_before_on_assign_returns() -> None:
    c = core()
    seen(c, ["a"], partitions=2)
    for p in (0, 1):
        c.granted(("t", p), grant(p), sent_at=0.0)
    assert c.readable() == []
    owneds = c.to_announce()
    assert [o.tp for o in owneds] == [("t", 0), ("t", 1)]
    assert c.to_announce() == []  # being announced
    assert c.readable() == []
    start, owed = c.announce_done(owneds)
    assert (start, owed) == ([("t", 0), ("t", 1)], [])
    assert c.readable() == [("t", 0), ("t", 1)]


def test_a_partition_revoked_while_on_assign_runs_is_told_to_on_revoke_after_it() -> None:
    c = core()
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=0.0)
    owneds = c.to_announce()
    assert not c.revoke_now(owneds[0])  # on_assign is running: it tells on_revoke
    c.finished(("t", 0))
    assert c.announce_done(owneds) == ([], [("t", 0)])


def test_an_abandoned_announcement_is_made_again() -> None:
    c = core()
    seen(c, ["a"], partitions=1)
    c.granted(("t", 0), grant(0), sent_at=0.0)
    owneds = c.to_announce()
    c.announce_abandoned(owneds)
    assert [o.tp for o in c.to_announce()] == [("t", 0)]


def test_a_partition_number_must_be_an_int_of_the_only_topic() -> None:
    assert held_partition(["t"], 2, "a") == ("t", 2)
    assert held_partition(["t", "u"], ("u", 1), "a") == ("u", 1)
    for bad in (True, 1.0):
        with pytest.raises(InvalidConfig, match="not assigned"):
            held_partition(["t"], bad, "a")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="several topics"):
        held_partition(["t", "u"], 1, "a")
