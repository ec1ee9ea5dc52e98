"""The consumer's per-partition core for orderly groups: where to read, what may be handled,
what to commit. No I/O.

An orderly partition has one owner under a lease, so it is read like a log: by range from the
group's position, and the position is committed (commit_position.lua, under the lease) instead of
writing every entry to a pending-entries list and deleting it again. Handled messages move a
local position forward; it is committed every ack_interval_ms (and on hand-over and close), so
a crash or a takeover repeats at most what was handled since the last commit: at-least-once.

Keys parked by the park_key policy hold their later messages back: a held message is recorded
(offset -> key) with the next commit, so the position can move on past it once the messages
before it are handled, and it is handled once its key is released (run() and poll() alike).
Dead letters, parked keys and the blocked message change with the position, atomically.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from operator import attrgetter

from redisq.consume.ownership import messages_by_partition
from redisq.errors import AlreadyAcked, InvalidConfig, LeaseLost
from redisq.model.offsets import offset_before, offset_parts
from redisq.model.records import Message
from redisq.protocol.group import Commit, Grant, Lease
from redisq.protocol.transactions import InputPosition

OFFSET = attrgetter("offset")


class OrderlyPartition:
    """Reading and commit state of one owned partition of an orderly group."""

    def __init__(self, grant: Grant) -> None:
        self.lease: Lease = grant.lease
        self.tp = (grant.lease.topic, grant.lease.partition)
        self.read_from = grant.position  # the next read starts after it ...
        self.inclusive = False  # ... or at it, after a seek
        # The position is the last offset of an entry read (or nothing follows it): the next
        # read takes the entries after it. False after a grant, a seek, a re-read or a read cut
        # short, whose position may be inside a batch entry (DESIGN §14.7): the next read is a
        # resume read, which takes the rest of that entry first.
        self.at_boundary = False
        # Bumped when the position jumps (a seek, ...): a read issued before is dropped whole.
        self.moves = 0
        self.committed_at = grant.position  # the position the group holds in Redis
        self.entries_read = grant.entries_read  # at `committed` (None: unknown)
        self.done: str | None = None  # last handled offset not yet committed
        self.done_count = 0
        self.pending = Commit()
        self.uncommitted_since: float | None = None
        self.outstanding: deque[str] = deque()  # poll(): given to the caller, in order
        self.unacked: set[str] = set()  # of outstanding: not acked yet
        self.parked: set[bytes] = set()
        self.held: dict[str, bytes] = {}  # offset -> key of a message held behind a parked key
        # The read's held messages the position has not passed yet: offset of the message
        # read just before them -> (offset of the last of them, how many).
        self.held_after: dict[str, tuple[str, int]] = {}
        self.next_parked_check = 0.0
        # Offsets of the dead letters that parked the keys parked at the grant (a batch handled
        # in lanes may have stopped before the position passed one: it is passed, not held).
        self.parked_by: set[str] = set()
        self.blocked: str | None = None
        self.commit_in_flight: Commit | None = None
        self.commits = 0  # commits taken under this lease (their numbers)
        # The message after the position was handed to this many owners that never got past it.
        self.head_attempts = 1 + grant.takeovers
        self.granted_at = grant.position
        self.gave_out = False  # a message was given out (to a handler or poll's caller)
        # consume-transform-produce: the position an open transaction carries (plain commits
        # wait for it), and how many entries it moves over
        self.transaction: str | None = None
        self.tx_position: str | None = None
        self.tx_count = 0
        self.tx_acked: set[str] = set()  # offsets the open transaction acked
        self.tx_records = Commit()  # held messages and parked keys its hold records

    # -- reading ---------------------------------------------------------------------------------
    def next_range(self) -> tuple[str, bool]:
        """(offset, inclusive): where the next read starts (a resume read unless at_boundary)."""
        return self.read_from, self.inclusive

    def wait_after(self) -> str:
        """The ID a caught-up read waits after (XREAD takes only IDs after the one given): the
        position, or the ID just before it when the position is inclusive (after a seek)."""
        if not self.inclusive:
            return self.read_from
        return offset_before(self.read_from) or "0-0"  # no entry has ID 0-0

    def seek(self, offset: str) -> None:
        """Read from `offset` (inclusive) next; nothing given out is expected back any more. A
        block is cleared with the next commit (reading from the offset blocks again if it meets
        the entry again)."""
        self.read_from, self.inclusive, self.at_boundary = offset, True, False
        self.moves += 1
        self.outstanding.clear()
        self.unacked.clear()
        self.unblocked(time.monotonic())

    def reread_from(self, offset: str) -> None:
        """Read again from `offset` (inclusive): a malformed entry the policy blocks on."""
        self.read_from, self.inclusive, self.at_boundary = offset, True, False
        self.moves += 1

    def block_on(self, offset: str) -> bool:
        """Policy block, a malformed entry of the read being handled: read again from it. The
        lanes of one read may meet several, in any order: the partition blocks at the lowest
        (the others, and what follows them, are read again after it). True when it blocks on
        `offset` now and did not before: count and show it (mark_blocked) once, however long
        it blocks."""
        if self.inclusive and offset_parts(self.read_from) < offset_parts(offset):
            return False  # the read goes again from an earlier entry
        self.reread_from(offset)
        first = self.blocked != offset
        if first:  # shown anew: a clear still to be committed was for the entry before
            self.pending.clear_blocked = False
        self.blocked = offset
        return first

    def stopped_before(self, offset: str, moves: int) -> None:
        """pause(): the read issued at `moves` was handled up to `offset` (not included): read
        again from it, unless the position jumped since (a seek wins)."""
        if self.moves == moves:
            self.read_from, self.inclusive, self.at_boundary = offset, True, False

    def admit(self, messages: list[Message], now: float, *, boundary: bool = True) -> list[Message]:
        """Messages just read, in offset order: those of a parked key are held back (recorded
        with the next commit); the others are to be handled, in this order. The position
        passes a held message only once the messages read before it are done (handled, or
        acked after poll()): a commit meanwhile (close, hand-over, commit()) stays before them.
        boundary: False when the read was cut after messages[-1], inside an entry."""
        self.admit_read(messages, messages[-1].offset if messages else None, now, boundary=boundary)
        if not self.parked or not messages:
            return messages
        admitted: list[Message] = []
        self.held_after = {}
        for message in messages:
            if not self.hold_if_parked(message, now, advance=False):
                admitted.append(message)
            elif not admitted:  # what came before this read is done
                self._advance(message.offset, now)
            else:
                after = admitted[-1].offset
                count = self.held_after[after][1] if after in self.held_after else 0
                self.held_after[after] = (message.offset, count + 1)
        return admitted

    def hand_back(self) -> str | None:
        """The partition is being handed back (close, revoke): a read in flight is dropped, never
        given out. Returns the position the lease was granted at when this owner gave out no
        message from there (release_lease.lua takes its grant's takeover count back), else
        None."""
        self.moves += 1
        return None if self.gave_out else self.granted_at

    def screened(
        self, given: list[Message], passed: list[str], block_at: str | None, now: float, moves: int
    ) -> bool:
        """poll()'s read, its malformed entries seen to: `given` go to the caller, `passed`
        (dead-lettered) are acked, and a block at `block_at` reads again from there (block_on).
        False when the position moved since the read was sent (a seek, a hand-over): nothing is
        recorded and the caller drops the read; a block mark the screening wrote for it (on an
        entry this reader was not blocked at) is cleared with the next commit."""
        if self.moves != moves:
            if block_at is not None and block_at != self.blocked:
                self.pending.clear_blocked = True
                self._touch(now)
            return False
        self.given(given)
        self.pending.dead_letters += len(passed)
        self.pending.malformed += len(passed)
        self.ack(passed, now)
        if block_at is not None:
            self.block_on(block_at)
        return True

    def admit_unless_moved(
        self, messages: list[Message], now: float, moves: int, *, boundary: bool = True
    ) -> list[Message]:
        """admit() for poll(): its read, or nothing when the position jumped while the read was
        in flight (`moves`: the count when it was sent; a seek from another thread or task):
        the next poll() reads from where it jumped to."""
        if self.moves != moves:
            return []
        return self.admit(messages, now, boundary=boundary)

    def admit_read(
        self, head: list[Message], last: str | None, now: float, *, boundary: bool = True
    ) -> None:
        """admit() of a read given its first messages (head, possibly [] for an empty read)
        and the offset of its last message, for a read decoded as it is handled; the caller
        holds back parked keys' messages itself (or calls admit() when any key is parked).
        boundary: whether `last` ends an entry (a read of whole entries), else the next read
        resumes inside it."""
        if self.blocked is not None and self.inclusive and self.read_from == self.blocked:
            # Reading again from the entry a policy blocks on: gone (deleted or trimmed)?
            if not head or head[0].offset != self.blocked:
                self.unblocked(now)
        if not head or last is None:
            # Nothing after the position, not even in the entry holding it (a resume read).
            self.at_boundary = True
            return
        self.gave_out = True
        if self.head_attempts > 1 and self.read_from == self.committed_at and not self.inclusive:
            # The first read after the grant: its first message may be one no owner survived.
            head[0] = replace(head[0], attempt=self.head_attempts)
            self.head_attempts = 1
        self.read_from, self.inclusive, self.at_boundary = last, False, boundary

    def hold_if_parked(self, message: Message, now: float, *, advance: bool = True) -> bool:
        """Hold the message back if its key is parked (a key parked while its batch was being
        handled holds the rest of the batch's messages of that key too)."""
        if message.key is None or message.key not in self.parked:
            return False
        if message.offset in self.held or message.offset in self.parked_by:
            return True  # held already (by an earlier read or owner), or its dead letter
        self.held[message.offset] = message.key
        self.pending.held.append((message.offset, message.key))
        if advance:
            self._advance(message.offset, now)
        else:
            self._touch(now)
        return True

    def parked_loaded(self, parked: Mapping[bytes, bytes], held: Mapping[bytes, bytes]) -> None:
        """At the grant, as Redis has them: the parked keys (key -> offset of the dead letter
        that parked it) and the held messages (offset -> key)."""
        self.parked = set(parked)
        self.parked_by = {offset.decode() for offset in parked.values()}
        self.held = {offset.decode(): key for offset, key in held.items()}

    def parked_check_due(self, now: float) -> bool:
        """Time to ask Redis which keys are still parked (then released()): at most once a
        second while a key is parked or a message held, by run() and poll() alike, since a
        release (redisq dlq release, release_key) happens elsewhere."""
        if not (self.held or self.parked) or now < self.next_parked_check:
            return False
        self.next_parked_check = now + 1.0
        return True

    def released(self, parked_now: Iterable[bytes], limit: int | None = None) -> list[str]:
        """The parked keys now: offsets (in order) of held messages whose key was released,
        at most `limit` of them (the next check is then due at once)."""
        # Keys parked here but not committed yet are not in Redis's view: they stay parked.
        recent = {key for key, _ in self.pending.parked}
        if self.commit_in_flight is not None:
            recent.update(key for key, _ in self.commit_in_flight.parked)
        self.parked = set(parked_now) | recent
        free = [offset for offset, key in self.held.items() if key not in self.parked]
        free.sort(key=offset_parts)
        if limit is not None and len(free) > limit:
            self.next_parked_check = 0.0
            del free[limit:]
        self.gave_out = self.gave_out or bool(free)
        return free

    # -- handling --------------------------------------------------------------------------------
    def handled(self, message: Message, now: float) -> None:
        """One message handled (in offset order): the position may move past it."""
        offset = message.offset
        if offset in self.held:
            del self.held[offset]
            self.pending.unheld.append(offset)
            self._touch(now)
            return
        # _advance, inlined: run() calls this once per message
        self.done = offset
        self.done_count += 1
        if self.uncommitted_since is None:
            self.uncommitted_since = now
        if self.held_after:
            self._pass_held(offset)

    def handled_through(self, offset: str, count: int, now: float) -> None:
        """A batch handled in lanes (any order inside it): the position moves to its end."""
        self.done_count += count - 1
        self._advance(offset, now)

    def given(self, messages: list[Message]) -> None:
        """poll() handed these to the caller (orderly: nothing more until they are acked)."""
        offsets = list(map(OFFSET, messages))
        self.outstanding.extend(offsets)
        self.unacked.update(offsets)

    def ack(self, offsets: Iterable[str], now: float) -> int:
        """The caller acked these: the position moves over the acked prefix of what it got.
        Returns how many were acked now: an offset poll() did not give out (read elsewhere, or
        given before a seek) or acked already counts 0, as XACK counts it in concurrent mode; the
        position never moves over a message the caller was not given."""
        unacked = self.unacked
        before = len(unacked)
        unacked.difference_update(offsets)
        acked = before - len(unacked)
        if not unacked and not self.held and not self.held_after and self.outstanding:
            # all it gave was acked (ack(batch)): the position moves to the last of it at once
            self.done = self.outstanding[-1]
            self.done_count += len(self.outstanding)
            self.outstanding.clear()
            self._touch(now)
        while self.outstanding and self.outstanding[0] not in unacked:
            offset = self.outstanding.popleft()
            if offset in self.held:
                del self.held[offset]
                self.pending.unheld.append(offset)
                self._touch(now)
            else:
                self._advance(offset, now)
        return acked

    def dead_lettered(self, message: Message, *, park: bool, malformed: bool, now: float) -> None:
        """Copied to the dead-letter topic: counted, its key parked if asked, passed over."""
        self.pending.dead_letters += 1
        if malformed:
            self.pending.malformed += 1
        if park and message.key:
            self.parked.add(message.key)
            self.pending.parked.append((message.key, message.offset))
        if self.blocked is not None:
            self.blocked = None
            self.pending.clear_blocked = True
        self.handled(message, now)

    def dead_lettered_in_lane(self, message: Message, *, park: bool, malformed: bool) -> None:
        """As dead_lettered, for a message of a batch handled in lanes (key_concurrency): counted
        and its key parked now; the batch's end moves the position."""
        self.pending.dead_letters += 1
        if malformed:
            self.pending.malformed += 1
        if park and message.key:
            self.parked.add(message.key)
            self.pending.parked.append((message.key, message.offset))

    def unblocked(self, now: float) -> None:
        if self.blocked is not None:
            self.blocked = None
            self.pending.clear_blocked = True
            self._touch(now)

    def _advance(self, offset: str, now: float) -> None:
        self.done = offset
        self.done_count += 1
        self._touch(now)
        if self.held_after:
            self._pass_held(offset)

    def _pass_held(self, offset: str) -> None:
        """The position reached `offset`: it passes the held messages read right after it,
        and counts those read before it (a batch handled in lanes ends past them)."""
        at = offset_parts(offset)
        while self.held_after:
            after = next(iter(self.held_after))
            if offset_parts(after) > at:
                return
            last, count = self.held_after.pop(after)
            self.done_count += count
            if after == offset:
                self.done = last

    def _touch(self, now: float) -> None:
        if self.uncommitted_since is None:
            self.uncommitted_since = now

    # -- transactions ----------------------------------------------------------------------------
    def acked_here(self, offset: str) -> bool:
        """`offset` is one this reader's position moved over under its lease: after the grant's
        position, at or before what it handled (committed, being committed, or not)."""
        in_flight = self.commit_in_flight.position if self.commit_in_flight else None
        passed = self.done or in_flight or self.committed_at
        try:
            return offset_parts(self.granted_at) < offset_parts(offset) <= offset_parts(passed)
        except ValueError:  # a position that is not an ID yet (a new group's "$")
            return False

    def check_transactional_ack(self, tx_id: str, offsets: list[str]) -> None:
        """Before transaction tx_id acks `offsets` (nothing changed if it raises): each must be
        a message this reader gave out and nobody acked, or one tx_id acked already. A message
        polled under an earlier lease of the partition (lost, or handed over and taken again)
        is not one: the group may have moved past it meanwhile, so the transaction could not
        commit it once (LeaseLost). The acks must leave no gap: with what the caller acked
        before, they are a prefix of the messages given out, so the position the transaction
        commits covers every message it acks (InvalidConfig otherwise)."""
        topic, partition = self.tp
        if self.transaction not in (None, tx_id):
            raise ValueError(f"{topic}/{partition} is in transaction {self.transaction}")
        mine = self.tx_acked if self.transaction == tx_id else ()
        for offset in offsets:
            if offset in self.held:  # behind the position: its ack is a record, not a position
                raise InvalidConfig(
                    f"{topic}/{partition}: message {offset} was held behind a parked key and "
                    "released: a transaction commits positions and cannot take its ack; "
                    "ack it with consumer.ack()"
                )
            if offset not in self.unacked and offset not in mine and self.acked_here(offset):
                raise AlreadyAcked(
                    f"{topic}/{partition}: message {offset} was acknowledged already under "
                    "this lease (ack(), commit(), the auto-commit of a later poll() or "
                    "iteration, or an earlier transaction): the group's position is past it "
                    "and a transaction cannot commit it again (nothing was changed)"
                )
            if offset not in self.unacked and offset not in mine:
                raise LeaseLost(
                    f"{topic}/{partition}: message {offset} is not one this consumer holds "
                    "unacked (polled under an earlier lease of the partition, or acked "
                    "already): the transaction cannot commit it"
                )
        acking = set(offsets) & self.unacked
        gap = None
        for offset in self.outstanding:  # the position will move over these
            if offset in acking:
                acking.discard(offset)
            elif offset in self.unacked:  # the first message not acked: a gap before the rest
                gap = offset
                break
        if acking:
            raise InvalidConfig(
                f"{topic}/{partition}: a transaction acks messages in order: ack {gap} "
                "(given out before the others and not acked) with or before them"
            )

    def transactional_ack(
        self, tx_id: str, offsets: list[str], now: float
    ) -> tuple[str, int | None, Commit, int] | None:
        """The caller acked these within transaction tx_id (check_transactional_ack passed):
        the position moves over them as for ack(), but belongs to the transaction; (position,
        entries_read, records, number) it would commit. The records (held messages, parked
        keys and released ones so far) go with it: the position may pass a held message, which
        must be recorded before the position moves (tx_hold.lua). The hold is numbered after
        every plain commit taken so far, so none of them can land after it (late, or overtaken
        on the wire) and move the position back behind the transaction's."""
        self.ack(offsets, now)
        self.tx_acked.update(offsets)
        if self.done is not None:
            self.transaction = tx_id
            self.tx_position = self.done
            self.tx_count += self.done_count
            self.done, self.done_count = None, 0
        if self.tx_position is None:
            return None
        records, pending = self.tx_records, self.pending
        # A failed commit's position, sent again: the transaction's passes it (or, aborted,
        # hands out again from the committed one).
        pending.position = pending.entries_read = None
        records.parked += pending.parked
        records.held += pending.held
        records.unheld += pending.unheld
        pending.parked, pending.held, pending.unheld = [], [], []
        entries = None if self.entries_read is None else self.entries_read + self.tx_count
        copy = Commit(parked=[*records.parked], held=[*records.held], unheld=[*records.unheld])
        self.commits += 1
        return self.tx_position, entries, copy, self.commits

    def transaction_ended(self, position: str, entries_read: int | None, committed: bool) -> None:
        """Committed: the group is at `position` now. Aborted: read again from the committed
        position (what the transaction acked is handled again)."""
        if committed:
            self.committed_position(position, entries_read)
        else:
            self.read_from, self.inclusive, self.at_boundary = self.committed_at, False, False
            self.moves += 1
            self.outstanding.clear()
            self.unacked.clear()
            self.done, self.done_count = None, 0
            # Its hold may not have run: the next commit records them (again: idempotent).
            records, pending = self.tx_records, self.pending
            pending.parked[:0], pending.held[:0] = records.parked, records.held
            pending.unheld[:0] = records.unheld
            if records.parked or records.held or records.unheld:
                self._touch(time.monotonic())
        self.transaction, self.tx_position, self.tx_count = None, None, 0
        self.tx_acked.clear()
        self.tx_records = Commit()

    # -- committing ------------------------------------------------------------------------------
    def commit_due(self, now: float, interval_s: float) -> bool:
        return self.uncommitted_since is not None and now - self.uncommitted_since >= interval_s

    def take_commit(self) -> Commit | None:
        """What to commit now (None: nothing); `committed()` or `commit_failed()` follows."""
        if self.uncommitted_since is None and self.done is None:
            return None
        if self.transaction is not None:
            return None  # the transaction commits the position, or gives it back
        commit = self.pending
        if self.done is not None:
            commit.position = self.done
            if self.entries_read is not None:
                commit.entries_read = self.entries_read + self.done_count
        if commit.empty():
            self.uncommitted_since = None
            return None
        self.pending = Commit()
        self.done, self.done_count = None, 0
        self.uncommitted_since = None
        self.commit_in_flight = commit
        self.commits += 1
        commit.seq = self.commits  # numbered anew when a failed one is sent again
        return commit

    def commit_answered(self, commit: Commit, applied: bool, now: float) -> None:
        """Redis answered the commit: applied (committed) or not (commit_superseded)."""
        if applied:
            self.committed(commit)
        else:
            self.commit_superseded(commit, now)

    def committed(self, commit: Commit) -> None:
        if commit.position:
            self.committed_position(commit.position, commit.entries_read)
        self.commit_in_flight = None

    def committed_position(self, position: str, entries_read: int | None) -> None:
        self.committed_at = position
        self.entries_read = entries_read

    def commit_superseded(self, commit: Commit, now: float) -> None:
        """Redis applied a write numbered after this commit first (a transaction's hold of the
        partition, whose position passes this one's): nothing of it was applied; its records
        go again with the next commit, its position does not."""
        self.commit_failed(commit, now, passed=True)

    def commit_failed(self, commit: Commit, now: float, *, passed: bool = False) -> None:
        """The commit's answer was lost (it may have run): send it again with what came since
        (a position is idempotent; a count sent twice counts twice in describe_group). Its
        position is not sent again when a transaction's passes it (passed, or a transaction
        carries the position now): the group would go back behind the transaction's inputs."""
        self.commit_in_flight = None
        own = self.done is None  # else the position handled since replaces the commit's
        later = self.pending
        commit.dead_letters += later.dead_letters
        commit.malformed += later.malformed
        commit.clear_blocked = commit.clear_blocked or later.clear_blocked
        commit.parked += later.parked
        commit.held += later.held
        commit.unheld += later.unheld
        if self.done is not None:
            commit.position = self.done
            commit.entries_read = (
                None if commit.entries_read is None else commit.entries_read + self.done_count
            )
        self.done, self.done_count = commit.position, 0
        if commit.position is not None and commit.entries_read is not None:
            self.entries_read = commit.entries_read
        if own and (passed or self.transaction is not None):
            commit.position = commit.entries_read = self.done = None
        self.pending = commit
        self.uncommitted_since = now


def still_given(batches: list[tuple[OrderlyPartition | None, int, list[Message]]]) -> list[Message]:
    """poll()'s result: each partition's screened messages (with the reader's moves after they
    were screened), except a partition whose position moved since, while poll() went on to the
    others (a hand-over, a seek from another thread or task): its messages are not given out
    (the next owner, or the read from the seek's offset, gives them)."""
    return [
        message
        for reader, moves, messages in batches
        if reader is None or reader.moves == moves
        for message in messages
    ]


def transaction_inputs(
    readers: Mapping[tuple[str, int], OrderlyPartition],
    lost: Callable[[tuple[str, int]], bool],
    group: str,
    messages: Message | Iterable[Message],
    tx_id: str,
    now: float,
) -> list[tuple[Lease, InputPosition]]:
    """tx.ack (both consumer drivers): the input positions transaction tx_id would commit,
    with the leases it must still hold then; LeaseLost for a partition no longer held."""
    acks = []
    for tp, batch in messages_by_partition([messages]).items():  # all checked, then acked
        reader = readers.get(tp)
        if reader is None or lost(tp):
            raise LeaseLost(f"{tp[0]}/{tp[1]} is no longer held by this consumer")
        offsets = [m.offset for m in batch]
        reader.check_transactional_ack(tx_id, offsets)
        acks.append((tp, reader, offsets))
    inputs = []
    for tp, reader, offsets in acks:
        moved = reader.transactional_ack(tx_id, offsets, now)
        if moved is not None:
            inputs.append((reader.lease, InputPosition(group, tp[0], tp[1], *moved)))
    return inputs
