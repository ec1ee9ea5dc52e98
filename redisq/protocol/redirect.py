"""A cluster's redirections met by a batch of commands written to one node's connection (the
consumers' reads and commits, partition.PartitionIO and its asyncio twin), decided here once for
both drivers: which redirection the replies carry, what to send next, after how long.

While a partition's slot migrates, its node answers ASK for a key that has moved (the command
did not run), TRYAGAIN for a command or transaction whose keys are split between the two nodes,
MOVED once the slot is handed over, and CLUSTERDOWN while a node is unreachable. None of these is
data; each means the command did not run there. A batch's commands touch one partition's keys,
but those are several keys (the stream, a group's settled bitmaps, a lease), which move one by
one: a batch that is not a transaction may meet a redirection in one command while the others
ran, and only those that did not run are sent again (FollowedBatch). Sent again whole, an
XREADGROUP that ran would run twice and the entries of its first run stay pending, never given.
Followed within a short budget, a migration costs a consumer a pause instead of a failed read,
a dropped lease and redelivered messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    ResponseError,
    TryAgainError,
)

# How long a batch is sent again while it meets redirections; then its replies go back to the
# caller as they are (an error reply it handles as before: read again later).
REDIRECT_BUDGET_S = 3.0
ASK_PAUSE_S = 0.01  # a blocking read runs without blocking inside MULTI: no tight loop on ASK
RETRY_FIRST_S = 0.02
RETRY_MAX_S = 0.25


@dataclass(frozen=True, slots=True)
class Redirection:
    kind: str  # "ASK", "MOVED", "TRYAGAIN", "CLUSTERDOWN" or "UNBLOCKED"
    host: str | None = None
    port: int | None = None

    def delay(self, attempt: int) -> float:
        """The pause before sending again (attempt 1, 2, ...): none for MOVED, a short one for
        ASK, exponential for the others (keys still moving, a node failing over)."""
        if self.kind == "MOVED":
            return 0.0
        if self.kind == "ASK":
            return ASK_PAUSE_S
        return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(attempt - 1, 8))


def redirection(replies: Sequence[Any]) -> Redirection | None:
    """The first redirection among a batch's replies, at the top or inside an EXEC's array."""
    for reply in replies:
        items = reply if isinstance(reply, list) else (reply,)
        for item in items:
            if isinstance(item, MovedError):  # before AskError: a MovedError is one
                return Redirection("MOVED", item.host, item.port)
            if isinstance(item, AskError):
                return Redirection("ASK", item.host, item.port)
            if isinstance(item, TryAgainError):
                return Redirection("TRYAGAIN")
            if isinstance(item, ClusterDownError):
                return Redirection("CLUSTERDOWN")
            if isinstance(item, ResponseError) and str(item).startswith("UNBLOCKED"):
                # XREADGROUP BLOCK whose stream was migrated away (deleted on this node): it
                # read nothing; sent again, it meets the ASK (or the error of a stream that is
                # really gone).
                return Redirection("UNBLOCKED")
    return None


def asking_batch(commands: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The batch for the node an ASK named: ASKING, then the commands as one MULTI/EXEC (a batch
    that is one already stays as it is). Inside MULTI, ASKING holds up to the EXEC, where the
    importing node checks every key of the transaction at once: TRYAGAIN while some have not
    moved yet. Sent one by one behind ASKING, a read of a key still on the other node would be
    answered as if the key did not exist (a lease read as lost, parked keys read as none)."""
    if commands and commands[0][0] == "MULTI":
        return [("ASKING",), *commands]
    return [("ASKING",), ("MULTI",), *commands, ("EXEC",)]


def asking_replies(commands: Sequence[tuple[Any, ...]], replies: Sequence[Any]) -> list[Any]:
    """The replies to asking_batch(commands), as replies to the commands themselves. A
    transaction that did not run (TRYAGAIN, EXECABORT) answers each command with the first
    error (a queued command's redirection comes before the EXEC's abort)."""
    if commands and commands[0][0] == "MULTI":
        return list(replies[1:])
    executed = replies[-1]
    if isinstance(executed, list) and len(executed) == len(commands):
        return list(executed)
    error = next((r for r in replies[1:] if isinstance(r, Exception)), executed)
    return [error] * len(commands)


def redirected(reply: Any) -> bool:
    """Whether a command's reply (or a transaction's) is a redirection: it did not run."""
    return redirection((reply,)) is not None


class FollowedBatch:
    """A batch's commands followed through redirections: what to send next (the commands whose
    replies were redirections: all of a transaction, which runs whole or not at all), and the
    replies so far, one per command."""

    def __init__(self, commands: Sequence[tuple[Any, ...]]) -> None:
        self.commands = list(commands)
        self.replies: list[Any] = [None] * len(self.commands)
        self._todo = list(range(len(self.commands)))
        self._transaction = bool(self.commands) and self.commands[0][0] == "MULTI"

    def to_send(self, asked: bool) -> list[tuple[Any, ...]]:
        """The commands still to send (behind ASKING in one MULTI/EXEC after an ASK)."""
        batch = [self.commands[i] for i in self._todo]
        return asking_batch(batch) if asked else batch

    def took(self, replies: Sequence[Any], asked: bool) -> Redirection | None:
        """The raw replies to to_send(asked): kept; the first redirection among them, if any
        (its commands are sent next)."""
        sent = [self.commands[i] for i in self._todo]
        if asked:
            replies = asking_replies(sent, replies)
        for i, reply in zip(self._todo, replies, strict=True):
            self.replies[i] = reply
        found = redirection(replies)
        if found is not None and not self._transaction:
            self._todo = [
                i for i, reply in zip(self._todo, replies, strict=True) if redirected(reply)
            ]
        return found
