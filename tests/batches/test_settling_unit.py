"""consume.settling: which entry IDs a concurrent member XACKs as it settles messages of batch
entries (DESIGN §14.8). No server."""

from __future__ import annotations

from redisq.consume.settling import FIRST_READ_ENTRIES, EntrySettling, EntrySizes, Settled
from redisq.model.batches import encode_batch


def batch(entry_id: bytes, n: int) -> tuple[bytes, list[bytes]]:
    return (entry_id, [b"b", encode_batch([b"x"] * n), b"n", b"%d" % n, b"p", b"1"])


def test_an_entry_is_acked_with_its_last_message_and_a_message_entry_at_once() -> None:
    settling = EntrySettling()
    assert settling.given([batch(b"5-0", 3), batch(b"5-3", 2), (b"6-0", [b"v", b"x"])]) is None
    assert settling.settle(["5-0", "5-1", "5-3", "6-0"]) == Settled(
        ["6-0"], 3, [], {"5-0": bytes([0b11000000]), "5-3": bytes([0b10000000])}
    )
    assert settling.settle(["5-4"]) == Settled(["5-3"], 1, ["5-3"], {})
    assert settling.settle(["5-2"]) == Settled(["5-0"], 1, ["5-0"], {})
    assert len(settling) == 0


def test_acking_the_first_message_twice_never_acks_its_entry_early() -> None:
    """The first message's offset is the entry's ID: an XACK of it would settle all n."""
    settling = EntrySettling()
    settling.given([batch(b"7-10", 4)])
    assert settling.settle(["7-10"]).ready == []
    assert settling.settle(["7-10", "7-10"]).ready == []
    assert settling.settle(["7-11", "7-12"]) == Settled([], 2, [], {"7-10": bytes([0b11100000])})
    assert settling.settle(["7-13"]).ready == ["7-10"]


def test_a_redelivery_to_the_member_leaves_out_what_it_settled() -> None:
    settling = EntrySettling()
    entries = [batch(b"5-0", 10)]
    settling.given(entries)
    settling.settle(["5-0", "5-8", "5-9"])
    assert settling.given(entries) == {"5-0": bytes([0b10000000, 0b11000000])}
    settling.settle([f"5-{i}" for i in range(1, 8)])
    assert settling.given(entries) is None  # settled whole: a new delivery counts anew


def test_a_claimer_takes_the_bitmap_a_dead_member_wrote() -> None:
    """The bitmap stored beside the pending list (written with the dead member's acks) leaves
    its settled messages out of the claimer's delivery; the claimer's own acks extend it."""
    dead = EntrySettling()
    entries = [batch(b"5-0", 10)]
    dead.given(entries)
    stored = dead.settle(["5-0", "5-3", "5-9"]).partial
    assert stored == {"5-0": bytes([0b10010000, 0b01000000])}
    claimer = EntrySettling()
    assert claimer.given(entries, stored) == stored
    left = [f"5-{i}" for i in (1, 2, 4, 5, 6, 7, 8)]
    assert claimer.settle(left[:-1]).partial == {"5-0": bytes([0b11111111, 0b01000000])}
    assert claimer.settle(left[-1:]) == Settled(["5-0"], 1, ["5-0"], {})


def test_a_bitmap_of_another_size_is_not_trusted() -> None:
    claimer = EntrySettling()
    assert claimer.given([batch(b"5-0", 10)], {"5-0": b"\xff"}) is None
    assert claimer.settle([f"5-{i}" for i in range(9)]).ready == []


def test_a_settle_whose_write_failed_is_sent_again_by_the_next_try() -> None:
    """The XACK of an entry settled whole (and a partial bitmap) fails on the wire: the next try
    with the same offsets XACKs the entry and writes the bitmap (without the undo it was taken
    for a repeat: the entry stayed pending and came back whole, every message twice)."""
    settling = EntrySettling()
    settling.given([batch(b"5-0", 3), batch(b"6-0", 4)])
    settling.settle(["5-0"])
    offsets = ["5-1", "5-2", "6-1"]
    try:
        with settling.settling(offsets) as settled:
            assert settled.ready == ["5-0"]
            raise ConnectionError("the write was lost")
    except ConnectionError:
        pass
    assert settling.settle(offsets) == Settled(["5-0"], 3, ["5-0"], {"6-0": bytes([0b01000000])})
    assert settling.given([batch(b"6-0", 4)]) == {"6-0": bytes([0b01000000])}


def test_a_first_read_is_sized_by_the_partition_counters() -> None:
    """run()'s first read of a partition: message entries hold one message each; batch entries
    the messages per entry the counters tell (m / e); without counters it is cut."""
    sizes = EntrySizes()
    sizes.expect("message-topic", "message")
    assert sizes.entries_to_run("message-topic", 64) == 64
    sizes.expect("batch-topic", "batch", [b"4000", b"40"])  # 100 messages per entry
    assert sizes.entries_to_run("batch-topic", 64) == 3  # about 4 x 64 messages
    sizes.expect("uncounted", "batch", [None, None])
    assert sizes.entries_to_run("uncounted", 64) == FIRST_READ_ENTRIES
    sizes.expect("single", "batch", [b"64", b"64"])  # batches of one message
    assert sizes.entries_to_run("single", 64) == 64
