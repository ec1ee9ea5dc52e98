"""protocol.redirect: which commands of a batch are sent again after a redirection. No server."""

from __future__ import annotations

from redis.exceptions import AskError, MovedError, TryAgainError

from redisq.protocol.redirect import FollowedBatch

READ = ("XREADGROUP", "GROUP", "g", "m", "COUNT", 1, "STREAMS", "{t}:0", ">")
ACK = ("XACK", "{t}:0", "g", "1-0")
HDEL = ("HDEL", "{t}:settled", "1-0")


def test_only_the_commands_that_met_a_redirection_are_sent_again() -> None:
    batch = FollowedBatch([ACK, HDEL, READ])
    assert batch.to_send(asked=False) == [ACK, HDEL, READ]
    entries = [[b"{t}:0", [[b"2-0", [b"b", b"x"]]]]]
    found = batch.took([1, AskError("1 127.0.0.1:7001"), entries], asked=False)
    assert found is not None and (found.kind, found.port) == ("ASK", 7001)
    # the read ran: sent again it would take the next entry and leave this one pending
    assert batch.to_send(asked=True) == [("ASKING",), ("MULTI",), HDEL, ("EXEC",)]
    assert batch.took([b"OK", b"OK", b"QUEUED", [0]], asked=True) is None
    assert batch.replies == [1, 0, entries]


def test_a_transaction_is_sent_again_whole() -> None:
    commands = [("MULTI",), ACK, READ, ("EXEC",)]
    batch = FollowedBatch(commands)
    aborted = TryAgainError("TRYAGAIN")
    assert batch.took([b"OK", b"QUEUED", b"QUEUED", aborted], asked=False) is not None
    assert batch.to_send(asked=False) == commands


def test_replies_left_as_they_are_once_the_budget_is_spent() -> None:
    batch = FollowedBatch([ACK, READ])
    moved = MovedError("1 127.0.0.1:7002")
    assert batch.took([moved, moved], asked=False) is not None
    assert batch.to_send(asked=False) == [ACK, READ]
    assert batch.replies == [moved, moved]  # what the caller gets if it stops here
