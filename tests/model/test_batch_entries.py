"""Batch entries (DESIGN §14): the blob codec and the decoder's reading of them. No server."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redisq.model import batches, records
from redisq.model.records import (
    MalformedMessage,
    Message,
    decode_entries,
    decode_entries_py,
    encode_headers,
)
from redisq.protocol.produce import encode_message

blobs = st.binary(max_size=12)
message = st.tuples(
    st.one_of(st.none(), st.binary(min_size=1, max_size=8)),  # key
    st.binary(max_size=20),  # value
    st.one_of(st.none(), st.dictionaries(st.text(max_size=4), blobs, min_size=1, max_size=2)),
    st.one_of(st.none(), st.binary(min_size=1, max_size=8)),  # message id
)


def batch_entry(entry_id: bytes, msgs: list, producer: bytes = b"7", base: bytes | None = b"3"):
    blob = batches.encode_batch(
        [m[1] for m in msgs],
        [m[0] for m in msgs],
        [encode_headers(m[2]) if m[2] else None for m in msgs],
        [m[3] for m in msgs],
    )
    fields = [b"b", blob, b"n", b"%d" % len(msgs), b"p", producer]
    if base is not None:
        fields += [b"s", base]
    return (entry_id, fields)


@settings(max_examples=200, deadline=None)
@given(st.lists(message, min_size=1, max_size=12), st.integers(0, 2**40), st.integers(0, 99))
def test_a_batch_reads_back_as_its_messages_at_consecutive_offsets(msgs, ms, seq):
    entry = batch_entry(f"{ms}-{seq}".encode(), msgs)
    got = decode_entries("t", 2, [entry], [4])
    assert got == decode_entries_py("t", 2, [entry], [4])
    assert [m.offset for m in got] == [f"{ms}-{seq + i}" for i in range(len(msgs))]
    for m, (key, value, headers, mid) in zip(got, msgs, strict=True):
        assert type(m) is Message
        assert (m.key, m.value, m.headers, m.message_id) == (key, value, headers or {}, mid)
        assert (m.producer_id, m.timestamp_ms, m.attempt) == (7, ms, 4)
    assert [m.sequence for m in got] == [3 + i for i in range(len(msgs))]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(0, 12), st.integers(0, 12), st.binary(max_size=2))
def test_after_upto_and_acked_cut_an_entry_exactly(n, after, upto, bitmap):
    msgs = [(None, b"%d" % i, None, None) for i in range(n)]
    entries = [batch_entry(b"5-2", msgs), (b"6-0", [b"v", b"next"])]
    offsets = [f"5-{2 + i}" for i in range(n)] + ["6-0"]
    got = decode_entries_py("t", 0, entries, after=f"5-{after}", upto=f"5-{upto}")
    seqs = [2 + i for i in range(n)]
    assert [m.offset for m in got] == [f"5-{s}" for s in seqs if after < s < upto]
    got = decode_entries_py("t", 0, entries, acked={"5-2": bitmap})
    settled = {i for i in range(n) if i < 8 * len(bitmap) and bitmap[i >> 3] & (0x80 >> (i & 7))}
    assert [m.offset for m in got] == [o for i, o in enumerate(offsets) if i not in settled]


def test_a_resume_read_skips_message_entries_at_or_before_the_position():
    entries = [(b"4-0", [b"v", b"a"]), (b"4-1", [b"v", b"b"]), (b"5-0", [b"v", b"c"])]
    assert [m.value for m in decode_entries_py("t", 0, entries, after="4-0")] == [b"b", b"c"]
    assert [m.value for m in decode_entries_py("t", 0, entries, upto="5-0")] == [b"a", b"b"]


def _fields(blob: bytes, n: bytes = b"2", extra: tuple = ()) -> list:
    return [b"b", blob, b"n", n, b"p", b"1", *extra]


GOOD = batches.encode_batch([b"aa", b"b"], [b"k", None])


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (_fields(GOOD[:5]), "header"),
        (_fields(GOOD, b"3"), "the field n says 3"),
        (_fields(GOOD, b"x"), "message count"),
        (_fields(GOOD, b"-1"), "message count"),
        (_fields(b"\x02" + GOOD[1:]), "version 2"),
        (_fields(GOOD[:1] + b"\x41" + GOOD[2:]), "unknown flag"),
        (_fields(GOOD + b"!"), "add up"),
        (_fields(GOOD[:-1]), "add up"),
        (_fields(GOOD, extra=(b"s", b"12a")), "s="),
        (_fields(GOOD, extra=(b"c", b" 1")), "c="),
        (_fields(batches.encode_batch([b"x"], headers=[b"\x00\x09ab"]), b"1"), "headers"),
        ([b"b", GOOD, b"n", b"2", b"p", b"-4"], "producer id"),
        ([b"b", GOOD, b"n", b"2", b"s", b"%d" % (2**63 - 1)], "pass 2**63-1"),
    ],
)
def test_a_broken_batch_entry_is_one_malformed_message_with_its_reason(fields, reason):
    (got,) = decode_entries("t", 1, [(b"9-4", fields)])
    assert isinstance(got, MalformedMessage)
    assert got.offset == "9-4" and got.timestamp_ms == 9
    assert reason in got.reason
    assert got.raw_fields[0] == (b"b", fields[1])


def test_the_last_offset_of_an_entry_may_not_pass_the_last_stream_id():
    fields = _fields(GOOD)
    (got,) = decode_entries("t", 1, [(b"9-%d" % (2**64 - 1), fields)])
    assert isinstance(got, MalformedMessage) and "last stream ID" in got.reason


def test_an_entry_with_b_and_v_is_a_message_entry():
    (got,) = decode_entries("t", 0, [(b"1-1", [b"b", b"x", b"v", b"val"])])
    assert type(got) is Message and got.value == b"val"


def test_timestamps_are_per_message_when_the_batch_has_them():
    blob = batches.blob_from_items("kvt", 2, [b"k", b"v", b"17", b"k2", b"v2", b"18"])
    got = decode_entries("t", 0, [(b"3-0", [b"b", blob, b"n", b"2"])])
    assert [(m.key, m.value, m.timestamp_ms) for m in got] == [(b"k", b"v", 17), (b"k2", b"v2", 18)]


def test_the_producers_resp_arguments_become_the_same_blob():
    msgs = [(b"k1", b"v1", b"h", b"m1"), (b"k2", b"", b"", b"m2")]
    parts = [p for m in msgs for p in encode_message(*m)]
    items = batches.resp_items(b"".join(parts))
    assert items == [x for m in msgs for x in m]
    blob = batches.blob_from_items("kvhm", 2, items)
    assert blob == batches.encode_batch([b"v1", b""], [b"k1", b"k2"], [b"h", None], [b"m1", b"m2"])


needs_c = pytest.mark.skipif(records._batch_messages is None, reason="redisq._speedups not built")


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    st.lists(message, min_size=1, max_size=9),
    st.booleans(),
    st.integers(0, 10),
    st.integers(0, 10),
    st.one_of(st.none(), st.binary(max_size=2)),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=2),
    st.sampled_from([b"3", None]),
)
def test_the_c_loop_and_the_python_loop_give_the_same_messages(
    msgs, stamped, after, upto, bitmap, flips, base
):
    """redisq._speedups.batch_messages builds what decode_entries_py's Python loop builds, for
    every column mix, cut and settled bitmap, and refuses (the Python decoder naming the rule)
    every blob the Python decoder refuses: bytes of the blob flipped at random."""
    blob = batches.encode_batch(
        [m[1] for m in msgs],
        [m[0] for m in msgs],
        [encode_headers(m[2]) if m[2] else None for m in msgs],
        [m[3] for m in msgs],
        [1000 + i for i in range(len(msgs))] if stamped else None,
    )
    changed = bytearray(blob)
    for at, byte in flips:
        if at < len(changed):
            changed[at] = byte
    fields = [b"b", bytes(changed), b"n", b"%d" % len(msgs), b"p", b"7"]
    if base is not None:
        fields += [b"s", base]
    entries = [(b"5-2", fields), (b"6-0", [b"v", b"next"])]
    cuts = {"after": f"5-{after}", "upto": f"5-{2 + upto}", "acked": {"5-2": bitmap}}
    with_c = decode_entries_py("t", 1, entries, [2, 1], **cuts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records, "_batch_messages", None)
        in_python = decode_entries_py("t", 1, entries, [2, 1], **cuts)
    assert [(type(m), m) for m in with_c] == [(type(m), m) for m in in_python]


layouts = st.sampled_from(["v", "kv", "kvh", "kvm", "kvhm", "vm", "kvt", "kvhmt", "vt"])


@needs_c
@settings(max_examples=300, deadline=None)
@given(layouts, st.lists(message, min_size=1, max_size=9), st.integers(0, 2**63 - 1))
def test_the_c_packer_builds_the_python_packers_blob(layout, msgs, stamp):
    """redisq._speedups.blob_from_resp(layout, n, RESP arguments) is the blob the Python path
    builds from the same arguments (empty keys, headers or ids leave their column out)."""
    columns = {"k": 0, "v": 1, "h": 2, "m": 3}
    items = []
    for i, m in enumerate(msgs):
        for letter in layout:
            if letter == "t":
                items.append(b"%d" % (stamp + i))
            elif letter == "h":
                items.append(encode_headers(m[2]) if m[2] else b"")
            else:
                items.append(m[columns[letter]] or b"")
    body = b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in items)
    expected = batches.blob_from_resp_py(layout, len(msgs), body)
    assert batches.blob_from_resp(layout, len(msgs), body) == expected
    assert batches.blob_from_resp is not batches.blob_from_resp_py


@needs_c
@pytest.mark.parametrize(
    ("layout", "count", "body"),
    [
        ("kv", 2, b"$1\r\nk\r\n$1\r\nv\r\n"),  # too few items
        ("kv", 1, b"$1\r\nk\r\n$1\r\nv\r\n$1\r\nx\r\n"),  # too many
        ("kv", 1, b"$1\r\nk\r\n*1\r\nv\r\n"),  # not a bulk string
        ("kv", 1, b"$1\r\nk\r\n$5\r\nv\r\n"),  # a length past the end
        ("kv", 0, b""),  # no message
    ],
)
def test_the_c_packer_refuses_what_the_python_packer_refuses(layout, count, body):
    with pytest.raises(ValueError):
        batches.blob_from_resp_py(layout, count, body)
    with pytest.raises(ValueError):
        batches.blob_from_resp(layout, count, body)


@needs_c
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["vm", "kvm", "kvhm", "kvmt"]), st.lists(message, min_size=1, max_size=9))
def test_the_c_packer_gives_the_ids_as_the_python_packer_does(layout, msgs):
    columns = {"k": 0, "v": 1, "h": 2, "m": 3}
    items = []
    for i, m in enumerate(msgs):
        for letter in layout:
            if letter == "t":
                items.append(b"%d" % (1000 + i))
            elif letter == "h":
                items.append(encode_headers(m[2]) if m[2] else b"")
            else:
                items.append(
                    m[columns[letter]] or b"id%d" % i
                    if letter == "m"
                    else m[columns[letter]] or b""
                )
    body = b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in items)
    blob, ids = batches.blob_and_ids(layout, len(msgs), body)
    assert (blob, ids) == batches.blob_and_ids_py(layout, len(msgs), body)
    assert batches.resp_items(ids) == items[layout.index("m") :: len(layout)]


@needs_c
def test_decoded_messages_are_not_traced_by_the_cycle_collector():
    """The C decoder's Messages (of batch and message entries) hold no container that could
    close a cycle, so it leaves them untracked: a poll() of thousands, held while the caller
    handles them, is not traced by every collection (1.5 us per message against 0.4)."""
    blob = batches.encode_batch([b"v0", b"v1"], [b"k0", b"k1"], None, None)
    entries = [(b"5-0", [b"b", blob, b"n", b"2", b"p", b"7", b"s", b"1"])]
    entries.append((b"6-0", [b"k", b"k2", b"v", b"v2", b"p", b"7", b"s", b"3"]))
    messages = records.decode_entries("t", 0, entries)
    assert [(m.offset, m.key, m.value) for m in messages] == [
        ("5-0", b"k0", b"v0"),
        ("5-1", b"k1", b"v1"),
        ("6-0", b"k2", b"v2"),
    ]
    assert not any(gc.is_tracked(m) for m in messages)
    gc.collect()
    assert [m.sequence for m in messages] == [1, 2, 3]
