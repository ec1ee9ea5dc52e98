"""redisq._speedups, the C entry decoder: built where the suite runs, and exactly the Python
decoder's results (Messages, MalformedMessages, exceptions) for any entry, generated or read
back from real servers; no reference leaks."""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import fields
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

import redisq
from redisq.model import batches as batches_format
from redisq.model import records
from redisq.model.records import MalformedMessage, Message, decode_entries_py

_speedups = pytest.importorskip("redisq._speedups")
fast = _speedups.decode_entries


def outcome(fn: Any, *args: Any) -> Any:
    """What fn gives: each Message with its class and every field's type and value, or the
    exception's type."""
    try:
        messages = fn(*args)
    except Exception as exc:
        return ("raised", type(exc))
    return [
        (type(m), [(f.name, type(getattr(m, f.name)), getattr(m, f.name)) for f in fields(m)])
        for m in messages
    ]  # every field of the dataclass: a MalformedMessage's own __slots__ are only its two


def same(topic: str, partition: int, entries: Any, deliveries: Any = None) -> list[Any]:
    expected = outcome(decode_entries_py, topic, partition, entries, deliveries)
    got = outcome(fast, topic, partition, entries, deliveries)
    assert got == expected
    return expected  # type: ignore[no-any-return]


DIGITS = [
    b"0", b"1", b"007", b"9223372036854775807", b"9223372036854775808", b"18446744073709551615",
    b"99999999999999999999", b"0000000000000000000001", b"", b"-1", b"+1", b" 1", b"1_0",
    b"\xd9\xa1", b"12a",
]  # fmt: skip
NAMES = [b"k", b"v", b"p", b"s", b"m", b"h", b"t", b"x", b"K", b"kk", b""]
value = st.one_of(
    st.sampled_from(DIGITS), st.binary(max_size=12), st.text(max_size=4), st.just(b"\x00\x01")
)
entry_id = st.one_of(
    st.sampled_from(
        [
            b"1700000000000-0",
            b"0-1",
            b"1-18446744073709551615",
            b"18446744073709551615-0",
            b"18446744073709551616-0",
            b"000000000000000000000001-5",
            b"-1",
            b"1",
            b"",
            b"abc-1",
            b"1-\xff",
            b"\xd9\xa1-0",
            b"12-ab",
        ]
    ),  # fmt: skip
    st.builds(lambda a, b: b"%d-%d" % (a, b), st.integers(0, 2**64 - 1), st.integers(0, 9)),
    st.just("1700000000000-3"),
)
layout = st.sampled_from(
    [[b"k", b"v", b"p", b"s"], [b"k", b"v", b"m", b"p"], [b"k", b"v", b"p"], [b"v", b"p", b"s"],
     [b"k", b"v"], [b"k", b"v", b"h", b"p", b"s"], [b"v"], []]
)  # fmt: skip


@st.composite
def flat_fields(draw: st.DrawFn) -> Any:
    names = list(draw(st.one_of(layout, st.lists(st.sampled_from(NAMES), max_size=6))))
    good = {b"p": b"42", b"s": b"7", b"k": b"key", b"v": b"value", b"m": b"id-1", b"h": b""}
    flat: list[Any] = []
    for name in names:
        flat += [name, draw(st.one_of(st.just(good.get(name, b"x")), value))]
    shape = draw(st.sampled_from(["list", "list", "list", "odd", "tuple", "dict", "none"]))
    if shape == "odd":
        flat.append(b"dangling")
    elif shape == "tuple":
        return tuple(flat)
    elif shape == "dict":
        it = iter(flat)
        return dict(zip(it, it, strict=True))
    elif shape == "none":
        return None
    return flat


entry = st.one_of(
    st.tuples(entry_id, flat_fields()),
    st.builds(list, st.tuples(entry_id, flat_fields())),
    st.just((b"1-0",)),
    st.just((b"1-0", [b"v", b"x"], b"extra")),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(entry, max_size=8), st.one_of(st.none(), st.lists(st.integers(-3, 2**70))))
def test_generated_entries_decode_as_the_python_decoder_does(
    entries: list[Any], deliveries: list[int] | None
) -> None:
    if deliveries is not None:
        deliveries = (deliveries + [1] * len(entries))[: len(entries)]
    same("topic", 3, entries, deliveries)


FAST_LAYOUTS = [
    [b"k", b"v", b"p", b"s"], [b"k", b"v", b"m", b"p"], [b"k", b"v", b"p"], [b"v", b"p", b"s"],
    [b"k", b"v"],
]  # fmt: skip
GOOD = {b"k": b"key", b"v": b"value", b"p": b"42", b"s": b"7", b"m": b"id-1"}
IDS = [b"1700000000000-0", b"0-0", b"18446744073709551615-18446744073709551615",
       b"18446744073709551616-0", b"99999999999999999999-1", b"000000000000000000001-2", b"-1",
       b"1", b"", b"a-1", b"1-\xff", b"1-x", b"1-\xc3\xa9", b"\xd9\xa1-0", b"1\x00-0"]  # fmt: skip


def build(names: list[bytes], changed: bytes = b"", to: Any = None) -> list[Any]:
    flat: list[Any] = []
    for name in names:
        flat += [name, to if name == changed else GOOD[name]]
    return flat


@pytest.mark.parametrize("names", FAST_LAYOUTS, ids=lambda n: b"".join(n).decode())
def test_every_rule_of_every_plain_layout_agrees(names: list[bytes]) -> None:
    """Each field of each layout the C decoder takes, set to each edge value (the limits of the
    id rule, signs, spaces, non-ASCII digits, other types), each entry ID edge, each name
    changed, a field added or left out, and the deliveries' edges: entry by entry, and all in
    one call (the caches of the last millisecond and producer id)."""
    cases: list[Any] = [(b"5-0", build(names))]
    for name in names:
        for edge in [*DIGITS, "42", 42, None, bytearray(b"42")]:
            cases.append((b"5-1", build(names, name, edge)))
    for i in range(0, len(names) * 2, 2):
        for other in (b"x", b"K", b"kk", b"", "k"):
            flat = build(names)
            flat[i] = other
            cases.append((b"5-2", flat))
    cases += [(b"5-3", build(names) + [b"x", b"1"]), (b"5-4", build(names)[:-2])]
    cases += [(entry_id, build(names)) for entry_id in IDS]
    cases += [("5-5", build(names)), (b"5-6", tuple(build(names))), [b"5-7", build(names)]]
    cases.append((b"5-8", dict(zip(names, [GOOD[name] for name in names], strict=True))))
    for case in cases:
        same("t", 0, [case])
        same("t", 0, [case], [2])
    same("t", 0, cases)
    for deliveries in ([0], [-1], [1], [2**62], [2**63], [2**70], [True], [b"3"], ["3"], [1.5]):
        same("t", 0, cases[:1], deliveries)


def test_each_plain_layout_takes_the_c_path_and_the_rest_the_python_one() -> None:
    """The fast layouts are built in C (the Python decoder is not called for them); every
    other entry is handed to it one at a time, in place, so order is kept."""
    handed: list[Any] = []

    def counting(topic: str, partition: int, entries: Any, deliveries: Any = None) -> Any:
        handed.extend(entries)
        return decode_entries_py(topic, partition, entries, deliveries)

    plain = [
        (b"5-0", [b"k", b"a", b"v", b"1", b"p", b"9", b"s", b"0"]),
        (b"5-1", [b"k", b"a", b"v", b"2", b"m", b"id", b"p", b"9"]),
        (b"5-2", [b"k", b"a", b"v", b"3", b"p", b"9"]),
        (b"5-3", [b"v", b"4", b"p", b"9", b"s", b"1"]),
        (b"6-0", [b"k", b"a", b"v", b"5"]),
    ]
    other = [
        (b"6-1", [b"k", b"a", b"v", b"6", b"h", b"", b"p", b"9", b"s", b"2"]),
        (b"6-2", [b"v", b"7", b"t", b"123"]),
        (b"6-3", [b"x", b"y"]),
    ]
    _speedups.set_layout(Message, records._MESSAGE_FIELDS, counting)
    try:
        entries = [plain[0], other[0], plain[1], plain[2], other[1], plain[3], other[2], plain[4]]
        messages = fast("t", 0, entries)
    finally:
        _speedups.set_layout(Message, records._MESSAGE_FIELDS, decode_entries_py)
    assert handed == [other[0], other[1], other[2]]
    assert [m.offset for m in messages] == [e[0].decode() for e in entries]
    assert [type(m) for m in messages].count(MalformedMessage) == 1
    assert outcome(lambda *a: messages) == outcome(decode_entries_py, "t", 0, entries)


def test_no_references_leak() -> None:
    def plain(i: int) -> list[bytes]:
        return [b"k", b"k%d" % i, b"v", b"x" * 100, b"p", b"12", b"s", b"%d" % i]

    entries: list[Any] = [(b"%d-%d" % (1700000000000 + i // 7, i), plain(i)) for i in range(1000)]
    entries += [(b"9-9", [b"v", b"x", b"p", b"nope"]), (b"9-10", [b"v", b"b", b"h", b"\x00"])]
    for _ in range(20):
        fast("t", 0, entries, [2] * len(entries))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            fast("t", 0, entries, [2] * len(entries))
            fast("t", 0, entries)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 600 decodes of {len(entries)} entries"


@pytest.mark.parametrize("entry_format", ["message", "batch"])
def test_what_real_servers_return_decodes_the_same(
    broker: redisq.Broker, server_url: str, entry_format: str
) -> None:
    """Every layout redisq writes (each idempotence mode, keys, no keys, headers, timestamps; a
    message entry each, or batch entries with and without a headers column) and a foreign
    client's entries, read back raw from the server as the consumers read them."""
    topic = "speedups"
    broker.create_topic(topic, partitions=1, entry_format=entry_format)
    for mode in ("sequence", "message_id", None):
        with broker.producer(idempotence=mode) as producer:
            for i in range(50):
                if i == 25:
                    producer.flush()  # the batches before hold no headers, some after do
                extra: dict[str, Any] = {"message_id": f"m-{i}"} if mode == "message_id" else {}
                if i >= 25 and i % 5 == 1:
                    extra["headers"] = {"h": b"x"}
                if i % 7 == 2:
                    extra["timestamp_ms"] = 1_600_000_000_000 + i
                key = None if i % 4 == 3 else f"key-{i}"
                producer.send_async(topic, b"value-%d" % i, key=key, partition=0, **extra)
    stream = broker.keys.log(topic, 0)
    broker.client.xadd(stream, {b"foreign": b"1"})
    broker.client.xadd(stream, {b"v": b"x", b"p": b"-5"})
    broker.client.xadd(stream, {b"k": b"a", b"v": b"b", b"s": b"1", b"p": b"2"})
    raw = raw_reply(broker, stream, "XRANGE", stream, "-", "+")
    parsed = broker.client.xrange(stream)  # redis-py's (id, dict) form, as Broker.read gets it
    assert len(raw) == len(parsed) == broker.client.xlen(stream)
    # How Redis stores them: 150 message entries, or the producers' batches (one entry each);
    # then the 3 entries written by hand.
    batches = [flat for _, flat in raw[:-3] if flat[0] == b"b"]
    if entry_format == "message":
        assert len(raw) == 153 and not batches
    else:
        assert len(batches) == len(raw) - 3
        blobs = [dict(zip(flat[0::2], flat[1::2], strict=True))[b"b"] for flat in batches]
        with_headers = [blob[1] & batches_format.HEADERS != 0 for blob in blobs]
        assert True in with_headers and False in with_headers  # the Python and the C path
    for entries in (raw, parsed):
        decoded = same(topic, 0, entries)
        assert sum(t is MalformedMessage for t, _ in decoded) == 2
        assert sum(t is Message for t, _ in decoded) == 151  # 150 produced, 1 foreign


def raw_reply(broker: redisq.Broker, key: str, *command: Any) -> Any:
    """The reply without redis-py's callbacks (the flat field lists the consumers read), from
    the node that holds `key`."""
    client = broker.client
    if isinstance(client, redis.RedisCluster):
        node = client.get_node_from_key(key)
        client = redis.Redis(host=node.host, port=node.port)
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command(*command)
        return conn.read_response()
    finally:
        client.connection_pool.release(conn)


@pytest.mark.parametrize("changed", [False, True])
def test_a_build_from_another_source_is_not_used(tmp_path: Any, changed: bool) -> None:
    """An editable install whose _speedups.c changed after it was compiled would decode by old
    rules: redisq says so and decodes in pure Python until it is rebuilt."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = Path(records.__file__).parents[1]
    shutil.copytree(package, tmp_path / "redisq", ignore=shutil.ignore_patterns("__pycache__"))
    if changed:
        with open(tmp_path / "redisq" / "_speedups.c", "a") as source:
            source.write("/* changed after the build */\n")
    probe = "import redisq.model.records as r; print(r.__file__); print(r.decode_entries.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    where, decoder = done.stdout.split()
    assert where == str(tmp_path / "redisq" / "model" / "records.py")
    if changed:
        assert decoder == "decode_entries_py"
        assert "was built from another _speedups.c: rebuild it" in done.stderr
    else:
        assert decoder == "decode_entries"
        assert done.stderr == ""
