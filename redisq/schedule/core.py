"""The scheduler of delayed messages (DESIGN §12): the I/O-free core, the round that both
drivers run, and the thread driver (redisq.schedule.scheduler_async has the task driver).

Whoever runs a scheduler for a topic (a consumer of it, a producer that sent delayed messages
to it, `redisq scheduler`) calls deliver_due.lua on each of its partitions. The script takes
the partition's scheduler lease when it is free and renews it on every call, so one scheduler
at a time works a partition while the others only knock every ACQUIRE_INTERVAL_MS; a scheduler
that dies is replaced within LEASE_TTL_MS + ACQUIRE_INTERVAL_MS. The lease saves work, it is not
what makes delivery exactly-once: each due message is appended and removed from the schedule
in one script call, whoever makes it.

Timing: a held partition is called again at most TICK_MS later (so a message scheduled with any
delay is seen within TICK_MS), at its next due time when that comes sooner (the reply carries
the next due time and the server's clock, so no client clock is trusted), but no sooner than
MIN_TICK_MS unless the last call hit its limit (a backlog goes out back to back).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import AskError, ClusterDownError, ClusterError, TryAgainError

from redisq.errors import LeaseLost, TopicNotFound
from redisq.model.keys import KeySpace
from redisq.model.topic import TopicConfig
from redisq.protocol import Command, Operation, ScriptCall, text
from redisq.protocol import schedule as calls
from redisq.protocol.schedule import Delivered
from redisq.protocol.transaction_ops import sweep, take_lease

# A partition whose slot migrates: its script is refused (ASK, TRYAGAIN; redis-py gives up with
# ClusterError "TTL exhausted" while keys are split) until the slot is handed over.
_SLOT_MOVING = (AskError, TryAgainError, ClusterError)

log = logging.getLogger("redisq.scheduler")

LEASE_TTL_MS = 2_000
ACQUIRE_INTERVAL_MS = 500
TICK_MS = 50
MIN_TICK_MS = 10
DELIVER_LIMIT = 1_000  # messages per deliver_due call
METADATA_MAX_AGE_S = 5.0
MAX_BACKOFF_S = 1.0
# The transaction sweeper's duty (redisq.protocol.transaction_ops.sweep), which every scheduler
# offers under the namespace's one sweeper lease: so a committed transaction whose producer died
# before rolling it forward is carried out within seconds wherever a consumer, a scheduler or a
# transactional producer runs.
SWEEP_INTERVAL_S = 1.0
SWEEP_LEASE_MS = 5_000

# ClusterDownError: a failover in progress (the slot has no primary yet), gone in seconds
NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, ClusterDownError)
TopicPartition = tuple[str, int]


@dataclass(slots=True)
class _Partition:
    topic: str
    partition: int
    next_call: float = 0.0  # monotonic seconds
    held: bool = False
    backoff_s: float = 0.0


class SchedulerCore:
    """Which partitions to call deliver_due on, and when; no I/O (see the module doc).

    Inputs: topics added or removed, topic metadata read, the replies of the calls, a failed
    round. Outputs: the deliver_due calls due now, the topics whose metadata to read, the time
    until the next round.
    """

    def __init__(self, *, all_topics: bool = False, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(16)
        self.all_topics = all_topics  # follow every topic of the namespace (redisq scheduler)
        self.delivered = 0  # messages appended by this scheduler
        self._topics: dict[str, TopicConfig | None] = {}
        self._read_at: dict[str, float] = {}
        self._listed_at = float("-inf")
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._swept_at = float("-inf")
        self._round_backoff_s = 0.0  # a failing round (the connection): the next waits this
        self._retry_at = float("-inf")

    def sweep_due(self, now: float) -> bool:
        """Time to offer the transaction sweeper's duty again (it counts as done now)."""
        if now - self._swept_at < SWEEP_INTERVAL_S:
            return False
        self._swept_at = now
        return True

    # -- topics ------------------------------------------------------------------------------
    @property
    def topics(self) -> list[str]:
        return sorted(self._topics)

    def held(self) -> list[tuple[str, int]]:
        """The partitions whose lease this scheduler holds (as far as its last call knew)."""
        return sorted(k for k, p in self._partitions.items() if p.held)

    def add_topic(self, topic: str) -> None:
        if topic not in self._topics:
            self._topics[topic] = None
            self._read_at[topic] = float("-inf")

    def remove_topic(self, topic: str) -> None:
        self._topics.pop(topic, None)
        self._read_at.pop(topic, None)
        for key in [k for k in self._partitions if k[0] == topic]:
            del self._partitions[key]

    def list_due(self, now: float) -> bool:
        """all_topics: time to list the namespace's topics again."""
        return self.all_topics and now - self._listed_at >= METADATA_MAX_AGE_S

    def topics_listed(self, names: Iterable[str], now: float) -> None:
        self._listed_at = now
        names = set(names)
        for topic in names - set(self._topics):
            self.add_topic(topic)
        for topic in set(self._topics) - names:
            self.remove_topic(topic)

    def stale_topics(self, now: float) -> list[str]:
        return [t for t, at in self._read_at.items() if now - at >= METADATA_MAX_AGE_S]

    def config_read(self, topic: str, config: TopicConfig | None, now: float) -> None:
        """A topic's metadata; None: it does not exist (now): its partitions are dropped, and
        taken up again if it is created later."""
        if topic not in self._topics:
            return
        self._read_at[topic] = now
        self._topics[topic] = config
        partitions = config.partitions if config is not None else 0
        for key in [k for k in self._partitions if k[0] == topic and k[1] >= partitions]:
            del self._partitions[key]
        for p in range(partitions):
            if (topic, p) not in self._partitions:
                self._partitions[(topic, p)] = _Partition(topic, p, next_call=now)

    # -- calls ---------------------------------------------------------------------------------
    def calls(self, keys: KeySpace, now: float) -> list[tuple[TopicPartition, ScriptCall[Any]]]:
        """deliver_due for every partition whose time has come, in (topic, partition) order."""
        due = []
        for key in sorted(self._partitions):
            state = self._partitions[key]
            config = self._topics.get(state.topic)
            if state.next_call <= now and config is not None:
                due.append((key, self._call(keys, config, state.partition, LEASE_TTL_MS)))
        return due

    def release_calls(self, keys: KeySpace) -> list[ScriptCall[Delivered]]:
        """Hand back every lease held (a scheduler that stops: the next one need not wait for
        the lease to expire)."""
        return [
            self._call(keys, config, p.partition, 0)
            for p in self._partitions.values()
            if p.held and (config := self._topics.get(p.topic)) is not None
        ]

    def _call(
        self, keys: KeySpace, config: TopicConfig, partition: int, ttl_ms: int
    ) -> ScriptCall[Delivered]:
        return calls.deliver_due(
            keys,
            config.name,
            partition,
            self.token,
            limit=DELIVER_LIMIT,
            retention_messages=config.retention_messages,
            retention_ms=config.retention_ms,
            lease_ttl_ms=ttl_ms,
            counted=config.entry_format == "batch",
        )

    def settle(
        self, sent: list[tuple[TopicPartition, ScriptCall[Any]]], results: list[Any], now: float
    ) -> None:
        """The replies of calls(): when to call each partition again."""
        for (key, _call), result in zip(sent, results, strict=True):
            state = self._partitions.get(key)
            if state is None:
                continue  # its topic was removed meanwhile
            if isinstance(result, Delivered):
                state.held = True
                state.backoff_s = 0.0
                self.delivered += result.count
                state.next_call = now + self._wait(result)
            elif isinstance(result, LeaseLost):
                state.held = False
                state.next_call = now + ACQUIRE_INTERVAL_MS / 1000
            elif isinstance(result, TopicNotFound):
                state.held = False
                state.next_call = now + ACQUIRE_INTERVAL_MS / 1000
                self._read_at[state.topic] = float("-inf")  # read the metadata again
            elif isinstance(result, _SLOT_MOVING):  # did not run; again after a backoff
                self._failed(state, now)
                log.info(
                    "deliver_due on %s/%d: slot moving or down (%r)",
                    state.topic,
                    state.partition,
                    result,
                )
            else:
                self._failed(state, now)
                log.warning("deliver_due on %s/%d: %r", state.topic, state.partition, result)

    @staticmethod
    def _wait(result: Delivered) -> float:
        if result.count >= DELIVER_LIMIT:
            return 0.0  # more is due: straight on
        wait_ms: float = TICK_MS
        if result.next_due_ms is not None:
            # +1: a call in the due millisecond itself could come a hair early.
            until = result.next_due_ms - result.server_ms + 1
            wait_ms = min(wait_ms, max(until, MIN_TICK_MS))
        return wait_ms / 1000

    def round_failed(self, now: float) -> None:
        """The whole round failed (the connection): every partition backs off, and so does
        the round itself (its listing, metadata reads and sweep would otherwise be due at once)."""
        self._round_backoff_s = min(MAX_BACKOFF_S, max(0.05, self._round_backoff_s * 2))
        self._retry_at = now + self._round_backoff_s
        for state in self._partitions.values():
            self._failed(state, now)

    def round_done(self) -> None:
        """A round went through: the round's backoff starts over."""
        self._round_backoff_s = 0.0
        self._retry_at = float("-inf")

    @staticmethod
    def _failed(state: _Partition, now: float) -> None:
        state.backoff_s = min(MAX_BACKOFF_S, max(0.05, state.backoff_s * 2))
        state.next_call = now + state.backoff_s

    def next_wakeup(self, now: float) -> float:
        """Seconds until something is due (a call, a metadata read), at most TICK_MS."""
        times = [p.next_call for p in self._partitions.values()]
        times += [at + METADATA_MAX_AGE_S for at in self._read_at.values()]
        if self.all_topics:
            times.append(self._listed_at + METADATA_MAX_AGE_S)
        times.append(self._swept_at + SWEEP_INTERVAL_S)
        wait = max(min(times, default=now + TICK_MS / 1000), self._retry_at) - now
        return max(0.0, min(wait, TICK_MS / 1000))


def _config_decoder(topic: str) -> Callable[[Any], TopicConfig | None]:
    def decode(raw: Any) -> TopicConfig | None:
        if isinstance(raw, list):
            raw = dict(zip(raw[0::2], raw[1::2], strict=True))
        return TopicConfig.from_hash(topic, raw) if raw else None

    return decode


def scheduler_round(
    core: SchedulerCore, keys: KeySpace, clock: Callable[[], float]
) -> Operation[float]:
    """One round: list the topics (all_topics), read stale metadata, call deliver_due on the
    partitions whose time has come (pipelined); returns the seconds until the next round."""
    if core.list_due(clock()):
        names = yield Command(("SMEMBERS", keys.topics()))
        core.topics_listed((text(n) for n in names), clock())
    stale = core.stale_topics(clock())
    if stale:
        configs = yield [
            Command(("HGETALL", keys.topic_meta(t)), _config_decoder(t)) for t in stale
        ]
        for topic, config in zip(stale, configs, strict=True):
            if isinstance(config, Exception):
                raise config
            core.config_read(topic, config, clock())
    due = core.calls(keys, clock())
    if due:
        results = yield [call for _, call in due]
        core.settle(due, results, clock())
    if core.sweep_due(clock()) and (
        yield from take_lease(keys.transaction_sweeper(), core.token, SWEEP_LEASE_MS)
    ):
        yield from sweep(keys)
    core.round_done()
    return core.next_wakeup(clock())


def release_round(core: SchedulerCore, keys: KeySpace) -> Operation[None]:
    """Hand back every lease held, pipelined. A release the server refused is logged (that
    lease runs out by itself); one another client holds by now was not ours to hand back."""
    releases = core.release_calls(keys)
    if releases:
        results = yield list(releases)
        refused = [r for r in results if isinstance(r, Exception) and not isinstance(r, LeaseLost)]
        if refused:
            log.warning(
                "scheduler: could not hand back %d of its %d leases (they run out anyway): %s",
                len(refused),
                len(releases),
                refused[0],
            )
