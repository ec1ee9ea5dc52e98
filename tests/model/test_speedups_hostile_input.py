"""redisq._speedups against hostile input: the C decoder gives what decode_entries_py gives
(every field of every Message and MalformedMessage, or the same exception type) when entries
and deliveries are not plain lists, are shorter or mutated while it runs (by the Python
fallback, by a finalizer the collector runs inside an allocation), and set_layout refuses
layouts it could write out of bounds with. Crashes are probed in a subprocess."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest

from redisq.model import records
from redisq.model.records import Message, decode_entries_py

_speedups = pytest.importorskip("redisq._speedups")
fast = _speedups.decode_entries

P = [b"k", b"a", b"v", b"b", b"p", b"12", b"s", b"3"]  # a plain layout: the C path
H = [b"k", b"a", b"v", b"b", b"h", b"", b"p", b"12", b"s", b"3"]  # headers: the Python path


def outcome(fn: Any, *args: Any) -> Any:
    """Every field of every message (inherited ones too: a MalformedMessage's __slots__ name
    only reason and raw_fields) with its type, or the exception's type."""
    try:
        messages = fn(*args)
    except Exception as exc:
        return ("raised", type(exc))
    return [
        (type(m), [(f.name, type(v := getattr(m, f.name)), v) for f in dataclasses.fields(m)])
        for m in messages
    ]


def same(topic: str, partition: int, entries: Any, deliveries: Any = None) -> Any:
    expected = outcome(decode_entries_py, topic, partition, entries, deliveries)
    got = outcome(fast, topic, partition, entries, deliveries)
    assert got == expected
    return expected


def same_fresh(make: Any) -> Any:
    """Both decoders on fresh input from make() -> (entries, deliveries): for input the
    decoding itself changes."""
    expected = outcome(decode_entries_py, "t", 0, *make())
    got = outcome(fast, "t", 0, *make())
    assert got == expected
    return expected


# -- deliveries ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flat", [P, H], ids=["c-path", "python-path"])
def test_deliveries_shorter_than_the_entries_raise_index_error(flat: list[bytes]) -> None:
    assert same("t", 0, [(b"1-0", P), (b"1-1", flat)], [2]) == ("raised", IndexError)
    assert same("t", 0, [(b"1-0", flat)], ()) == ("raised", IndexError)


def test_deliveries_longer_than_the_entries_are_fine() -> None:
    same("t", 0, [(b"1-0", P), (b"1-1", H)], [2, 3, 4, 5])


def test_deliveries_are_not_touched_without_entries() -> None:
    for deliveries in (5, object(), b"", {}):
        assert same("t", 0, [], deliveries) == []


class _Indexed(Sequence[Any]):
    """Indexing and iteration disagree: decode_entries_py indexes."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __getitem__(self, i: Any) -> Any:
        return self.values[i] * 10

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Any:
        return iter(self.values)


class _IndexedList(list[Any]):
    def __getitem__(self, i: Any) -> Any:
        return super().__getitem__(i) + 1


@pytest.mark.parametrize("flat", [P, H], ids=["c-path", "python-path"])
def test_deliveries_are_indexed_not_iterated(flat: list[bytes]) -> None:
    entries = [(b"1-0", flat), (b"1-1", flat)]
    same("t", 0, entries, {0: 3, 1: 4})
    same("t", 0, entries, {1: 4, 0: 3})
    assert same("t", 0, entries, {0: 3}) == ("raised", KeyError)
    assert same("t", 0, entries, iter([3, 4])) == ("raised", TypeError)
    assert same("t", 0, entries, (d for d in [3, 4])) == ("raised", TypeError)
    same("t", 0, entries, _Indexed([3, 4]))
    same("t", 0, entries, _IndexedList([3, 4]))
    same("t", 0, entries, b"\x03\x04")
    same("t", 0, entries, range(5, 7))


class _Int(int):
    pass


@pytest.mark.parametrize("flat", [P, H], ids=["c-path", "python-path"])
@pytest.mark.parametrize(
    "delivery",
    [0, -1, -(2**70), 1, 2, 255, 257, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 2**70, True,
     False, _Int(5), _Int(0), 2.9, -0.5, "7", b"7", " 8 ", "x", None, [1]],
    ids=repr,
)  # fmt: skip
def test_each_kind_of_delivery_count(flat: list[bytes], delivery: Any) -> None:
    """max(1, int(d)): bools, int subclasses, huge and negative ints, floats, strings."""
    same("t", 0, [(b"1-0", flat)], [delivery])
    same("t", 0, [(b"1-0", P), (b"1-1", flat), (b"1-2", P)], [2, delivery, 3])


def test_a_delivery_is_read_after_the_entry_id_is() -> None:
    """decode_entries_py reads deliveries[i] after str(entry_id) (which may change it)."""

    class Changing:
        def __init__(self, deliveries: list[int]) -> None:
            self.deliveries = deliveries

        def __str__(self) -> str:
            self.deliveries[0] = 5
            return "1-0"

    def make() -> Any:
        deliveries = [2]
        return [(Changing(deliveries), P)], deliveries

    assert same_fresh(make)[0][1][-1] == ("attempt", int, 5)


def test_fields_are_read_after_the_delivery_is() -> None:
    """decode_entries_py unpacks an entry's fields after it read its delivery count: a
    deliveries __getitem__ that empties the fields makes the entry malformed."""

    class Emptying(list[Any]):
        def __getitem__(self, i: Any) -> Any:
            flat.clear()
            return super().__getitem__(i)

    flat: list[Any] = []

    def make() -> Any:
        flat[:] = P
        return [(b"1-0", flat)], Emptying([2])

    assert same_fresh(make)[0][0] is records.MalformedMessage


# -- entries -------------------------------------------------------------------------------------
def test_entries_are_iterated_lazily() -> None:
    """A generator's error after a bad entry: the bad entry's error comes first."""

    def entries(tail: BaseException) -> Any:
        yield (b"1-0", P)
        yield 5  # cannot be unpacked: TypeError
        raise tail

    assert same_fresh(lambda: (entries(KeyError("x")), None)) == ("raised", TypeError)
    assert same_fresh(lambda: (iter([(b"1-0", P), (b"1-1", H)]), None))
    assert same_fresh(lambda: ({(b"1-0", tuple(P)): 1}, None))[0][0] is Message  # the keys


class _Growing:
    """An entry ID whose str() (run by the Python fallback) appends to the entry list."""

    def __init__(self, entries: list[Any], adds: list[Any]) -> None:
        self.entries = entries
        self.adds = adds

    def __str__(self) -> str:
        self.entries.extend(self.adds)
        self.adds = []
        return "8-1"


def test_entries_appended_by_the_fallback_are_decoded() -> None:
    def make() -> Any:
        entries: list[Any] = []
        entries += [(_Growing(entries, [(b"9-0", P), (b"9-1", H)]), P), (b"7-1", P)]
        return entries, None

    assert len(same_fresh(make)) == 4


def test_a_deliveries_list_mutated_by_the_fallback() -> None:
    class Dropping:
        def __init__(self, deliveries: list[Any]) -> None:
            self.deliveries = deliveries

        def __str__(self) -> str:
            self.deliveries[:] = [1000 + i for i in range(len(self.deliveries))]
            return "8-1"

    def make() -> Any:
        deliveries = [2000 + i for i in range(5)]
        entries = [(b"7-0", P), (Dropping(deliveries), P), (b"7-1", P), (b"7-2", H)]
        return entries, deliveries

    same_fresh(make)


# -- the Python decoder's caches: one call over many entries = one call per entry ----------------
@pytest.mark.parametrize(
    "ids",
    [
        [b"7-1", b"\x00-1"],  # "\0" was the empty millisecond cache
        [b"7-1", "\x00-1"],
        ["\x00-1", b"7-1", "\x00-2"],
        ["\u00b2-1", "\u00b2-2"],  # "²".isdigit() but int("²") fails
        [b"7-1", "\u00b2-1"],
        [b"7-1", "\u0663-1", b"3-1", "\u0663-2"],  # Arabic-Indic 3: int() takes it
        [b"7-1", b"7-", b"7", b"-7", b"", b"7-2"],
    ],
    ids=repr,
)
def test_odd_entry_ids_in_one_call(ids: list[Any]) -> None:
    entries = [(entry_id, P) for entry_id in ids]
    whole = same("t", 0, entries)
    assert whole == [m for e in entries for m in outcome(decode_entries_py, "t", 0, [e])]


def test_the_producer_id_cache_takes_plain_bytes_only() -> None:
    class NotDigits(bytes):
        def isdigit(self) -> bool:
            return False

    class EqualToAll:
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash(b"12")

    for odd in (NotDigits(b"12"), EqualToAll(), "12", bytearray(b"12")):
        second = list(P)
        second[5] = odd
        entries = [(b"7-1", P), (b"7-2", second)]
        whole = same("t", 0, entries)
        assert whole == [m for e in entries for m in outcome(decode_entries_py, "t", 0, [e])]


# -- crashes: in a subprocess --------------------------------------------------------------------
def run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    prelude = """\
        import gc, sys
        from redisq import _speedups
        from redisq.model import records
        from redisq.model.records import Message, decode_entries_py
        fast = _speedups.decode_entries
        P = [b"k", b"a", b"v", b"b", b"p", b"12", b"s", b"3"]
    """
    env = dict(os.environ, PYTHONMALLOC="debug", PYTHONFAULTHANDLER="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def assert_runs(code: str) -> str:
    done = run_isolated(code)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("cut", ["entries.clear()", "del entries[1:]", "del entries[3:]"])
def test_the_fallback_shortening_the_entry_list(cut: str) -> None:
    """The Python fallback runs arbitrary code (here an entry ID's __str__), which may remove
    entries the C decoder has not reached yet (from a list it was given, not a copy)."""
    out = assert_runs(f"""
        def make():
            entries = []
            class Cutting:
                def __str__(self):
                    {cut}
                    return "8-1"
            entries += [(b"7-0", P), (Cutting(), P)]
            entries += [(b"7-%d" % i, list(P)) for i in range(1, 50)]
            return entries
        py = decode_entries_py("t", 0, make())
        c = fast("t", 0, make())
        print(len(py), len(c), [m.offset for m in py] == [m.offset for m in c])
    """)
    assert out.split()[1:] == [out.split()[0], "True"]


FINALIZER = """
    flats = [[b"k", bytes(100) + b"%d" % i, b"v", b"b" * 100, b"p", b"12", b"s", b"3"]
             for i in range(300)]
    entries = [(b"7-%d" % i, f) for i, f in enumerate(flats)]
    class Bomb:
        def __del__(self):
            {action}
    gc.collect()
    bomb = Bomb()
    bomb.me = bomb
    del bomb
    gc.set_threshold({threshold})
    decoded = fast("t", 0, entries)
    gc.set_threshold(700)
    gc.collect()
    print(len(decoded), sum(m.key is not None and len(m.key) == 100 + len(m.offset) - 2
                            for m in decoded))
"""


@pytest.mark.parametrize("threshold", [50, 120])
@pytest.mark.parametrize(
    "action", ["for f in flats: f.clear()", "entries.clear()", "entries[:] = entries[:3]"]
)
def test_a_finalizer_run_by_the_collector_mid_decode(threshold: int, action: str) -> None:
    """The collector runs finalizers inside the C decoder's allocations (of the result, the
    headers dict, the Message): one may empty the entries or their fields under it."""
    out = assert_runs(FINALIZER.format(action=action, threshold=threshold))
    total, intact = map(int, out.split())
    assert 0 <= intact <= total <= 300


def test_set_layout_that_fails_keeps_the_layout_it_had() -> None:
    out = assert_runs("""
        class Other:
            __slots__ = ("partition", "topic")
        try:
            _speedups.set_layout(Other, records._MESSAGE_FIELDS, decode_entries_py)
        except TypeError:
            pass
        else:
            raise AssertionError("set_layout took a type without the slots")
        m = fast("T", 5, [(b"1-0", P)])[0]
        print(m.topic, m.partition, m.headers, m.attempt)
    """)
    assert out.split() == ["T", "5", "{}", "1"]


def test_set_layout_refuses_another_class_slots() -> None:
    """Member descriptors copied from Message into an unrelated class: their offsets lie
    outside its instances."""
    done = run_isolated("""
        class Thin:
            pass
        for name in records._MESSAGE_FIELDS:
            setattr(Thin, name, Message.__dict__[name])
        try:
            _speedups.set_layout(Thin, records._MESSAGE_FIELDS, decode_entries_py)
        except TypeError:
            print("refused")
        else:
            for _ in range(50):
                fast("t", 0, [(b"1-0", P)] * 100)
            gc.collect()
            print("taken")
        print(type(fast("t", 0, [(b"1-0", P)])[0]).__name__)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused", "Message"]


def test_set_layout_refuses_bad_layouts() -> None:
    names = records._MESSAGE_FIELDS
    bad = [
        (int, names, decode_entries_py),
        (records.MalformedMessage, names, decode_entries_py),  # its dict holds 2 slots
        (Message, names[:-1], decode_entries_py),
        (Message, names[:-1] + (names[0],), decode_entries_py),  # a slot written twice
        (Message, list(names), decode_entries_py),
        (Message, names[:-1] + (5,), decode_entries_py),
        (Message, names[:-1] + ([],), decode_entries_py),
        (Message(topic="t", partition=0, offset="0-0", key=None, value=b""), names, len),
    ]
    try:
        for args in bad:
            with pytest.raises((TypeError, ValueError)):
                _speedups.set_layout(*args)
            same("t", 0, [(b"1-0", P), (b"1-1", H)], [2, 3])
        _speedups.set_layout(Message, names, decode_entries_py)  # twice: the same layout
        same("t", 0, [(b"1-0", P), (b"1-1", H)], [2, 3])
    finally:
        _speedups.set_layout(Message, names, decode_entries_py)


def test_a_call_keeps_the_layout_it_started_with() -> None:
    """A fallback that swaps the layout (set_layout with another Python decoder) changes the
    next calls, not the one running."""
    seen: list[str] = []

    def second(*args: Any) -> Any:
        seen.append("second")
        return decode_entries_py(*args)

    def first(*args: Any) -> Any:
        seen.append("first")
        _speedups.set_layout(Message, records._MESSAGE_FIELDS, second)
        return decode_entries_py(*args)

    entries = [(b"1-0", H), (b"1-1", P), (b"1-2", H)]
    try:
        _speedups.set_layout(Message, records._MESSAGE_FIELDS, first)
        assert outcome(fast, "t", 0, entries) == outcome(decode_entries_py, "t", 0, entries)
        assert seen == ["first", "first"]
        fast("t", 0, entries[:1])
        assert seen[-1] == "second"
    finally:
        _speedups.set_layout(Message, records._MESSAGE_FIELDS, decode_entries_py)


# -- leaks ---------------------------------------------------------------------------------------
def test_no_references_leak_on_the_fallback_and_error_paths() -> None:
    entries: list[Any] = [(b"%d-0" % i, P if i % 2 else H) for i in range(50)]
    entries += [("5-5", P), (b"\xff-1", P)]
    lazy = _Indexed([2] * len(entries))

    def once() -> None:
        fast("t", 0, entries[:-1], [2] * len(entries))
        fast("t", 0, entries[:-1], lazy)
        fast("t", 0, iter(entries[:-1]), [True, 2**70, -1, "3"] * 13)
        for args in (
            (entries, None),  # UnicodeDecodeError
            (entries[:-1], [2] * 10),  # IndexError
            (entries[:-1], {0: 1}),  # KeyError
            ([(b"1-0", P), 5], None),  # TypeError
        ):
            with pytest.raises((UnicodeDecodeError, IndexError, KeyError, TypeError)):
                fast("t", 0, *args)

    for _ in range(5):
        once()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            once()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 32 * 1024, f"{grown} bytes kept"
