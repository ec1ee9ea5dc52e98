"""consume.settling: which entry IDs a concurrent member XACKs as it settles messages of batch
entries (DESIGN §14.8). No server."""

from __future__ import annotations

from redisq.consume.settling import EntrySettling
from redisq.model.batches import encode_batch


def batch(entry_id: bytes, n: int) -> tuple[bytes, list[bytes]]:
    return (entry_id, [b"b", encode_batch([b"x"] * n), b"n", b"%d" % n, b"p", b"1"])


def test_an_entry_is_acked_with_its_last_message_and_a_message_entry_at_once() -> None:
    settling = EntrySettling()
    assert settling.given([batch(b"5-0", 3), batch(b"5-3", 2), (b"6-0", [b"v", b"x"])]) is None
    assert settling.settle_counted(["5-0", "5-1", "5-3", "6-0"]) == (["6-0"], 3, 0)
    assert settling.settle_counted(["5-4"]) == (["5-3"], 1, 1)
    assert settling.settle_counted(["5-2"]) == (["5-0"], 1, 1)
    assert len(settling) == 0


def test_acking_the_first_message_twice_never_acks_its_entry_early() -> None:
    """The first message's offset is the entry's ID: an XACK of it would settle all n."""
    settling = EntrySettling()
    settling.given([batch(b"7-10", 4)])
    assert settling.settle(["7-10"]) == []
    assert settling.settle(["7-10", "7-10"]) == []
    assert settling.settle_counted(["7-11", "7-12"]) == ([], 2, 0)
    assert settling.settle(["7-13"]) == ["7-10"]


def test_a_redelivery_to_the_member_leaves_out_what_it_settled() -> None:
    settling = EntrySettling()
    entries = [batch(b"5-0", 10)]
    settling.given(entries)
    settling.settle(["5-0", "5-8", "5-9"])
    assert settling.given(entries) == {"5-0": bytes([0b10000000, 0b11000000])}
    settling.settle([f"5-{i}" for i in range(1, 8)])
    assert settling.given(entries) is None  # settled whole: a new delivery counts anew
