"""The producers view: what only redisq knows about who writes.

* A named producer's registration ``<ns>:{<ns>}:producer:<name>`` holds the epoch of its
  current instance (init_producer.lua), and its topics set names where it wrote: every partition
  of those topics should carry that epoch in the name's producer state (fence_producer.lua).
  A partition carrying an older epoch has not been fenced by the current instance yet (it will
  be before the name writes there); a newer one would mean the registration was lost.
* The per-partition producer state ``...:pid:<pid>`` (produce_sequence.lua /
  produce_message_id.lua): epoch, next expected sequence, batches written (nb), the window of
  recent batches ``w<slot> = "<base>:<count>:<first id>"``; a message-id producer keeps its last
  batch number instead.
* The dedup buckets ``...:dedup:0|1``: message id -> offset, each holding one time slice of the
  dedup window (its field "" is the slice number; slice s covers [s*window, (s+1)*window) of the
  server's clock). The current slice's bucket and the previous one count; an older one is
  emptied when the ring reuses it.

Named producers' states are read directly (their id is a hash of the name); anonymous producers
are found with SCAN, which walks the whole keyspace: that is why it runs only on the topic's
producers page, on demand, never for the overview or /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from redisq.errors import read_reply
from redisq.model.keys import KeySpace
from redisq.protocol import Command, Operation, Step, run_operation, text
from redisq.protocol.produce import named_producer_id
from redisq.protocol.topics import fields, server_ms

if TYPE_CHECKING:
    from redisq.broker import Broker

MAX_STATES = 5_000  # producer states shown per topic


@dataclass(frozen=True, slots=True)
class WindowBatch:
    slot: int
    base: int
    count: int
    first_offset: str


@dataclass(frozen=True, slots=True)
class ProducerState:
    topic: str
    partition: int
    producer_id: int
    name: str | None  # when the id is a known name's
    epoch: int | None
    next_sequence: int | None  # sequence mode: the next expected sequence
    batches: int | None  # sequence mode: batches written under this epoch
    last_batch: int | None  # message-id mode: the last batch number written
    window: list[WindowBatch]
    ttl_ms: int | None
    fencing: str  # "current", "older instance", "newer than the registration", "" (anonymous)

    @property
    def last_sequence(self) -> int | None:
        return None if self.next_sequence is None else self.next_sequence - 1


@dataclass(frozen=True, slots=True)
class NamedProducer:
    name: str
    producer_id: int
    epoch: int | None
    ttl_ms: int | None
    topics: list[str]


@dataclass(frozen=True, slots=True)
class DedupBucket:
    partition: int
    bucket: int
    ids: int
    slice: int | None
    slice_start_ms: int | None
    slice_end_ms: int | None
    status: str  # "current", "previous", "expired slice", "empty"
    ttl_ms: int | None


def _state_glob(keys: KeySpace, topic: str) -> str:
    """The SCAN pattern of one topic's producer states, made by the key builder itself (with
    "*" for the partition and the id), so it follows keys.py. Topic names hold no glob
    characters (keys.validate_topic). keys.py has no pattern builder for it yet."""
    star = cast(int, "*")
    return keys.producer_state(topic, star, star)


def _scan(broker: Broker, pattern: str, limit: int) -> list[str]:
    found = []
    for key in broker.client.scan_iter(match=pattern, count=1000):
        found.append(text(key))
        if len(found) >= limit:
            break
    return found


def named_producers(broker: Broker) -> list[NamedProducer]:
    """Every registered name, with its epoch, time to live and topics (SCAN, then one
    pipelined round trip)."""
    keys = broker.keys
    prefix = keys.named_producer("")
    # keys.named_producer("*") also matches "<name>:topics"; names never contain ":".
    found = _scan(broker, keys.named_producer("*"), MAX_STATES)
    names = sorted(name for name in (key[len(prefix) :] for key in found) if ":" not in name)

    def read() -> Operation[list[NamedProducer]]:
        steps: list[Step] = []
        for name in names:
            steps += [
                Command(("HGET", keys.named_producer(name), "epoch")),
                Command(("PTTL", keys.named_producer(name))),
                Command(("SMEMBERS", keys.named_producer_topics(name))),
            ]
        replies = yield steps
        found = []
        for i, name in enumerate(names):
            what = f"named producer {name!r}"
            epoch, ttl, topics = (read_reply(r, what) for r in replies[3 * i : 3 * i + 3])
            found.append(
                NamedProducer(
                    name=name,
                    producer_id=named_producer_id(name),
                    epoch=_int(epoch),
                    ttl_ms=_int(ttl) if _int(ttl) is not None and _int(ttl) >= 0 else None,  # type: ignore[operator]
                    topics=sorted(text(t) for t in _ok_list(topics)),
                )
            )
        return found

    return run_operation(read(), broker.scripts.execute)


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _ok_list(value: Any) -> list[Any]:
    return [] if value is None else list(value)


def _window(raw: dict[str, str]) -> list[WindowBatch]:
    batches = []
    for name, value in raw.items():
        if name.startswith("w") and name[1:].isdigit():
            base, _, rest = value.partition(":")
            count, _, first = rest.partition(":")
            if base.isdigit() and count.isdigit():
                batches.append(WindowBatch(int(name[1:]), int(base), int(count), first))
    return sorted(batches, key=lambda b: b.base)


def topic_producers(
    broker: Broker, topic: str, named: list[NamedProducer] | None = None
) -> list[ProducerState]:
    """Every producer state on the topic's partitions (SCAN for the keys, one pipelined round
    trip for their hashes and ttls), by partition then producer id; named: to name the ids."""
    keys = broker.keys
    config = broker.topic_config(topic, refresh=True)
    found = _scan(broker, _state_glob(keys, topic), MAX_STATES)
    by_id = {n.producer_id: n for n in (named or [])}
    parsed: list[tuple[int, int, str]] = []
    for key in found:
        head, _, pid = key.rpartition(":pid:")
        partition = head.rpartition(":")[2].rstrip("}")
        if pid.isdigit() and partition.isdigit() and int(partition) < config.partitions:
            if keys.producer_state(topic, int(partition), int(pid)) == key:
                parsed.append((int(partition), int(pid), key))
    parsed.sort()

    def read() -> Operation[list[ProducerState]]:
        steps: list[Step] = []
        for _, _, key in parsed:
            steps += [Command(("HGETALL", key)), Command(("PTTL", key))]
        replies = yield steps
        states = []
        for i, (partition, pid, _key) in enumerate(parsed):
            what = f"topic {topic!r} partition {partition}: producer {pid}'s state"
            raw_hash, ttl = (read_reply(r, what) for r in replies[2 * i : 2 * i + 2])
            if not raw_hash:  # expired since the SCAN
                continue
            raw = {k: text(v) for k, v in fields(raw_hash).items()}
            owner = by_id.get(pid)
            epoch = _int(raw.get("epoch"))
            fencing = ""
            if owner is not None and owner.epoch is not None and epoch is not None:
                if epoch == owner.epoch:
                    fencing = "current"
                elif epoch < owner.epoch:
                    fencing = "older instance"
                else:
                    fencing = "newer than the registration"
            ttl_ms = _int(ttl)
            states.append(
                ProducerState(
                    topic=topic,
                    partition=partition,
                    producer_id=pid,
                    name=owner.name if owner else None,
                    epoch=epoch,
                    next_sequence=_int(raw.get("next")),
                    batches=_int(raw.get("nb")),
                    last_batch=_int(raw.get("batch")),
                    window=_window(raw),
                    ttl_ms=ttl_ms if ttl_ms is not None and ttl_ms >= 0 else None,
                    fencing=fencing,
                )
            )
        return states

    return run_operation(read(), broker.scripts.execute)


def dedup_buckets(broker: Broker, topic: str) -> list[DedupBucket]:
    """Both dedup buckets of every partition: ids held, the slice each holds and whether it
    still counts (one pipelined round trip)."""
    keys = broker.keys
    config = broker.topic_config(topic, refresh=True)
    window = config.dedup_window_ms

    def read() -> Operation[list[DedupBucket]]:
        steps: list[Step] = [Command(("TIME",), server_ms)]
        for p in range(config.partitions):
            for bucket in (0, 1):
                key = keys.dedup_bucket(topic, p, bucket)
                steps += [
                    Command(("HLEN", key)),
                    Command(("HGET", key, "")),
                    Command(("PTTL", key)),
                ]
        replies = yield steps
        now_ms = read_reply(replies[0], "the server's time")
        current = int(now_ms) // window
        buckets = []
        at = 1
        for p in range(config.partitions):
            for bucket in (0, 1):
                what = f"topic {topic!r} partition {p}'s dedup bucket {bucket}"
                size, held, ttl = (read_reply(r, what) for r in replies[at : at + 3])
                at += 3
                held_slice = _int(held)
                ids = max((_int(size) or 0) - (1 if held_slice is not None else 0), 0)
                if held_slice is None:
                    status = "empty"
                elif held_slice == current:
                    status = "current"
                elif held_slice == current - 1:
                    status = "previous"
                else:
                    status = "expired slice"
                ttl_ms = _int(ttl)
                buckets.append(
                    DedupBucket(
                        partition=p,
                        bucket=bucket,
                        ids=ids,
                        slice=held_slice,
                        slice_start_ms=held_slice * window if held_slice is not None else None,
                        slice_end_ms=(held_slice + 1) * window if held_slice is not None else None,
                        status=status,
                        ttl_ms=ttl_ms if ttl_ms is not None and ttl_ms >= 0 else None,
                    )
                )
        return buckets

    return run_operation(read(), broker.scripts.execute)
