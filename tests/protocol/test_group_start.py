"""Where a group that has not read a partition yet starts, and its lag there (I/O-free): a
group made with start="latest" starts after every entry of the millisecond it joined in, as
lua/join_group.lua stores it and lua/includes/group.lua creates the Redis consumer group."""

from __future__ import annotations

from redisq.protocol.group_view import start_id_of, start_position, unread_lag

LATEST_AT_100 = "100-18446744073709551615"  # join_group.lua's start id for a join at ms 100


def test_earliest_starts_before_everything_and_lags_by_the_length() -> None:
    assert start_id_of(None) == "0" and start_id_of("0-0") == "0"
    assert start_position("0", "100-3") == "0-0"
    assert unread_lag("0", 4, "99-0", "100-3") == 4


def test_latest_leaves_out_what_its_own_millisecond_held() -> None:
    # Entries 100-0 .. 100-3 were appended in the join's millisecond, before it.
    assert start_position(LATEST_AT_100, "100-3") == "100-3"
    assert unread_lag(LATEST_AT_100, 4, "100-0", "100-3") == 0
    # An entry of a later millisecond is new: it alone is the lag.
    assert start_position(LATEST_AT_100, "101-0") == LATEST_AT_100
    assert unread_lag(LATEST_AT_100, 1, "101-0", "101-0") == 1
    # Old and new entries both there: counted on the server (count_range), not guessed.
    assert unread_lag(LATEST_AT_100, 5, "100-0", "101-0") is None


def test_a_stored_start_that_is_not_a_stream_id_counts_as_earliest() -> None:
    assert start_id_of("garbage") == "0"
    assert start_id_of(LATEST_AT_100) == LATEST_AT_100
