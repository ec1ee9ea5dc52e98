"""Arrow rows of batch entries (DESIGN §14.10): row by row equal to records.decode_entries_py,
with the cuts of a range that starts or ends inside an entry; and the same for the entries a
real server gives back (XRANGE of a batch topic written by the producer)."""
# ruff: noqa: F811  (pytest fixtures are imported from tests.spark.fixtures)

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("pyarrow")

import redisq  # noqa: E402
from redisq.model.batches import encode_batch  # noqa: E402
from redisq.model.records import MalformedMessage, decode_entries_py, encode_headers  # noqa: E402
from spark_connector.arrow_rows import MalformedCount, arrow_schema, to_record_batch  # noqa: E402
from spark_connector.raw import RawNodes  # noqa: E402
from spark_connector.scan import xrange  # noqa: E402
from tests.spark.fixtures import spark_broker  # noqa: E402, F401

SCHEMA = arrow_schema(True, True)


def rows_of(entries: list[Any], **cuts: Any) -> list[dict[str, Any]]:
    batch = to_record_batch(entries, "t", 3, True, True, SCHEMA, **cuts)
    assert batch.schema == SCHEMA
    return batch.to_pylist()


def assert_same(entries: list[Any], after: str | None = None, upto: str | None = None) -> None:
    """Arrow's rows equal decode_entries_py's messages, field by field."""
    rows = rows_of(entries, after=after, upto=upto)
    messages = decode_entries_py("t", 3, entries, after=after, upto=upto)
    assert [r["offset"] for r in rows] == [m.offset for m in messages], (after, upto)
    for row, m in zip(rows, messages, strict=True):
        ms, seq = map(int, m.offset.split("-"))
        assert (row["topic"], row["partition"], row["offset_ms"], row["offset_seq"]) == (
            "t",
            3,
            ms,
            seq,
        )
        assert int(row["timestamp"].timestamp() * 1000) == ms
        if isinstance(m, MalformedMessage):
            assert row["value"] is None
            continue
        assert row["key"] == m.key
        assert row["value"] == m.value
        assert {h["key"]: h["value"] for h in row["headers"]} == m.headers
        assert row["producer_id"] == m.producer_id
        assert row["sequence"] == m.sequence
        assert row["message_id"] == m.message_id


def batch_entry(entry_id: bytes, values: list[bytes], **columns: Any) -> tuple[bytes, list[bytes]]:
    extra: list[bytes] = []
    for name in ("p", "s"):
        if name in columns:
            extra += [name.encode(), str(columns.pop(name)).encode()]
    blob = encode_batch(values, **columns)
    return entry_id, [b"b", blob, b"n", b"%d" % len(values), *extra]


ENTRIES = [
    (b"5-0", [b"k", b"key", b"v", b"val", b"p", b"7", b"s", b"0"]),
    batch_entry(
        b"6-2",
        [b"a", b"bb", b"", b"dddd"],  # an empty value is a value
        keys=[b"k1", None, b"k3", b"k4"],
        headers=[encode_headers({"x": "1"}), None, None, encode_headers({"y": b"\x00"})],
        message_ids=[b"m1", b"m2", None, b"m4"],
        p=9,
        s=10,
    ),
    (b"6-6", [b"v", b"plain"]),
    batch_entry(b"7-0", [b"q", b"r"]),  # no key, no headers, no ids, no producer
    batch_entry(b"7-2", [b"only"], keys=[b"k"], p=1),
    (b"8-0", [b"b", b"junk", b"n", b"2"]),  # malformed: one row at its ID, value null
    batch_entry(b"9-5", [b"x%d" % i for i in range(300)], keys=[b"k%d" % i for i in range(300)]),
]
OFFSETS = ["4-0", "5-0", "6-1", "6-2", "6-3", "6-5", "6-6", "7-0", "7-1", "7-2", "8-0", "9-5"]
OFFSETS += ["9-100", "9-304", "9-305", "10-0"]


def test_whole_entries_equal_the_decoder() -> None:
    assert_same(ENTRIES)
    rows = rows_of(ENTRIES)
    assert len(rows) == 1 + 4 + 1 + 2 + 1 + 1 + 300
    assert [r["offset"] for r in rows[1:5]] == ["6-2", "6-3", "6-4", "6-5"]
    assert rows[2]["key"] is None and rows[3]["value"] == b"" and rows[3]["message_id"] is None
    assert [r["sequence"] for r in rows[1:5]] == [10, 11, 12, 13]


def test_cuts_equal_the_decoder() -> None:
    """Every pair of cuts among offsets before, at, inside, at the end of and after entries."""
    for after, upto in itertools.product([None, *OFFSETS], [None, *OFFSETS]):
        assert_same(ENTRIES, after=after, upto=upto)


def test_a_malformed_batch_entry_is_counted_once() -> None:
    malformed = MalformedCount()
    to_record_batch(ENTRIES, "t", 3, False, False, arrow_schema(False, False), malformed)
    assert malformed.count == 1 and malformed.first is not None
    assert malformed.first.offset == "8-0"


def test_bad_headers_make_the_entry_malformed_as_in_the_decoder() -> None:
    entries = [batch_entry(b"3-0", [b"a", b"b"], headers=[b"\x00\x05xx", None])]
    assert_same(entries)
    assert len(rows_of(entries)) == 1


def test_entries_read_from_a_batch_topic_equal_the_decoder(spark_broker: redisq.Broker) -> None:
    spark_broker.create_topic("bt", partitions=1, entry_format="batch")
    with spark_broker.producer(linger_ms=50, max_batch_messages=64) as producer:
        for i in range(500):
            producer.send_async(
                "bt", b"v%d" % i, key=b"k%d" % (i % 5) if i % 3 else None, headers={"i": str(i)}
            )
        producer.flush()
    key = spark_broker.keys.log("bt", 0)
    (entries,) = RawNodes(spark_broker.client).run_all([(key, xrange(key, "-", "+", 10_000))])
    assert 1 < len(entries) < 500  # batch entries, several of them
    assert_same(entries)
    offsets = [m.offset for m in decode_entries_py("bt", 0, entries)]
    assert len(offsets) == 500
    for after, upto in [(offsets[3], offsets[77]), (offsets[100], None), (None, offsets[-2])]:
        assert_same(entries, after=after, upto=upto)
