"""model/counting.py, no server: what a batch entry's fields say about the messages before and
up to a position (DESIGN §14.6)."""

from __future__ import annotations

from redisq.model.counting import (
    batch_counts,
    entries_to_keep,
    messages_through,
    retained_messages,
)

BATCH = {b"b": b"blob", b"n": b"5", b"c": b"40", b"p": b"7"}


def test_batch_counts() -> None:
    assert batch_counts(BATCH) == (5, 40)
    assert batch_counts([b"b", b"blob", b"n", b"5", b"c", b"40"]) == (5, 40)
    assert batch_counts({b"b": b"blob", b"n": b"5"}) == (5, None)  # written before counters
    assert batch_counts({b"b": b"blob", b"n": b"5", b"c": b"x"}) == (5, None)
    assert batch_counts({b"v": b"a message"}) is None
    assert batch_counts({b"b": b"x", b"v": b"y", b"n": b"5"}) is None  # a message with a b
    assert batch_counts({b"n": b"5", b"b": b"x"}) is None  # b not first: not redisq's
    assert batch_counts({b"b": b"x", b"n": b"0"}) is None
    assert batch_counts({b"b": b"x", b"n": b"-1"}) is None
    assert batch_counts([]) is None


def test_messages_through() -> None:
    # the entry 100-10 holds the offsets 100-10 .. 100-14, after 40 messages
    assert messages_through("100-10", BATCH, "100-10", whole=False) == 41
    assert messages_through("100-10", BATCH, "100-12", whole=False) == 43
    assert messages_through("100-10", BATCH, "100-14", whole=False) == 45
    assert messages_through("100-10", BATCH, "100-99", whole=False) == 45  # past its end
    assert messages_through("100-10", BATCH, "101-0", whole=False) == 45
    assert messages_through("100-10", BATCH, "100-10", whole=True) == 45
    assert messages_through("100-10", {b"b": b"x", b"n": b"5"}, "100-11", whole=False) is None
    assert messages_through("100-10", {b"v": b"m"}, "100-10", whole=True) is None


def test_retained_messages() -> None:
    assert retained_messages(45, 1, ("100-10", BATCH)) == 5
    assert retained_messages(None, 1, ("100-10", BATCH)) is None
    assert retained_messages(45, 1, ("100-10", {b"v": b"m"})) is None
    assert retained_messages(None, 0, None) == 0  # empty


def test_entries_to_keep() -> None:
    first = ("100-0", {b"b": b"x", b"n": b"25", b"c": b"0"})
    last = ("200-0", {b"b": b"x", b"n": b"25", b"c": b"975"})
    assert entries_to_keep(200, 1000, 40, first, last) == 8
    single = ("300-0", {b"b": b"x", b"n": b"1", b"c": b"999"})  # small after large batches
    assert entries_to_keep(200, 1000, 40, first, single) == 200
    assert entries_to_keep(200, None, 40, first, last) == 200  # nothing counted: per entry one
    assert entries_to_keep(0, 1000, 40, first, last) == 0
