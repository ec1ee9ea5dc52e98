"""The orderly consumer's I/O-free dispatch core without a server: where an owned partition is
read next (redisq.consume.dispatch.OrderlyPartition), what moves its position (handled in
order, acked as a prefix after poll(), a batch of lanes at its end) and what a commit carries;
parked keys holding their later messages back and released again; blocking at a malformed entry;
reads dropped when the position jumped (seek, hand-over); tx.ack's checks (transaction_inputs);
and how a worker cuts a read into lanes and chunks (redisq.consume.chunks). Time is passed in
where the core takes it."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest

from redisq.consume.chunks import admitted_chunks, lanes, lanes_end
from redisq.consume.dispatch import OrderlyPartition, still_given, transaction_inputs
from redisq.consume.ownership import messages_by_partition
from redisq.consume.reading import REST_MAX_AGE_S, ReadRest
from redisq.errors import AlreadyAcked, InvalidConfig, LeaseLost
from redisq.model.records import MalformedMessage, Message
from redisq.protocol.group import Grant, Lease
from redisq.protocol.transactions import InputPosition

LEASE = Lease("t", "g", 0, "1:x")
TP = ("t", 0)


def reader_at(position: str = "1-0", entries_read: int | None = 10, takeovers: int = 0) -> Any:
    return OrderlyPartition(Grant(LEASE, position, entries_read, takeovers))


def msg(offset: str, key: bytes | None = b"a", partition: int = 0) -> Message:
    return Message("t", partition, offset, key, b"v")


def bad(offset: str) -> MalformedMessage:
    return MalformedMessage("t", 0, offset, None, b"", reason="no value field 'v'")


def raw(offset: str, key: bytes = b"a") -> tuple[bytes, list[bytes]]:
    """A stream entry as XRANGE returns it."""
    return offset.encode(), [b"k", key, b"v", b"x"]


def offsets(messages: list[Message]) -> list[str]:
    return [m.offset for m in messages]


# -- where to read -------------------------------------------------------------------------------
def test_a_new_owner_reads_after_the_position_and_a_seek_reads_at_its_offset() -> None:
    reader = reader_at("5-3")
    assert reader.next_range() == ("5-3", False) and reader.wait_after() == "5-3"
    reader.seek("7-0")
    assert reader.next_range() == ("7-0", True)
    assert reader.wait_after() == "6-18446744073709551615"  # XREAD waits for 7-0 itself
    reader.seek("0-0")
    assert reader.wait_after() == "0-0"


def test_a_read_is_given_whole_in_order_and_the_next_read_starts_after_it() -> None:
    reader = reader_at("1-0")
    read = [msg("2-0", b"a"), msg("3-0", b"b"), msg("4-0", b"a")]
    assert reader.admit(read, 0.0) == read
    assert reader.next_range() == ("4-0", False)
    assert reader.done is None and reader.take_commit() is None  # read is not handled


def test_the_first_read_after_takeovers_marks_its_first_message_with_the_attempts() -> None:
    reader = reader_at("1-0", takeovers=2)  # two owners never got past the message after 1-0
    first = reader.admit([msg("2-0"), msg("3-0")], 0.0)
    assert [m.attempt for m in first] == [3, 1]
    assert [m.attempt for m in reader.admit([msg("4-0")], 0.0)] == [1]  # once only


def test_a_hand_back_returns_the_grant_position_only_if_nothing_was_given_out() -> None:
    untouched = reader_at("4-0")
    assert untouched.hand_back() == "4-0"
    untouched.admit([], 0.0)  # an empty read gives nothing out
    assert untouched.hand_back() == "4-0"
    used = reader_at("4-0")
    used.admit([msg("5-0")], 0.0)
    assert used.hand_back() is None


# -- what is done, what is committed -------------------------------------------------------------
def test_handled_messages_move_the_position_and_the_commit_counts_them() -> None:
    reader = reader_at("1-0", entries_read=10)
    read = reader.admit([msg("2-0"), msg("3-0"), msg("4-0")], 0.0)
    reader.handled(read[0], 1.0)
    reader.handled(read[1], 2.0)
    assert not reader.commit_due(1.9, 1.0) and reader.commit_due(2.0, 1.0)  # since the first
    commit = reader.take_commit()
    assert commit is not None and (commit.position, commit.entries_read) == ("3-0", 12)
    assert reader.take_commit() is None  # nothing new
    reader.committed(commit)
    reader.handled(read[2], 3.0)
    later = reader.take_commit()
    assert later is not None and (later.position, later.entries_read) == ("4-0", 13)
    assert later.seq == commit.seq + 1


def test_an_unknown_entries_read_commits_a_position_without_a_count() -> None:
    reader = reader_at("1-0", entries_read=None)
    [m] = reader.admit([msg("2-0")], 0.0)
    reader.handled(m, 0.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "2-0" and commit.entries_read is None


def test_a_commit_whose_answer_was_lost_goes_again_with_what_was_handled_since() -> None:
    reader = reader_at("1-0", entries_read=0)
    read = reader.admit([msg("2-0"), msg("3-0")], 0.0)
    reader.handled(read[0], 0.0)
    first = reader.take_commit()
    assert first is not None
    first_seq = first.seq
    reader.handled(read[1], 0.5)
    reader.commit_failed(first, 1.0)
    again = reader.take_commit()
    assert again is not None and (again.position, again.entries_read) == ("3-0", 2)
    assert again.seq > first_seq  # numbered anew: a late copy of the first is ignored
    reader.committed(again)
    assert reader.committed_at == "3-0"


def test_a_superseded_commit_keeps_its_records_but_not_its_position() -> None:
    reader = reader_at("1-0")
    read = reader.admit([msg("2-0", b"k")], 0.0)
    reader.dead_lettered(read[0], park=True, malformed=False, now=0.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "2-0" and commit.parked == [(b"k", "2-0")]
    reader.commit_answered(commit, applied=False, now=1.0)  # a transaction's hold came first
    again = reader.take_commit()
    assert again is not None and again.position is None
    assert again.parked == [(b"k", "2-0")] and again.dead_letters == 1


# -- poll(): given out, acked ---------------------------------------------------------------------
def test_after_poll_the_position_moves_over_the_acked_prefix_only() -> None:
    reader = reader_at("1-0")
    read = reader.admit([msg("2-0"), msg("3-0"), msg("4-0")], 0.0)
    reader.given(read)
    assert reader.ack(["3-0"], 0.0) == 1
    assert reader.done is None  # 2-0 is still out: the position may not pass it
    assert reader.ack(["2-0"], 0.0) == 1
    assert reader.done == "3-0"
    assert reader.ack(["3-0", "9-0"], 0.0) == 0  # acked already, never given: counted 0
    assert reader.ack(["4-0"], 0.0) == 1 and reader.done == "4-0" and not reader.outstanding


def test_a_seek_drops_what_was_given_out_and_reads_from_its_offset() -> None:
    reader = reader_at("1-0")
    reader.given(reader.admit([msg("2-0"), msg("3-0")], 0.0))
    moves = reader.moves
    reader.seek("2-0")
    assert reader.moves == moves + 1 and not reader.outstanding
    assert reader.ack(["2-0"], 0.0) == 0 and reader.done is None  # given before the seek


def test_a_read_that_was_in_flight_when_the_position_jumped_is_dropped() -> None:
    reader = reader_at("1-0")
    moves = reader.moves
    reader.seek("9-0")
    assert reader.admit_unless_moved([msg("2-0")], 0.0, moves) == []
    assert reader.next_range() == ("9-0", True)
    assert reader.admit_unless_moved([msg("9-0")], 0.0, reader.moves) == [msg("9-0")]


def test_poll_gives_nothing_of_a_partition_whose_position_moved_while_it_went_on() -> None:
    kept, moved = reader_at(), reader_at()
    batches = [
        (kept, kept.moves, [msg("2-0")]),
        (moved, moved.moves, [msg("5-0")]),
        (None, 0, [msg("7-0", partition=1)]),  # a concurrent group's partition: no reader
    ]
    moved.seek("3-0")
    assert offsets(still_given(batches)) == ["2-0", "7-0"]


def test_screened_malformed_entries_are_passed_with_the_messages_before_them() -> None:
    reader = reader_at("1-0")
    read = reader.admit([msg("2-0"), bad("3-0"), msg("4-0")], 0.0)
    assert reader.screened(read, ["3-0"], None, 0.0, reader.moves)
    assert reader.done is None  # 3-0 dead-lettered and acked, but 2-0 is still out
    reader.ack(["2-0"], 0.0)
    assert reader.done == "3-0"
    commit = reader.take_commit()
    assert commit is not None and (commit.dead_letters, commit.malformed) == (1, 1)


def test_a_screening_finished_after_the_position_moved_records_nothing() -> None:
    reader = reader_at("1-0")
    moves = reader.moves
    read = reader.admit([msg("2-0"), bad("3-0")], 0.0)
    reader.seek("1-0")
    assert not reader.screened(read[:1], [], "3-0", 0.0, moves)
    assert not reader.outstanding and reader.blocked is None
    commit = reader.take_commit()
    assert commit is not None and commit.clear_blocked  # the mark it wrote is cleared


# -- blocking on a malformed entry ---------------------------------------------------------------
def test_a_block_reads_again_from_the_entry_and_is_shown_once() -> None:
    reader = reader_at("1-0")
    reader.admit([msg("2-0"), bad("3-0"), msg("4-0")], 0.0)
    assert reader.block_on("3-0")
    assert reader.next_range() == ("3-0", True) and reader.blocked == "3-0"
    reader.admit([bad("3-0")], 1.0)  # read again: still there
    assert not reader.block_on("3-0")
    assert reader.blocked == "3-0"


def test_a_blocked_entry_that_is_gone_unblocks_the_partition() -> None:
    reader = reader_at("1-0")
    reader.admit([msg("2-0"), bad("3-0")], 0.0)
    reader.block_on("3-0")
    reader.admit([msg("4-0")], 1.0)  # deleted or trimmed: the read starts after it
    assert reader.blocked is None
    commit = reader.take_commit()
    assert commit is not None and commit.clear_blocked


def test_a_dead_letter_clears_the_block() -> None:
    reader = reader_at("1-0")
    [m] = reader.admit([bad("3-0")], 0.0)
    reader.block_on("3-0")
    reader.dead_lettered(m, park=False, malformed=True, now=0.0)
    commit = reader.take_commit()
    assert reader.blocked is None and commit is not None
    assert (commit.position, commit.clear_blocked, commit.malformed) == ("3-0", True, 1)


def test_a_pause_reads_again_from_where_handling_stopped_unless_a_seek_came_first() -> None:
    reader = reader_at("1-0")
    moves = reader.moves
    reader.admit([msg("2-0"), msg("3-0")], 0.0)
    reader.stopped_before("3-0", moves)
    assert reader.next_range() == ("3-0", True)
    reader.seek("8-0")
    reader.stopped_before("3-0", moves)
    assert reader.next_range() == ("8-0", True)


# -- parked keys ---------------------------------------------------------------------------------
def test_a_parked_key_holds_its_later_messages_and_other_keys_go_on_in_order() -> None:
    reader = reader_at("1-0")
    [first] = reader.admit([msg("2-0", b"K")], 0.0)
    reader.dead_lettered(first, park=True, malformed=False, now=0.0)
    read = [msg("3-0", b"A"), msg("4-0", b"K"), msg("5-0", b"B"), msg("6-0", None)]
    admitted = reader.admit(read, 1.0)
    assert offsets(admitted) == ["3-0", "5-0", "6-0"]  # keyless messages are never held
    for m in admitted:
        reader.handled(m, 1.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "6-0"
    assert commit.parked == [(b"K", "2-0")] and commit.held == [("4-0", b"K")]
    assert commit.entries_read == 10 + 5  # the held message counts as read


def test_the_position_passes_a_held_message_only_after_the_messages_before_it() -> None:
    reader = reader_at("1-0")
    reader.parked = {b"K"}
    read = reader.admit([msg("2-0", b"A"), msg("3-0", b"K"), msg("4-0", b"B")], 0.0)
    reader.given(read)  # poll(): passed as the caller acks
    reader.ack(["4-0"], 0.0)
    assert reader.done is None
    reader.ack(["2-0"], 0.0)
    assert reader.done == "4-0" and reader.done_count == 3


def test_released_keys_free_their_held_messages_in_offset_order() -> None:
    reader = reader_at("1-0")
    reader.parked_loaded({b"K": b"2-0", b"L": b"3-0"}, {b"9-0": b"K", b"5-0": b"L", b"4-0": b"K"})
    assert reader.released([b"L"]) == ["4-0", "9-0"]  # K released, L still parked
    assert reader.released([]) == ["4-0", "5-0", "9-0"]
    assert reader.released([], limit=2) == ["4-0", "5-0"]
    assert reader.parked_check_due(100.0)  # more than the limit: the next check is due at once


def test_a_key_parked_here_stays_parked_until_its_commit_is_applied() -> None:
    reader = reader_at("1-0")
    [m] = reader.admit([msg("2-0", b"K")], 0.0)
    reader.dead_lettered(m, park=True, malformed=False, now=0.0)
    reader.admit([msg("3-0", b"K")], 0.0)
    assert reader.released([]) == []  # Redis does not know it yet: not released
    commit = reader.take_commit()
    assert commit is not None
    assert reader.released([]) == []  # the commit is on the wire
    reader.committed(commit)
    assert reader.released([]) == ["3-0"]


def test_a_released_message_handled_is_recorded_and_does_not_move_the_position() -> None:
    reader = reader_at("1-0")
    reader.parked_loaded({b"K": b"2-0"}, {b"3-0": b"K"})
    reader.admit([msg("4-0", b"A")], 0.0)
    reader.handled(msg("4-0", b"A"), 0.0)
    assert reader.released([]) == ["3-0"]
    reader.handled(msg("3-0", b"K"), 1.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "4-0" and commit.unheld == ["3-0"]
    assert reader.released([]) == []


def test_parked_keys_are_checked_at_most_once_a_second_and_only_while_any() -> None:
    reader = reader_at()
    assert not reader.parked_check_due(0.0)
    reader.parked_loaded({b"K": b"2-0"}, {})
    assert reader.parked_check_due(0.0)
    assert not reader.parked_check_due(0.99)
    assert reader.parked_check_due(1.0)


def test_the_dead_letter_that_parked_a_key_is_passed_not_held() -> None:
    reader = reader_at("1-0")
    reader.parked_loaded({b"K": b"2-0"}, {})  # parked by 2-0 before this owner's grant
    admitted = reader.admit([msg("2-0", b"K"), msg("3-0", b"K"), msg("4-0", b"A")], 0.0)
    assert offsets(admitted) == ["4-0"]
    commit = reader.take_commit()
    assert commit is not None and commit.held == [("3-0", b"K")]  # 2-0 is no held message


# -- lanes (key_concurrency) ---------------------------------------------------------------------
def test_lanes_keep_each_key_in_one_lane_in_order() -> None:
    keys = [b"a", b"b", b"c", b"d", b"a", b"c", b"b", b"a"]
    read = [msg(f"{i + 2}-0", key) for i, key in enumerate(keys)]
    split = lanes(read, 3)
    assert len(split) > 1 and all(split)  # different keys run in parallel; no empty lane
    assert sorted(offsets([m for lane in split for m in lane])) == sorted(offsets(read))
    for key in set(keys):
        holding = [lane for lane in split if any(m.key == key for m in lane)]
        assert len(holding) == 1
        assert [m for m in holding[0] if m.key == key] == [m for m in read if m.key == key]


def test_keyless_messages_spread_over_the_lanes_and_one_lane_keeps_the_read() -> None:
    read = [msg(f"{i + 2}-0", None) for i in range(6)]
    assert [offsets(lane) for lane in lanes(read, 3)] == [
        ["2-0", "5-0"],
        ["3-0", "6-0"],
        ["4-0", "7-0"],
    ]
    assert lanes(read, 1) == [read]
    assert lanes([], 4) == []


def test_lanes_stop_short_of_the_first_malformed_entry_when_the_policy_blocks() -> None:
    read = [msg("2-0"), msg("3-0"), bad("4-0"), msg("5-0"), bad("6-0")]
    assert lanes_end(read, blocks_malformed=True) == 2
    assert lanes_end(read, blocks_malformed=False) == 5  # dead-lettered in their lanes
    assert lanes_end([bad("2-0")], blocks_malformed=True) == 0
    assert lanes_end(read[:2], blocks_malformed=True) == 2


def test_a_batch_of_lanes_moves_the_position_to_its_end_once_handled() -> None:
    reader = reader_at("1-0", entries_read=0)
    reader.parked = {b"K"}
    read = [msg("2-0", b"A"), msg("3-0", b"K"), msg("4-0", b"B"), msg("5-0", b"K")]
    admitted = reader.admit(read, 0.0)
    assert offsets(admitted) == ["2-0", "4-0"]
    assert reader.done is None  # lanes do not move it per message
    reader.handled_through("4-0", len(admitted), 1.0)
    commit = reader.take_commit()
    assert commit is not None and (commit.position, commit.entries_read) == ("5-0", 4)


def test_a_key_parked_in_a_lane_holds_the_rest_of_its_messages_of_the_batch() -> None:
    reader = reader_at("1-0")
    batch = reader.admit([msg("2-0", b"K"), msg("3-0", b"A"), msg("4-0", b"K")], 0.0)
    reader.dead_lettered_in_lane(batch[0], park=True, malformed=False)
    assert reader.done is None  # the batch's end moves the position
    assert reader.hold_if_parked(batch[2], 0.0, advance=False)
    assert not reader.hold_if_parked(batch[1], 0.0, advance=False)
    reader.handled_through("4-0", 3, 0.0)
    commit = reader.take_commit()
    assert commit is not None and commit.position == "4-0" and commit.dead_letters == 1
    assert commit.parked == [(b"K", "2-0")] and commit.held == [("4-0", b"K")]


# -- chunks --------------------------------------------------------------------------------------
def test_a_read_is_given_chunk_by_chunk_and_its_entries_dropped_as_given() -> None:
    reader = reader_at("1-0")
    entries: list[Any] = [raw(f"{i}-0") for i in range(2, 9)]  # 7 entries
    chunks = admitted_chunks(reader, entries, 3, nullcontext(), reader.moves)
    first = next(chunks)
    assert offsets(first) == ["2-0", "3-0", "4-0"]
    assert reader.next_range() == ("8-0", False)  # admitted whole: the next read is after it
    assert entries[:3] == [None] * 3 and entries[3] is not None
    assert [offsets(c) for c in chunks] == [["5-0", "6-0", "7-0"], ["8-0"]]
    assert entries == [None] * 7


def test_a_read_whose_position_jumped_in_flight_is_dropped_whole() -> None:
    reader = reader_at("1-0")
    moves = reader.moves
    reader.seek("5-0")
    entries: list[Any] = [raw("2-0"), raw("3-0")]
    assert list(admitted_chunks(reader, entries, 1, nullcontext(), moves)) == []
    assert reader.next_range() == ("5-0", True)


@pytest.mark.parametrize("parked", [set(), {b"Z"}])  # decoded chunk by chunk, or whole
def test_chunks_not_given_yet_are_dropped_when_the_position_jumps(parked: set[bytes]) -> None:
    reader = reader_at("1-0")
    reader.parked = parked
    entries: list[Any] = [raw(f"{i}-0") for i in range(2, 9)]
    chunks = admitted_chunks(reader, entries, 3, nullcontext(), reader.moves)
    assert offsets(next(chunks)) == ["2-0", "3-0", "4-0"]
    reader.seek("3-0")  # the handler (or another thread) sought
    assert list(chunks) == []
    assert reader.next_range() == ("3-0", True)


def test_with_a_key_parked_the_read_is_admitted_whole_and_its_messages_held() -> None:
    reader = reader_at("1-0")
    reader.parked = {b"K"}
    entries: list[Any] = [raw("2-0", b"A"), raw("3-0", b"K"), raw("4-0", b"A"), raw("5-0", b"B")]
    got = [offsets(c) for c in admitted_chunks(reader, entries, 2, nullcontext(), reader.moves)]
    assert got == [["2-0", "4-0"], ["5-0"]]
    assert reader.held == {"3-0": b"K"}


# -- what ack() and tx.ack() take ----------------------------------------------------------------
def test_acks_are_grouped_by_partition_in_the_order_given() -> None:
    a, b, c = msg("2-0"), msg("3-0", partition=1), msg("4-0")
    assert messages_by_partition([a, [b, c]]) == {("t", 0): [a, c], ("t", 1): [b]}
    assert messages_by_partition([(m for m in [c])]) == {("t", 0): [c]}


def test_one_partitions_list_is_kept_whole_and_a_bad_item_in_it_is_still_refused() -> None:
    batch = [msg(f"{i}-0") for i in range(2, 6)]
    grouped = messages_by_partition([batch])
    assert grouped == {("t", 0): batch} and grouped[("t", 0)] is not batch  # a copy
    other = Message("u", 0, "9-0", None, b"v")  # same partition number, another topic
    assert messages_by_partition([[batch[0], other]]) == {("t", 0): [batch[0]], ("u", 0): [other]}
    with pytest.raises(TypeError, match="not str"):
        messages_by_partition([[*batch, "6-0"]])  # type: ignore[list-item]


@pytest.mark.parametrize("item", ["2-0", b"2-0", 7, ["2-0"], [msg("2-0"), None]])
def test_an_ack_of_anything_but_messages_is_a_type_error(item: object) -> None:
    with pytest.raises(TypeError):
        messages_by_partition([item])  # type: ignore[list-item]


# -- poll() cut at max_messages: the rest of the read ---------------------------------------------
def test_the_rest_of_a_cut_read_is_given_only_while_the_reader_stands_where_it_was_cut() -> None:
    read = [msg(f"5-{i}") for i in range(6)]
    rest = ReadRest()
    reader = reader_at("4-0")
    reader.given(reader.admit(read[:2], 0.0, boundary=False))
    rest.keep(reader, read, 2, 0.0)
    reader.ack(offsets(read[:2]), 0.0)  # acks move the commit position, not the read
    assert rest.take(reader, 0.5) == (read, 2, 0.0)
    assert rest.take(reader, 0.5) is None  # taken once
    rest.keep(reader, read, 2, 0.0)
    assert rest.take(reader, REST_MAX_AGE_S + 0.1) is None  # its lease check is too old
    rest.keep(reader, read, 2, 0.0)
    assert rest.take(reader_at("4-0"), 0.5) is None  # another grant of the partition
    rest.keep(reader, read, 2, 0.0)
    reader.seek("5-1")  # read again from there: the rest no longer follows the position
    assert rest.take(reader, 0.5) is None
    again = reader_at("4-0")
    again.admit(read[:2], 0.0, boundary=False)
    rest.keep(again, read, 2, 0.0)
    again.stopped_before("5-0", again.moves)  # the position moved without a jump
    assert rest.take(again, 0.5) is None


def test_an_ack_of_everything_given_moves_the_position_to_its_last_and_counts_each() -> None:
    reader = reader_at("1-0")
    read = [msg("2-0"), msg("3-0"), msg("4-0")]
    reader.given(reader.admit(read, 0.0))
    assert reader.ack(["4-0", "2-0", "9-0", "2-0"], 1.0) == 2  # 9-0 not given, 2-0 twice
    assert reader.done == "2-0"  # the acked prefix: 3-0 is still out
    assert reader.ack(["3-0"], 2.0) == 1
    assert (reader.done, reader.done_count, list(reader.outstanding)) == ("4-0", 3, [])
    with_held = reader_at("1-0")
    with_held.given(with_held.admit(read, 0.0))
    with_held.held["3-0"] = b"a"  # given after its key was released: taken off when acked
    with_held.ack(offsets(read), 1.0)
    assert (with_held.done, with_held.done_count, with_held.held) == ("4-0", 2, {})
    assert with_held.pending.unheld == ["3-0"]


# -- transactions --------------------------------------------------------------------------------
def polled(reader: Any, *messages: Message) -> list[Message]:
    read = reader.admit(list(messages), 0.0)
    reader.given(read)
    return read


def test_a_transaction_commits_the_position_over_what_it_acks() -> None:
    reader = reader_at("1-0", entries_read=10)
    read = polled(reader, msg("2-0"), msg("3-0"))
    inputs = transaction_inputs({TP: reader}, lambda tp: False, "g", read, "tx1", 1.0)
    [(lease, position)] = inputs
    assert lease is LEASE
    assert position == InputPosition("g", "t", 0, "3-0", 12)
    assert reader.take_commit() is None  # the transaction carries the position
    reader.transaction_ended("3-0", 12, committed=True)
    assert reader.committed_at == "3-0" and reader.transaction is None


def test_an_aborted_transaction_reads_again_from_the_committed_position() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"), msg("3-0"))
    transaction_inputs({TP: reader}, lambda tp: False, "g", read, "tx1", 1.0)
    reader.transaction_ended("3-0", None, committed=False)
    assert reader.next_range() == ("1-0", False) and not reader.outstanding
    assert reader.take_commit() is None  # nothing was committed, nothing handled


def test_a_transaction_acks_a_prefix_of_what_was_given_out() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"), msg("3-0"))
    with pytest.raises(InvalidConfig, match="in order"):
        transaction_inputs({TP: reader}, lambda tp: False, "g", read[1:], "tx1", 0.0)
    assert reader.unacked == {"2-0", "3-0"} and reader.transaction is None  # nothing changed


def test_a_transaction_cannot_ack_what_was_acked_already() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"))
    reader.ack(["2-0"], 0.0)
    with pytest.raises(AlreadyAcked):
        transaction_inputs({TP: reader}, lambda tp: False, "g", read, "tx1", 0.0)


def test_a_transaction_over_a_partition_no_longer_held_changes_nothing() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"))
    other = msg("2-0", partition=1)
    with pytest.raises(LeaseLost):  # partition 1 has no reader: all checked before any ack
        transaction_inputs({TP: reader}, lambda tp: False, "g", [*read, other], "tx1", 0.0)
    assert reader.unacked == {"2-0"} and reader.transaction is None
    with pytest.raises(LeaseLost):
        transaction_inputs({TP: reader}, lambda tp: True, "g", read, "tx1", 0.0)
    stranger = reader_at("1-0")  # held anew: the message was polled under an earlier lease
    with pytest.raises(LeaseLost):
        transaction_inputs({TP: stranger}, lambda tp: False, "g", read, "tx1", 0.0)


def test_a_partition_in_one_transaction_refuses_another() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"), msg("3-0"))
    transaction_inputs({TP: reader}, lambda tp: False, "g", read[:1], "tx1", 0.0)
    with pytest.raises(ValueError, match="tx1"):
        transaction_inputs({TP: reader}, lambda tp: False, "g", read[1:], "tx2", 0.0)
    [(_, position)] = transaction_inputs({TP: reader}, lambda tp: False, "g", read[1:], "tx1", 0)
    assert position.position == "3-0"


def test_plain_commits_wait_for_the_open_transaction_that_carries_the_position() -> None:
    reader = reader_at("1-0", entries_read=10)
    read = polled(reader, msg("2-0"), msg("3-0"))
    transaction_inputs({TP: reader}, lambda tp: False, "g", read[:1], "tx1", 0.0)
    reader.ack(["3-0"], 1.0)  # consumer.ack() of the next one, while tx1 is open
    assert reader.commit_due(2.0, 1.0)
    assert reader.take_commit() is None  # it would move the group past tx1's inputs
    reader.transaction_ended("2-0", 11, committed=True)
    commit = reader.take_commit()
    assert commit is not None and (commit.position, commit.entries_read) == ("3-0", 12)


def test_a_transaction_cannot_ack_what_a_commit_in_flight_carries() -> None:
    reader = reader_at("1-0")
    read = polled(reader, msg("2-0"))
    reader.ack(["2-0"], 0.0)
    assert reader.take_commit() is not None  # on the wire, not answered yet
    with pytest.raises(AlreadyAcked):  # the lease is held: not LeaseLost
        transaction_inputs({TP: reader}, lambda tp: False, "g", read, "tx1", 0.0)
