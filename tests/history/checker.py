"""The properties a history must have. One function per property; each returns a list of
violations (strings with enough detail to debug), empty when the property holds.

Inputs: a `History` (every event of every process, see recorder.py) and the topic as stored at
the end (`Stored` entries, read back with broker.read from every partition, in offset order).

Times: `event_time(e)` is the server's TIME when the event has it, else this machine's wall clock
(the same CLOCK_REALTIME here). A recorded handler interval [start, end] lies inside the real
handler call: start is taken after the call began, end before it returned. So two recorded
intervals that overlap prove that two real calls overlapped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]
INF = math.inf


def event_time(event: Event) -> float:
    server = event.get("server_ms")
    return float(server) if server is not None else float(event["wall"])


def offset_key(offset: str) -> tuple[int, int]:
    ms, _, seq = offset.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Stored:
    """One entry of a partition stream as read at the end (value and key as text)."""

    partition: int
    offset: str
    key: str | None
    value: str

    @property
    def ms(self) -> int:
        """The append time the server put in the stream ID."""
        return offset_key(self.offset)[0]

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.partition, *offset_key(self.offset))

    def where(self) -> str:
        return f"{self.partition}/{self.offset}"


@dataclass(slots=True)
class Call:
    """One handler call: handle_start, and handle_end if it returned."""

    proc: str
    member: str
    call: int
    partition: int
    offset: str
    key: str | None
    value: str
    start: float
    end: float | None = None  # None: no handle_end (killed mid-call, or still running)
    # The process's own monotonic clock: exact between two calls of one process, where the
    # server's TIME was seen to step back by tens of microseconds (Valkey 9, a loaded machine)
    mono_start: float = 0.0
    mono_end: float | None = None

    def before(self, other: Call) -> bool:
        """This call returned before `other` began, both in one process (its monotonic clock)."""
        return (
            self.proc == other.proc
            and self.mono_end is not None
            and (self.mono_end <= other.mono_start)
        )

    def describe(self) -> str:
        end = f"{self.end:.3f}" if self.end is not None else "never"
        return (
            f"{self.member}[{self.proc}] {self.value!r} at {self.partition}/{self.offset} "
            f"from {self.start:.3f} to {end}"
        )


class History:
    """Every event of a run, indexed for the checks."""

    def __init__(self, events: Iterable[Event]) -> None:
        self.events = list(events)
        self.invokes: dict[str, Event] = {}
        self.by_instance: dict[str, list[Event]] = defaultdict(list)
        self.oks: dict[str, list[Event]] = defaultdict(list)
        self.fails: dict[str, list[Event]] = defaultdict(list)
        self.inits: list[Event] = []
        self.faults: list[Event] = []
        self.calls: list[Call] = []
        self.deaths: dict[str, float] = {}
        open_calls: dict[tuple[str, int], Call] = {}
        for e in self.events:
            kind = e["ev"]
            if kind == "send_invoke":
                self.invokes[e["value"]] = e
                self.by_instance[e["inst"]].append(e)
            elif kind == "send_ok":
                self.oks[e["value"]].append(e)
            elif kind == "send_fail":
                self.fails[e["value"]].append(e)
            elif kind == "init_done":
                self.inits.append(e)
            elif kind == "fault":
                self.faults.append(e)
                if e["action"] in ("kill", "exit"):
                    self._died(e["target"], event_time(e))
            elif kind == "proc_exit":
                self._died(e["proc"], event_time(e))
            elif kind == "handle_start":
                call = Call(
                    e["proc"], e["member"], e["call"], e["partition"], e["offset"], e.get("key"),
                    e.get("value", ""), event_time(e), mono_start=e["mono"],
                )  # fmt: skip
                open_calls[(e["proc"], e["call"])] = call
                self.calls.append(call)
            elif kind == "handle_end":
                started = open_calls.pop((e["proc"], e["call"]), None)
                if started is not None:
                    started.end, started.mono_end = event_time(e), e["mono"]
        for invokes in self.by_instance.values():
            invokes.sort(key=lambda e: e["seq"])

    def _died(self, proc: str, at: float) -> None:
        self.deaths[proc] = min(at, self.deaths.get(proc, INF))

    def effective_end(self, call: Call) -> float:
        """A call without handle_end ran until its process died (or is still running)."""
        return call.end if call.end is not None else self.deaths.get(call.proc, INF)

    def stop_windows(self, proc: str) -> list[tuple[float, float]]:
        """[SIGSTOP, SIGCONT] windows of a process (a stop never continued lasts until it died)."""
        windows = []
        stopped: float | None = None
        for e in self.faults:
            if e["target"] != proc:
                continue
            if e["action"] == "stop" and stopped is None:
                stopped = event_time(e)
            elif e["action"] == "cont" and stopped is not None:
                windows.append((stopped, event_time(e)))
                stopped = None
        if stopped is not None:
            windows.append((stopped, self.deaths.get(proc, INF)))
        return windows

    def known(self, stored: Iterable[Stored]) -> list[Stored]:
        """The stored entries some producer of the history sent (foreign entries left out)."""
        return [s for s in stored if s.value in self.invokes]


def _ok_where(ok: Event) -> str:
    offset = ok.get("offset")
    if offset is not None:
        where = f"{ok.get('partition')}/{offset}"
    elif ok.get("schedule_id") is not None:  # a delayed send: in the partition's schedule
        where = f"{ok.get('partition')}/scheduled {ok['schedule_id']} due {ok.get('deliver_at_ms')}"
    else:
        where = "offset unknown"
    return where + (" duplicate" if ok.get("dup") else "")


# -- 1. acknowledged => stored exactly once ------------------------------------------------------


def acknowledged_stored_once(
    history: History,
    stored: list[Stored],
    *,
    foreign_ok: bool = False,
    lost_before: float | None = None,
) -> list[str]:
    """Every value whose send was acknowledged (send_ok, duplicate or not) is stored exactly once,
    at the partition and offset answered when an offset was answered, in the partition answered
    when only that was (a delayed send: answered once it was in the partition's schedule, stored
    when it was delivered; its value names it). No value is stored twice,
    acknowledged or not. A send has one outcome. Unless foreign_ok, nothing is stored that no
    producer of the history sent (with foreign_ok, such entries are not checked at all).

    lost_before: the server lost its memory (a restart without persistence) and was back at
    this time: an acknowledged send invoked earlier may be missing; one invoked later can only
    have been written to the server as it is now, so it must be there."""
    violations = []
    copies: dict[str, list[Stored]] = defaultdict(list)
    for entry in stored:
        copies[entry.value].append(entry)
    for value, where in copies.items():
        if len(where) > 1 and (value in history.invokes or not foreign_ok):
            violations.append(
                f"stored {len(where)} times: {value!r} at {[w.where() for w in where]}"
            )
        if not foreign_ok and value not in history.invokes:
            violations.append(f"stored but never sent: {value!r} at {where[0].where()}")
    for value, oks in history.oks.items():
        invoke = history.invokes.get(value, {})
        who = f"{invoke.get('inst')} key {invoke.get('key')!r}"
        if history.fails.get(value):
            fail = history.fails[value][0]
            violations.append(f"{value!r} ({who}) both acknowledged and failed ({fail['error']})")
        where = copies.get(value, [])
        if not where and lost_before is not None and invoke.get("wall", INF) <= lost_before:
            continue
        for ok in oks:
            if not where:
                violations.append(
                    f"acknowledged but not stored: {value!r} ({who}), answered {_ok_where(ok)}"
                )
            elif len(where) == 1:
                entry = where[0]
                if ok.get("offset") is not None:
                    wrong = (ok["partition"], ok["offset"]) != (entry.partition, entry.offset)
                else:  # a delayed send (or an old duplicate): only its partition was answered
                    wrong = ok.get("partition") not in (None, entry.partition)
                if wrong:
                    violations.append(
                        f"{value!r} ({who}) acknowledged at {_ok_where(ok)} "
                        f"but stored at {entry.where()}"
                    )
    return violations


# -- 2. order per key ----------------------------------------------------------------------------


def key_order_in_log(history: History, stored: list[Stored]) -> list[str]:
    """For each (producer instance, key, delay), the messages that were stored sit in the log in
    the order their sends were invoked (messages not stored are skipped: a failed send may be
    lost, but what is stored must not be reordered).

    The delay (send_invoke's delay_ms, None for a plain send) is part of the class because that
    is what redisq promises: plain sends of a key keep their send order, and so do delayed sends
    of a key with the same delay (their due times follow the order in which the partition's
    schedule stored them, equal due times go in send order); a delayed message never holds back
    a plain one, nor a longer delay a shorter one."""
    violations = []
    position: dict[str, Stored] = {}
    for stored_entry in stored:
        position.setdefault(stored_entry.value, stored_entry)
    for inst, invokes in history.by_instance.items():
        last: dict[tuple[str | None, int | None], tuple[Event, Stored]] = {}
        for invoke in invokes:
            entry = position.get(invoke["value"])
            if entry is None:
                continue
            key = invoke.get("key")
            delay = invoke.get("delay_ms")
            before = last.get((key, delay))
            if before is not None:
                prev_invoke, prev_entry = before
                key_text = repr(key) if delay is None else f"{key!r} (delay_ms={delay})"
                if entry.partition != prev_entry.partition:
                    violations.append(
                        f"{inst} key {key_text}: {invoke['value']!r} stored in partition "
                        f"{entry.partition}, the previous {prev_invoke['value']!r} in "
                        f"{prev_entry.partition}"
                    )
                elif entry.position <= prev_entry.position:
                    violations.append(
                        f"{inst} key {key_text}: {invoke['value']!r} (send #{invoke['seq']}) "
                        f"stored at {entry.where()}, before {prev_invoke['value']!r} (send "
                        f"#{prev_invoke['seq']}) at {prev_entry.where()}"
                    )
            last[(key, delay)] = (invoke, entry)
    return violations


def delivered_not_early(history: History, stored: list[Stored]) -> list[str]:
    """Every stored copy of an acknowledged delayed send was appended at or after the due time
    it was answered with (deliver_at_ms, the server's clock; the stream ID's milliseconds are the
    append time, the same clock). A send answered "already delivered" has no due time (None) and
    is not checked; nor are plain sends."""
    violations = []
    copies: dict[str, list[Stored]] = defaultdict(list)
    for entry in stored:
        copies[entry.value].append(entry)
    for value, oks in history.oks.items():
        due = [ok["deliver_at_ms"] for ok in oks if ok.get("deliver_at_ms") is not None]
        if not due:
            continue
        for entry in copies.get(value, []):
            if entry.ms < max(due):
                violations.append(
                    f"{value!r} appended at {entry.where()} (ms {entry.ms}), "
                    f"{max(due) - entry.ms} ms before its due time {max(due)}"
                )
    return violations


def _calls_at(history: History) -> dict[tuple[int, str], list[Call]]:
    at: dict[tuple[int, str], list[Call]] = defaultdict(list)
    for call in history.calls:
        at[(call.partition, call.offset)].append(call)
    return at


def key_order_in_handling(history: History, stored: list[Stored]) -> list[str]:
    """Per key, with the key's stored messages m0, m1, ... in log order: the first handling of
    m(i) starts after some handling of m(i-1) has ended (returned). So the first handlings of a
    key's messages follow the log, one at a time.

    Accepted: repeats. After a takeover the new owner may handle again what the previous one
    handled but could not acknowledge, so a handle_start of m(j) may come after m(i), j < i, has
    been handled (at-least-once). What is never accepted is a message handled for the first time
    before its predecessor completed once, or while its predecessor's only handling is still
    running. A message never handled is the business of all_handled."""
    violations = []
    at = _calls_at(history)
    per_key: dict[str | None, list[Stored]] = defaultdict(list)
    for entry in history.known(stored):
        per_key[entry.key].append(entry)
    for key, entries in per_key.items():
        entries.sort(key=lambda s: s.position)
        for prev, cur in zip(entries, entries[1:], strict=False):
            calls = at.get((cur.partition, cur.offset))
            if not calls:
                continue
            first = min(calls, key=lambda c: c.start)
            before = at.get((prev.partition, prev.offset), [])
            ends = [c.end for c in before if c.end is not None]
            # One process's calls are ordered by its own clock (the server's TIME may step back)
            if not any(
                c.before(first) or (c.end is not None and c.end < first.start) for c in before
            ):
                earlier = (
                    "; ".join(c.describe() for c in before[:3])
                    if ends
                    else "never handled to the end"
                )
                violations.append(
                    f"key {key!r}: {cur.value!r} at {cur.where()} first handled by "
                    f"{first.member} at {first.start:.3f}, before any handling of the previous "
                    f"message {prev.value!r} at {prev.where()} had ended ({earlier})"
                )
    return violations


# -- 3. one handler per partition ----------------------------------------------------------------


def one_handler_per_partition(history: History) -> list[str]:
    """Handler calls on one partition never overlap in time, whoever makes them (orderly mode,
    key_concurrency=1: one call at a time per partition in the whole group).

    The one exception is a member process frozen by SIGSTOP: a handler call it had already
    decided to make when it froze may finish (or begin) after its lease ran out and another
    member took over; Redis refuses that member's acks (fencing token), but cannot stop its
    handler. Precisely: a call is excused when a SIGSTOP window of its process intersects its
    exposure, the time from the end of the same process's previous call on that partition (from
    the start of the history for its first one) to the call's end. That excuses at most one call
    per partition and freeze: a member that goes on handling after it was continued, past its
    lease, is still caught on its next call. A call with no handle_end lasts until its process
    died (SIGKILL, exit) or forever."""
    violations = []
    by_partition: dict[int, list[Call]] = defaultdict(list)
    for call in history.calls:
        by_partition[call.partition].append(call)
    windows = {proc: history.stop_windows(proc) for proc in {c.proc for c in history.calls}}
    for partition, calls in sorted(by_partition.items()):
        calls.sort(key=lambda c: (c.start, c.proc, c.call))
        excused = _excused_calls(history, calls, windows)
        active: list[Call] = []
        for call in calls:
            active = [a for a in active if history.effective_end(a) > call.start]
            for other in active:
                if history.effective_end(call) <= other.start or other.before(call):
                    continue
                if id(other) in excused or id(call) in excused:
                    continue
                violations.append(
                    f"partition {partition}: {other.describe()} overlaps {call.describe()}"
                )
            active.append(call)
    return violations


def _excused_calls(
    history: History, calls: list[Call], windows: dict[str, list[tuple[float, float]]]
) -> set[int]:
    excused: set[int] = set()
    previous_end: dict[str, float] = {}
    for call in calls:  # sorted by start
        end = history.effective_end(call)
        since = previous_end.get(call.proc, -INF)
        if any(stop < end and cont > since for stop, cont in windows.get(call.proc, [])):
            excused.add(id(call))
        previous_end[call.proc] = end
    return excused


# -- 4. everything handled -----------------------------------------------------------------------


def all_handled(history: History, stored: list[Stored]) -> list[str]:
    """Every stored message (of the history's producers) was handled to the end at least once.
    One violation per partition: how many were never handled, the first few, and the last one
    that was (where a blocked partition stopped)."""
    violations = []
    done = {(c.partition, c.offset) for c in history.calls if c.end is not None}
    missing: dict[int, list[Stored]] = defaultdict(list)
    handled_last: dict[int, Stored] = {}
    for entry in history.known(stored):
        if (entry.partition, entry.offset) in done:
            handled_last[entry.partition] = entry
        else:
            missing[entry.partition].append(entry)
    for partition, entries in sorted(missing.items()):
        first = ", ".join(f"{e.offset} {e.value!r}" for e in entries[:3])
        last = handled_last.get(partition)
        violations.append(
            f"partition {partition}: {len(entries)} stored messages never handled, first: "
            f"{first}; last handled there: {last.offset + ' ' + repr(last.value) if last else None}"
        )
    return violations


# -- 5. fencing ----------------------------------------------------------------------------------


def no_fenced_writes(history: History, stored: list[Stored]) -> list[str]:
    """When instance B of producer name N finished starting (init_done, recorded with the
    server's TIME T after the constructor returned: B's epoch is registered and its fences are
    written), no older instance A of N writes any more:
      - no message of A is stored with a stream ID whose milliseconds are > T (the server stamps
        stream IDs with its clock: such a message was appended after B's start);
      - no send of A invoked after T is acknowledged (its message cannot have been written
        before B's start, so a success means A wrote after being fenced).
    Messages of A appended in the same millisecond as T cannot be told apart and are accepted."""
    violations = []
    by_name: dict[str, list[Event]] = defaultdict(list)
    for init in history.inits:
        if init.get("name"):
            by_name[init["name"]].append(init)
    stored_by_inst: dict[str, list[Stored]] = defaultdict(list)
    for entry in stored:
        invoke = history.invokes.get(entry.value)
        if invoke is not None:
            stored_by_inst[invoke["inst"]].append(entry)
    for name, inits in by_name.items():
        inits.sort(key=event_time)
        for i, newer in enumerate(inits):
            fenced_at = event_time(newer)
            older = {init["inst"] for init in inits[:i]} - {newer["inst"]}
            for inst in sorted(older):
                for entry in stored_by_inst.get(inst, []):
                    if entry.ms > fenced_at:
                        violations.append(
                            f"{name}: {entry.value!r} of instance {inst} stored at {entry.where()} "
                            f"(ms {entry.ms}) after instance {newer['inst']} started at "
                            f"{fenced_at:.3f}"
                        )
                for invoke in history.by_instance.get(inst, []):
                    if invoke["wall"] > fenced_at and history.oks.get(invoke["value"]):
                        ok = history.oks[invoke["value"]][0]
                        violations.append(
                            f"{name}: send of {invoke['value']!r} by instance {inst} invoked at "
                            f"{invoke['wall']:.3f}, after instance {newer['inst']} started at "
                            f"{fenced_at:.3f}, was acknowledged ({_ok_where(ok)})"
                        )
    return violations


# -- running them --------------------------------------------------------------------------------

PRODUCE = (
    "acknowledged_stored_once",
    "key_order_in_log",
    "no_fenced_writes",
    "delivered_not_early",
)
CONSUME = ("key_order_in_handling", "one_handler_per_partition", "all_handled")
ALL = PRODUCE + CONSUME


def check(
    history: History,
    stored: list[Stored],
    properties: Iterable[str] = ALL,
    *,
    foreign_ok: bool = False,
    lost_before: float | None = None,
) -> dict[str, list[str]]:
    """Run the named properties; returns property -> violations."""
    functions: dict[str, Callable[[], list[str]]] = {
        "acknowledged_stored_once": lambda: acknowledged_stored_once(
            history, stored, foreign_ok=foreign_ok, lost_before=lost_before
        ),
        "key_order_in_log": lambda: key_order_in_log(history, stored),
        "key_order_in_handling": lambda: key_order_in_handling(history, stored),
        "one_handler_per_partition": lambda: one_handler_per_partition(history),
        "all_handled": lambda: all_handled(history, stored),
        "no_fenced_writes": lambda: no_fenced_writes(history, stored),
        "delivered_not_early": lambda: delivered_not_early(history, stored),
    }
    return {name: functions[name]() for name in properties}


def report(results: dict[str, list[str]], limit: int = 12) -> str:
    """The violations, at most `limit` per property, with counts."""
    lines = []
    for name, violations in results.items():
        if not violations:
            continue
        lines.append(f"{name}: {len(violations)} violation(s)")
        lines += [f"  - {v}" for v in violations[:limit]]
        if len(violations) > limit:
            lines.append(f"  ... and {len(violations) - limit} more")
    return "\n".join(lines)
