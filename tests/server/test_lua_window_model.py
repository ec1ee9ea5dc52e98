"""Property-based tests of the broker-side idempotence logic against a Python model.

The Lua scripts are driven directly (no producer in between), on fakeredis and on a real
valkey-server, by hypothesis state machines that interleave everything a producer, its retries
and its zombies can do:

* produce_sequence.lua (DESIGN §3A): per (PID, partition) an epoch, the next expected sequence
  and a window of the last W batches with the stream ID each was first written at. New batches in
  order, re-sends of any earlier batch (inside or outside the window), batches beyond a gap,
  lost replies, restarts with a newer epoch (with or without fence_producer.lua), zombies that
  keep sending with an older epoch, and the state key expiring (DEL) so that acked_next is used;
  for named producers, a write to a partition without the instance's epoch is refused
  (UNKNOWN_PRODUCER) until the instance stores it there (fence_producer.lua).
* produce_message_id.lua (DESIGN §3B): batch numbers keep in-flight batches in order; message
  ids are written once per dedup window (the ring of two buckets, time slices from the server's
  clock), duplicates inside one batch and across batches answer the ID the id was first written
  at. The window is so long that the real clock never moves to another slice during a test;
  the model moves time on by aging the ring's buckets (what a later TIME would see).

The scripts are called through the protocol layer (redisq.protocol.produce), as the producer
calls them.

After every step the script's reply and the whole stream (XRANGE) must equal the model's.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import redisq
from redisq.errors import OutOfOrderSequence, ProducerFenced, UnknownProducer
from redisq.model.offsets import offset_at, offset_parts
from redisq.model.topic import TopicConfig
from redisq.protocol import ScriptCall
from redisq.protocol.produce import (
    BatchResult,
    ProducerIdentity,
    encode_message,
    fence_partition,
    produce,
)

STATE_TTL_MS = 600_000
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

BrokerFactory = Callable[[], redisq.Broker]


def fake_broker() -> redisq.Broker:
    return redisq.connect(client=fakeredis.FakeRedis(), namespace=f"m{uuid.uuid4().hex[:10]}")


def real_broker_factory(url: str) -> BrokerFactory:
    client = redis.Redis.from_url(url)

    def make() -> redisq.Broker:
        return redisq.Broker(client, namespace=f"m{uuid.uuid4().hex[:10]}")

    return make


def drop(broker: redisq.Broker) -> None:
    keys = list(broker.client.scan_iter(match=broker.keys.pattern(), count=1000))
    if keys:
        broker.client.delete(*keys)


def read_stream(broker: redisq.Broker, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    return [(entry_id.decode(), dict(fields)) for entry_id, fields in broker.client.xrange(key)]


def call(broker: redisq.Broker, script_call: ScriptCall[Any]) -> Any:
    """The decoded reply, or the typed error the script answered with."""
    try:
        return broker.scripts.run(script_call)
    except (OutOfOrderSequence, ProducerFenced, UnknownProducer) as exc:
        return exc


@dataclass
class WireBatch:
    """A sealed batch as protocol.produce takes it (args: RESP pieces of every message)."""

    topic: str
    partition: int
    layout: str
    count: int
    base_seq: int
    args: list[bytes]
    body: bytes | None = None
    body_count: int = 0


def wire_batch(topic: str, base: int, layout: str, messages: list[dict[str, bytes]]) -> WireBatch:
    args: list[bytes] = []
    for message in messages:
        get = message.get
        args += encode_message(
            get("k") if "k" in layout else None,
            message["v"],
            get("h") if "h" in layout else None,
            get("m") if "m" in layout else None,
        )
    return WireBatch(topic, 0, layout, len(messages), base, args)


def stored_fields(layout: str, message: dict[str, bytes]) -> dict[bytes, bytes]:
    """What append.lua stores: every letter of the layout except empty k/h/m, v always."""
    return {
        letter.encode(): message[letter]
        for letter in layout
        if letter == "v" or message[letter] != b""
    }


def check_appended(
    model_stream: list[tuple[str, dict[bytes, bytes]]], first_id: str, count: int
) -> list[str]:
    """IDs of `count` appended messages from first_id: consecutive, after everything before."""
    ids = [offset_at(first_id, i) for i in range(count)]
    if model_stream:
        assert offset_parts(ids[0]) > offset_parts(model_stream[-1][0])
    return ids


# == produce_sequence ===========================================================================

LAYOUTS = ["v", "kv", "kvh", "vm"]


@dataclass
class SeqBatch:
    base: int
    count: int
    layout: str
    messages: list[dict[str, bytes]]

    @property
    def end(self) -> int:
        return self.base + self.count


@dataclass
class Instance:
    """One running instance of a producer: a PID with an epoch, and its immutable batches."""

    pid: int
    epoch: int
    named: bool = False  # a named producer's instance (UNKNOWN_PRODUCER without its epoch)
    batches: list[SeqBatch] = field(default_factory=list)
    acked_next: int = 0  # what the producer sends as acked_next
    fenced: bool = False  # it received PRODUCER_FENCED and stopped

    @property
    def identity(self) -> ProducerIdentity:
        return ProducerIdentity(self.pid, self.epoch, f"p{self.pid}" if self.named else None)

    @property
    def next_base(self) -> int:
        return self.batches[-1].end if self.batches else 0

    @property
    def name(self) -> str:
        return f"{self.pid}/e{self.epoch}"


@dataclass
class PidState:
    """The model of the state hash of (partition, PID)."""

    epoch: int
    next: int
    window: list[tuple[int, int, str]] = field(default_factory=list)  # (base, count, first ID)


class ScriptMachine(RuleBasedStateMachine):
    """A one-partition topic in a namespace of its own, dropped after each example."""

    topic = "orders"

    def __init__(self, make_broker: BrokerFactory) -> None:
        super().__init__()
        self.broker = make_broker()
        self.broker.create_topic(self.topic)
        self.log = self.broker.keys.log(self.topic, 0)

    def teardown(self) -> None:
        try:
            drop(self.broker)
        finally:
            if redisq.server.scripts.is_fake(self.broker.client):
                self.broker.close()

    def state_key(self, pid: int) -> str:
        return self.broker.keys.producer_state(self.topic, 0, pid)


class SequenceWindowMachine(ScriptMachine):
    def __init__(self, make_broker: BrokerFactory) -> None:
        super().__init__(make_broker)
        self.instances: list[Instance] = []
        self.states: dict[int, PidState] = {}
        self.stream: list[tuple[str, dict[bytes, bytes]]] = []
        self.written_end: dict[tuple[int, int], int] = {}  # (pid, epoch) -> end of writes
        self.window = 1
        self.calls = 0
        self.failover_point: tuple[Any, ...] | None = None  # the broker before the last append
        self.lost: set[tuple[bytes, bytes, int]] = set()  # (pid, epoch, seq) lost by failovers

    # -- set-up ---------------------------------------------------------------------------------
    @initialize(window=st.integers(1, 4), named=st.lists(st.booleans(), min_size=1, max_size=2))
    def setup(self, window: int, named: list[bool]) -> None:
        self.window = window
        for pid, is_named in enumerate(named, start=1):
            self.instances.append(Instance(pid=pid, epoch=0, named=is_named))

    def live(self) -> list[Instance]:
        return [i for i in self.instances if not i.fenced]

    # -- the model of produce_sequence.lua -------------------------------------------------------
    def model_produce(self, inst: Instance, batch: SeqBatch) -> tuple[str, Any]:
        state = self.states.get(inst.pid)
        if state is not None and inst.epoch < state.epoch:
            return "FENCED", (state.epoch, inst.epoch)
        if state is not None and state.epoch == inst.epoch:
            next_seq, window = state.next, state.window
        elif inst.named:
            # A named instance must have its epoch stored here first: nothing is written.
            return "UNKNOWN", None
        else:
            # No state for this epoch (expired, or a newer epoch no fence reached): acked_next.
            # A newer epoch is remembered at once, so an older instance is fenced from now on.
            next_seq, window = inst.acked_next, []
            self.states[inst.pid] = PidState(inst.epoch, next_seq, [])
        # The broker may hold less than it acknowledged (a failover lost the last writes): the
        # producer never re-sends what was acknowledged, so the sequence moves on to acked_next.
        next_seq = max(next_seq, inst.acked_next)
        if batch.base < next_seq:
            for base, count, first in window:
                if (base, count) == (batch.base, batch.count):
                    return "DUP", first
            return "DUP", None
        if batch.base > next_seq:
            return "OUT_OF_ORDER", next_seq
        return "OK", None

    def send(self, inst: Instance, batch: SeqBatch, lose_reply: bool) -> None:
        self.calls += 1
        ttl_ms = STATE_TTL_MS + 1000 * self.calls  # a new TTL per call: is it refreshed?
        config = TopicConfig(self.topic, 1, producer_state_ttl_ms=ttl_ms)
        wire = wire_batch(self.topic, batch.base, batch.layout, batch.messages)
        before = self.snapshot()
        self.failover_point = None
        expected, detail = self.model_produce(inst, batch)
        reply = call(
            self.broker,
            produce(
                self.broker.keys,
                "sequence",
                inst.identity,
                config,
                wire,
                acked_next=inst.acked_next,
                window=self.window,
            ),
        )
        where = f"{inst.name} batch {batch.base}+{batch.count}"
        if expected == "FENCED":
            assert isinstance(reply, ProducerFenced), (where, reply)
            assert f"stored={detail[0]} got={detail[1]}" in str(reply)
            inst.fenced = True  # a fenced producer stops for good
            return
        if expected == "UNKNOWN":
            assert isinstance(reply, UnknownProducer), (where, reply)
            return
        if expected == "OUT_OF_ORDER":
            assert isinstance(reply, OutOfOrderSequence), (where, reply)
            assert reply.expected == detail, (where, reply.expected, detail)
            return
        assert isinstance(reply, BatchResult), (where, reply)
        if expected == "DUP":
            assert reply.duplicate, (where, reply)
            assert reply.first_id == detail, (where, reply, detail)
        else:
            assert not reply.duplicate and reply.first_id, (where, reply)
            first_id = reply.first_id
            ids = check_appended(self.stream, first_id, batch.count)
            for i, (entry_id, message) in enumerate(zip(ids, batch.messages, strict=True)):
                stored = stored_fields(batch.layout, message)
                stored[b"p"] = b"%d" % inst.pid
                stored[b"s"] = b"%d" % (batch.base + i)
                self.stream.append((entry_id, stored))
            state = self.states[inst.pid]
            state.next = batch.end
            state.window = (state.window + [(batch.base, batch.count, first_id)])[-self.window :]
            key = (inst.pid, inst.epoch)
            self.written_end[key] = max(self.written_end.get(key, 0), batch.end)
            # Every write refreshes the state's expiry.
            assert self.broker.client.pttl(self.state_key(inst.pid)) > ttl_ms - 1000
            self.failover_point = before
        if not lose_reply:  # the producer learns the batch is stored (new or duplicate)
            inst.acked_next = max(inst.acked_next, batch.end)

    def cut(self, inst: Instance, count: int, layout: str) -> SeqBatch:
        base = inst.next_base
        messages = []
        for seq in range(base, base + count):
            messages.append(
                {
                    "k": b"key-%d" % inst.pid,
                    "v": b"%d:%d" % (inst.epoch, seq) + (b"\x00\xff" if seq % 3 == 0 else b""),
                    "h": b"" if seq % 2 else b"\x00\x01h\x00\x00\x00\x01x",
                    # The client never sends an empty key or message id (append.lua's fast
                    # paths rely on it); only the headers blob may be empty.
                    "m": f"ü-{seq}".encode(),
                }
            )
        batch = SeqBatch(base, count, layout, messages)
        inst.batches.append(batch)
        return batch

    # -- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: self.live())
    @rule(
        data=st.data(),
        count=st.integers(1, 4),
        layout=st.sampled_from(LAYOUTS),
        lose_reply=st.booleans(),
    )
    def send_next(self, data: st.DataObject, count: int, layout: str, lose_reply: bool) -> None:
        """What a producer does: (re-)send its oldest unacknowledged batch, or a new one."""
        inst = data.draw(st.sampled_from(self.live()), label="instance")
        pending = [b for b in inst.batches if b.end > inst.acked_next]
        batch = pending[0] if pending else self.cut(inst, count, layout)
        self.send(inst, batch, lose_reply)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), count=st.integers(1, 4), layout=st.sampled_from(LAYOUTS))
    def cut_unsent(self, data: st.DataObject, count: int, layout: str) -> None:
        """A batch is sealed but its request is lost: the next one arrives beyond a gap."""
        self.cut(data.draw(st.sampled_from(self.live()), label="instance"), count, layout)

    @precondition(lambda self: any(i.batches for i in self.live()))
    @rule(data=st.data(), lose_reply=st.booleans())
    def send_any(self, data: st.DataObject, lose_reply: bool) -> None:
        """Any batch of an instance: a duplicate inside or outside the window, or a gap."""
        inst = data.draw(st.sampled_from([i for i in self.live() if i.batches]), label="instance")
        batch = data.draw(st.sampled_from(inst.batches), label="batch")
        self.send(inst, batch, lose_reply)

    @precondition(lambda self: any(i.batches for i in self.live()))
    @rule(data=st.data(), lose_reply=st.booleans())
    def send_newest(self, data: st.DataObject, lose_reply: bool) -> None:
        """The newest batch of an instance: beyond a gap when earlier ones were never sent."""
        inst = data.draw(st.sampled_from([i for i in self.live() if i.batches]), label="instance")
        self.send(inst, inst.batches[-1], lose_reply)

    def snapshot(self) -> tuple[Any, ...]:
        """The broker's state keys and the model, to undo the next append (a failover)."""
        client = self.broker.client
        raw = {}
        for pid in {i.pid for i in self.instances}:
            key = self.state_key(pid)
            raw[pid] = (client.hgetall(key), client.pttl(key))
        return raw, copy.deepcopy(self.states), len(self.stream), dict(self.written_end)

    @precondition(lambda self: self.failover_point is not None)
    @rule()
    def failover_loses_last_write(self) -> None:
        """acks="leader" and a failover to a replica that missed the last batch: the broker
        forgets a write it acknowledged (DESIGN §3: documented loss). The producer goes on from
        its acked_next; it must not be stuck with OUT_OF_ORDER, nor write anything twice."""
        assert self.failover_point is not None
        raw, states, length, written_end = self.failover_point
        self.failover_point = None
        client = self.broker.client
        lost = self.stream[length:]
        client.xdel(self.log, *[entry_id for entry_id, _ in lost])
        for pid, (fields, pttl) in raw.items():
            key = self.state_key(pid)
            client.delete(key)
            if fields:
                client.hset(key, mapping=fields)
                client.pexpire(key, pttl)
        for _, fields in lost:
            epoch = fields[b"v"].split(b":")[0]
            self.lost.add((fields[b"p"], epoch, int(fields[b"s"])))
        self.stream = self.stream[:length]
        self.states = states
        self.written_end = written_end

    @rule(data=st.data(), fence=st.booleans())
    def restart(self, data: st.DataObject, fence: bool) -> None:
        """A new instance of a producer: a newer epoch, sequences from 0. The older instance
        lives on as a zombie until it is told it was fenced."""
        pid = data.draw(st.sampled_from(sorted({i.pid for i in self.instances})), label="pid")
        older = [i for i in self.instances if i.pid == pid]
        inst = Instance(pid=pid, epoch=max(i.epoch for i in older) + 1, named=older[0].named)
        self.instances.append(inst)
        if fence:
            self.fence_instance(inst)

    def fence_instance(self, inst: Instance) -> None:
        """fence_producer.lua: what a producer does at start, and after UNKNOWN_PRODUCER."""
        self.failover_point = None
        config = TopicConfig(self.topic, 1, producer_state_ttl_ms=STATE_TTL_MS)
        reply = call(self.broker, fence_partition(self.broker.keys, inst.identity, config, 0))
        state = self.states.get(inst.pid)
        if state is not None and state.epoch > inst.epoch:
            assert isinstance(reply, ProducerFenced), reply
            inst.fenced = True
            return
        assert reply is (state is None or state.epoch < inst.epoch), (reply, state)
        if state is None or state.epoch < inst.epoch:
            self.states[inst.pid] = PidState(inst.epoch, 0, [])

    @precondition(lambda self: any(i.named for i in self.live()))
    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        """A named instance stores its epoch on the partition (after UNKNOWN_PRODUCER)."""
        inst = data.draw(st.sampled_from([i for i in self.live() if i.named]), label="instance")
        self.fence_instance(inst)

    @rule(data=st.data())
    def expire_state(self, data: st.DataObject) -> None:
        """The state key expires. Its TTL is never shorter than the producers' retry horizon,
        so it only expires once every live instance has its writes acknowledged."""
        pid = data.draw(st.sampled_from(sorted({i.pid for i in self.instances})), label="pid")
        for inst in self.instances:
            if inst.pid == pid and not inst.fenced:
                if self.written_end.get((pid, inst.epoch), 0) > inst.acked_next:
                    return  # an unacknowledged write: the TTL would not run out yet
        self.failover_point = None
        self.broker.client.delete(self.state_key(pid))
        self.states.pop(pid, None)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def stream_matches_model(self) -> None:
        assert read_stream(self.broker, self.log) == self.stream

    @invariant()
    def state_matches_model(self) -> None:
        ttl_limit = STATE_TTL_MS + 1000 * self.calls
        for pid in {i.pid for i in self.instances}:
            raw = self.broker.client.hgetall(self.state_key(pid))
            model = self.states.get(pid)
            if model is None:
                assert raw == {}, (pid, raw)
                continue
            assert int(raw[b"epoch"]) == model.epoch and int(raw[b"next"]) == model.next
            assert 0 < self.broker.client.pttl(self.state_key(pid)) <= ttl_limit

    @invariant()
    def every_sequence_once_in_order(self) -> None:
        """Independent of the model: per (PID, epoch), the stream holds sequences 0, 1, 2, ...
        each exactly once and in order; the only gaps are writes a failover lost."""
        seen: dict[tuple[bytes, bytes], list[int]] = {}
        for _, fields in read_stream(self.broker, self.log):
            epoch = fields[b"v"].split(b":")[0]
            seen.setdefault((fields[b"p"], epoch), []).append(int(fields[b"s"]))
        for (pid, epoch), sequences in seen.items():
            assert sequences == sorted(set(sequences)), (pid, epoch, sequences)
            missing = set(range(sequences[-1])) - set(sequences)
            assert all((pid, epoch, s) in self.lost for s in missing), (pid, epoch, missing)


# == produce_message_id =========================================================================

MESSAGE_IDS = [b"a", b"b", b"c", b"d", b"e", "ü-1".encode(), b"\x00\xff", b"42"]
ID_LAYOUTS = ["vm", "kvm", "vhm", "kvhm"]


@dataclass
class IdBatch:
    number: int
    layout: str
    messages: list[dict[str, bytes]]


@dataclass
class IdProducer:
    pid: int
    batches: list[IdBatch] = field(default_factory=list)
    acked_next: int = 0


# So long that the server's clock never enters another slice during a test: the model moves time
# on by aging the buckets instead (next_time_slice).
DEDUP_WINDOW_MS = 10**12


class MessageIdMachine(ScriptMachine):
    topic = "ids"

    def __init__(self, make_broker: BrokerFactory) -> None:
        super().__init__(make_broker)
        seconds, micros = self.broker.client.time()
        self.slice = (int(seconds) * 1000 + int(micros) // 1000) // DEDUP_WINDOW_MS
        self.current: dict[bytes, str] = {}  # model of the current slice's bucket
        self.previous: dict[bytes, str] = {}  # and of the previous slice's
        self.last_batch: dict[int, int] = {}  # model of the state hash's `batch` field
        self.stream: list[tuple[str, dict[bytes, bytes]]] = []
        self.producers = [IdProducer(pid=1), IdProducer(pid=2)]
        self.rotations = 0

    def model_produce(self, producer: IdProducer, batch: IdBatch) -> tuple[str, Any]:
        last = self.last_batch.get(producer.pid)
        if last is None:  # no state: the script stores acked_next - 1 before it checks
            last = self.last_batch[producer.pid] = producer.acked_next - 1
        expected = max(last + 1, producer.acked_next)
        if batch.number > expected:
            return "OUT_OF_ORDER", expected
        previous = self.previous
        current = self.current
        flags: list[str] = []
        dups: list[str | int] = []  # an int j: the j-th message appended by this very batch
        fresh: list[bytes] = []
        claimed: dict[bytes, int] = {}
        for message in batch.messages:
            mid = message["m"]
            earlier: str | int | None = previous.get(mid) or current.get(mid)
            if earlier is None:
                earlier = claimed.get(mid)
            if earlier is None:
                claimed[mid] = len(fresh)  # its ID is known once the script answers
                flags.append("0")
                fresh.append(mid)
            else:
                flags.append("1")
                dups.append(earlier)
        if batch.number == expected:
            self.last_batch[producer.pid] = batch.number
        return "OK", ("".join(flags), dups, fresh)

    def send(self, producer: IdProducer, batch: IdBatch, lose_reply: bool) -> None:
        config = TopicConfig(
            self.topic, 1, dedup_window_ms=DEDUP_WINDOW_MS, producer_state_ttl_ms=STATE_TTL_MS
        )
        wire = wire_batch(self.topic, batch.number, batch.layout, batch.messages)
        expected, detail = self.model_produce(producer, batch)
        reply = call(
            self.broker,
            produce(
                self.broker.keys,
                "message_id",
                ProducerIdentity(producer.pid, 0),
                config,
                wire,
                acked_next=producer.acked_next,
                window=1,
            ),
        )
        where = f"pid {producer.pid} batch {batch.number}"
        if expected == "OUT_OF_ORDER":
            assert isinstance(reply, OutOfOrderSequence), (where, reply)
            assert reply.expected == detail, (where, reply.expected, detail)
            return
        flags, dups, fresh = detail
        assert isinstance(reply, BatchResult), (where, reply)
        assert reply.flags == flags, (where, reply, flags)
        first_id = reply.first_id or ""
        assert (first_id == "") == (not fresh), (where, reply)
        # A repeat inside the batch answers the ID its first occurrence was just written at.
        dup_ids = [offset_at(first_id, d) if isinstance(d, int) else d for d in dups]
        assert list(reply.duplicate_ids) == dup_ids, (where, reply, dup_ids)
        if fresh:
            ids = check_appended(self.stream, first_id, len(fresh))
            appended = [m for m, f in zip(batch.messages, flags, strict=True) if f == "0"]
            for entry_id, message in zip(ids, appended, strict=True):
                self.current[message["m"]] = entry_id
                stored = stored_fields(batch.layout, message)
                stored[b"p"] = b"%d" % producer.pid
                self.stream.append((entry_id, stored))
        if not lose_reply:
            producer.acked_next = max(producer.acked_next, batch.number + 1)

    def cut(self, producer: IdProducer, ids: list[bytes], layout: str) -> IdBatch:
        number = len(producer.batches)
        messages = [
            {
                "k": b"k%d" % producer.pid,
                "v": b"%d:%d:%d" % (producer.pid, number, i),
                "h": b"" if i % 2 else b"\x00\x01h\x00\x00\x00\x00",
                "m": mid,
            }
            for i, mid in enumerate(ids)
        ]
        batch = IdBatch(number, layout, messages)
        producer.batches.append(batch)
        return batch

    ids_strategy = st.lists(st.sampled_from(MESSAGE_IDS), min_size=1, max_size=5)

    @rule(
        data=st.data(),
        ids=ids_strategy,
        layout=st.sampled_from(ID_LAYOUTS),
        lose_reply=st.booleans(),
    )
    def send_next(
        self, data: st.DataObject, ids: list[bytes], layout: str, lose_reply: bool
    ) -> None:
        producer = data.draw(st.sampled_from(self.producers), label="producer")
        pending = [b for b in producer.batches if b.number >= producer.acked_next]
        batch = pending[0] if pending else self.cut(producer, ids, layout)
        self.send(producer, batch, lose_reply)

    @rule(data=st.data(), ids=ids_strategy, layout=st.sampled_from(ID_LAYOUTS))
    def cut_unsent(self, data: st.DataObject, ids: list[bytes], layout: str) -> None:
        self.cut(data.draw(st.sampled_from(self.producers), label="producer"), ids, layout)

    @precondition(lambda self: any(p.batches for p in self.producers))
    @rule(data=st.data(), lose_reply=st.booleans())
    def send_any(self, data: st.DataObject, lose_reply: bool) -> None:
        producer = data.draw(
            st.sampled_from([p for p in self.producers if p.batches]), label="producer"
        )
        batch = data.draw(st.sampled_from(producer.batches), label="batch")
        self.send(producer, batch, lose_reply)

    def bucket_keys(self) -> tuple[str, str]:
        """The ring's bucket of the server's current slice, and of the previous one."""
        keys = self.broker.keys
        return (
            keys.dedup_bucket(self.topic, 0, self.slice % 2),
            keys.dedup_bucket(self.topic, 0, (self.slice + 1) % 2),
        )

    @rule()
    def next_time_slice(self) -> None:
        """The dedup window moves on: ids of the slice before the previous one are forgotten.
        In Redis: the current bucket becomes the previous slice's (what the script would see one
        slice later), and the current slice starts with no bucket."""
        current, previous = self.bucket_keys()
        client = self.broker.client
        if client.exists(current):
            client.rename(current, previous)
            client.hset(previous, "", self.slice - 1)
        else:
            client.delete(previous)
        self.previous, self.current = self.current, {}
        self.rotations += 1

    @rule(data=st.data())
    def expire_state(self, data: st.DataObject) -> None:
        producer = data.draw(st.sampled_from(self.producers), label="producer")
        self.broker.client.delete(self.state_key(producer.pid))
        self.last_batch.pop(producer.pid, None)

    @invariant()
    def stream_matches_model(self) -> None:
        assert read_stream(self.broker, self.log) == self.stream

    @invariant()
    def ids_once_per_window(self) -> None:
        """Independent of the model: until the window moves twice, every id is stored once."""
        if self.rotations < 2:
            ids = [fields[b"m"] for _, fields in self.stream]
            assert len(ids) == len(set(ids))

    @invariant()
    def buckets_match_model(self) -> None:
        """Each bucket holds its slice number under the field "" and the ids of that slice."""
        for key, model, slice_ in zip(
            self.bucket_keys(),
            (self.current, self.previous),
            (self.slice, self.slice - 1),
            strict=True,
        ):
            raw = {k: v.decode() for k, v in self.broker.client.hgetall(key).items()}
            if model:
                assert raw.pop(b"") == str(slice_)
            assert raw == model


# == the tests ==================================================================================


def run(machine: type[RuleBasedStateMachine], make_broker: BrokerFactory) -> None:
    run_state_machine_as_test(lambda: machine(make_broker), settings=SETTINGS)  # type: ignore[call-arg]


def test_sequence_window_fakeredis() -> None:
    run(SequenceWindowMachine, fake_broker)


def test_sequence_window_valkey(valkey_server: Any) -> None:
    run(SequenceWindowMachine, real_broker_factory(valkey_server.url))


def test_message_id_fakeredis() -> None:
    run(MessageIdMachine, fake_broker)


def test_message_id_valkey(valkey_server: Any) -> None:
    run(MessageIdMachine, real_broker_factory(valkey_server.url))


# == a few fixed scenarios (readable examples of the properties above) ============================


@pytest.fixture
def seq_broker() -> redisq.Broker:
    broker = fake_broker()
    broker.create_topic("t")
    return broker


def produce_seq(
    broker: redisq.Broker,
    base: int,
    count: int,
    *,
    pid: int = 1,
    epoch: int = 0,
    acked_next: int = 0,
    window: int = 2,
) -> Any:
    messages = [{"v": b"%d" % (base + i)} for i in range(count)]
    config = TopicConfig("t", 1, producer_state_ttl_ms=STATE_TTL_MS)
    return call(
        broker,
        produce(
            broker.keys,
            "sequence",
            ProducerIdentity(pid, epoch),
            config,
            wire_batch("t", base, "v", messages),
            acked_next=acked_next,
            window=window,
        ),
    )


def test_sequence_scenario(seq_broker: redisq.Broker) -> None:
    first = produce_seq(seq_broker, 0, 2)
    assert not first.duplicate
    second = produce_seq(seq_broker, 2, 3)
    third = produce_seq(seq_broker, 5, 1)
    # Inside the window (2 batches): the original first ID.
    assert produce_seq(seq_broker, 2, 3) == BatchResult(second.first_id, True)
    assert produce_seq(seq_broker, 5, 1) == BatchResult(third.first_id, True)
    # Older than the window: duplicate, offset unknown.
    assert produce_seq(seq_broker, 0, 2) == BatchResult(None, True)
    # A gap.
    gap = produce_seq(seq_broker, 7, 1)
    assert isinstance(gap, OutOfOrderSequence) and gap.expected == 6
    assert seq_broker.client.xlen(seq_broker.keys.log("t", 0)) == 6


def test_newer_epoch_fences_older_even_when_refused(seq_broker: redisq.Broker) -> None:
    """A newer epoch seen by the broker fences the older one at once, even if its first batch
    was refused (a gap) or was a duplicate: the zombie cannot write in between."""
    assert not produce_seq(seq_broker, 0, 1, epoch=1).duplicate
    refused = produce_seq(seq_broker, 3, 1, epoch=2)
    assert isinstance(refused, OutOfOrderSequence) and refused.expected == 0
    zombie = produce_seq(seq_broker, 1, 1, epoch=1, acked_next=1)
    assert isinstance(zombie, ProducerFenced)
    assert not produce_seq(seq_broker, 0, 1, epoch=2).duplicate
    assert seq_broker.client.xlen(seq_broker.keys.log("t", 0)) == 2
