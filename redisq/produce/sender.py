# WARNING: generated from sender_async.py by tools/async_to_sync.py; do not edit.
# Change sender_async.py and run `python tools/async_to_sync.py`.
"""The producer's sender: the loop that carries out the core's decisions (the thread API's twin
is generated from this module by tools/async_to_sync.py).

It writes every partition's first `max_in_flight` unacknowledged batches in one round per node
and keeps two rounds on the wire, so the server runs one round's scripts while the sender reads
the previous round's replies and packs the next (redisq.produce.encoder.Round). Anything not
acknowledged (a connection error, a timeout, OUT_OF_ORDER after a lost batch, NOSCRIPT after a
restart) is sent again, the very same batch with the same sequences, until it is acknowledged or
delivery_timeout_ms runs out; the broker's window answers a re-sent batch that had been written
as a duplicate carrying its original offsets. Reads wait no longer than the oldest batch's
deadline, so a silent server cannot hold a send past its delivery timeout.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import deque
from typing import TYPE_CHECKING

import redis

from redisq import errors
from redisq.errors import ProducerClosed
from redisq.produce.accumulator import Batch, ProducerCore
from redisq.produce.encoder import Round, scripts_for
from redisq.produce.futures import BatchFutures
from redisq.protocol import identity as identity_ops
from redisq.protocol.produce import ProducerIdentity
from redisq.protocol.rounds import Halted
from redisq.runtime import Event, Guard, Task, alive
from redisq.server.transport import Transport, call_expiring
from redisq.settings import ProducerSettings

if TYPE_CHECKING:
    from redisq.model.keys import KeySpace
    from redisq.server.handle import BrokerHandle

log = logging.getLogger("redisq.producer")

NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
CLOSED_UNACKED = "closed before the batch was acknowledged: it may or may not be stored"


class SenderLoop:
    """The sender half of a producer (redisq.produce.producer.Producer sets the state up:
    the core and its guard, the events, the futures, the transport)."""

    broker: BrokerHandle
    name: str | None
    settings: ProducerSettings
    identity: ProducerIdentity | None
    _keys: KeySpace
    _core: ProducerCore
    _guard: Guard
    _wake: Event
    _progress: Event
    _futures: BatchFutures
    _transport: Transport | None
    _halted: bool
    _sender: Task | None = None

    def _forget_topic(self, topic: str) -> None: ...

    def _sender_alive(self) -> bool:
        return self._sender is not None and alive(self._sender)

    def _backoff(self, backoff: float) -> tuple[float, float]:
        """A pause with jitter, and the next (doubled, at most 1 s)."""
        return backoff * (0.5 + random.random()), min(backoff * 2, 1.0)

    def _run(self) -> None:
        core = self._core
        settings = self.settings
        transport = self._transport
        assert transport is not None, "started before the sender runs"
        outstanding: deque[Round] = deque()
        backoff = settings.retry_backoff_ms / 1000
        try:
            while not self._halted:
                self._futures.run()
                if core.fatal is not None:
                    self._progress.set()
                    return  # fenced: every batch has failed with the error
                if not outstanding and (core.needs_new_identity or core.fences_needed):
                    done = self._renew_identity() if core.needs_new_identity else self._fence()
                    if not done and core.fatal is None:
                        self._expire_waiting()
                        pause, backoff = self._backoff(backoff)
                        transport.pause(pause)
                    continue
                if core.reload_scripts:
                    self._reload_scripts()
                # Cleared before looking for work: a batch queued from now on wakes the wait.
                self._wake.clear()
                with self._guard:
                    next_deadline = core.seal_due(time.monotonic())
                    work = core.pick_work() if len(outstanding) < 2 else []
                    deadline = core.oldest_deadline()
                if not work and not outstanding:
                    if core.closing or (core.fatal is not None and core.buffered == 0):
                        return
                    if core.needs_new_identity or core.fences_needed:
                        continue
                    wait = 1.0 if next_deadline is None else next_deadline - time.monotonic()
                    self._wake.wait(max(0.0, wait))
                    continue
                try:
                    if work:
                        outstanding.append(self._submit(transport, work))
                    if outstanding and (len(outstanding) >= 2 or not work):
                        # The round leaves `outstanding` only once read: if reading fails,
                        # the handler below puts its batches back.
                        progress, retry = self._collect(transport, outstanding[0], deadline)
                        outstanding.popleft()
                        self._futures.run()
                        if retry and not progress:
                            pause, backoff = self._backoff(backoff)
                            transport.pause(pause)
                        elif progress:
                            backoff = settings.retry_backoff_ms / 1000
                except Halted:
                    raise
                except NETWORK_ERRORS as exc:
                    # Replies in flight are lost: every batch on the wire goes again (the window
                    # answers the ones that were written as duplicates, with their offsets), or
                    # fails once its delivery timeout has passed.
                    log.warning("connection lost (%s); re-sending in-flight batches", exc)
                    transport.reset()
                    self._lost(outstanding, work, exc)
                    with self._guard:
                        core.expire(time.monotonic())
                    self._progress.set()
                    pause, backoff = self._backoff(backoff)
                    transport.pause(pause)
                except Exception as exc:  # never let the sender die silently
                    log.exception("sender round failed")
                    transport.reset()
                    self._lost(outstanding, work, exc)
                    with self._guard:
                        core.fail_unknown(errors.RedisqError(f"sender failed: {exc!r}"), None)
                    self._progress.set()
        except Halted:  # close() ran out of time: what is unacknowledged fails now
            with self._guard:
                core.fail_all(ProducerClosed(CLOSED_UNACKED), fatal=True)
            self._progress.set()
        finally:
            transport.close()
            self._futures.run()

    def _lost(self, outstanding: deque[Round], work: list[Batch], exc: BaseException) -> None:
        """The rounds on the wire (and the work picked, maybe partly written) go again."""
        with self._guard:
            for round_ in outstanding:
                self._core.connection_lost(round_.batches(), exc)
            self._core.connection_lost(work, exc)
        outstanding.clear()

    def _submit(self, transport: Transport, work: list[Batch]) -> Round:
        """Encode and write one round (redisq.produce.encoder.Round)."""
        assert self.identity is not None
        # No guard: what it reads of the core (the partitions' acknowledged sequences) only the
        # sender changes.
        round_ = Round.build(
            work,
            core=self._core,
            keys=self._keys,
            settings=self.settings,
            identity=self.identity,
            pack=self.broker.scripts.pack,
            router=transport,
        )
        for node, payload in round_.payloads.items():
            transport.send(node, payload)
        return round_

    def _collect(
        self, transport: Transport, round_: Round, deadline: float | None
    ) -> tuple[bool, bool]:
        """Read one round's replies (waiting no later than deadline: the oldest batch's delivery
        timeout) and settle its batches; returns (progress, retry)."""
        replies = {
            node: transport.read(node, round_.expected_replies(node), deadline)
            for node in round_.payloads
        }
        with self._guard:
            progress, retry = round_.settle(
                replies,
                core=self._core,
                keys=self._keys,
                settings=self.settings,
                router=transport,
                forget_topic=self._forget_topic,
            )
            if retry:
                self._core.expire(time.monotonic())
        self._progress.set()
        return progress, retry

    def _expire_waiting(self) -> None:
        with self._guard:
            self._core.expire_waiting(time.monotonic())
        self._progress.set()
        self._futures.run()

    def _renew_identity(self) -> bool:
        """After batches of unknown outcome failed: a new epoch, fenced on every partition where
        a failed batch went on the wire, so none of them can land after what comes next. False
        while the server cannot be reached (the sender keeps trying, sending nothing else)."""
        assert self.identity is not None and self._transport is not None
        with self._guard:
            abandoned = sorted(self._core.abandoned)
        operation = identity_ops.renew_identity(
            self._keys, self.identity, abandoned, fence=self.settings.idempotence is not None
        )
        try:
            identity = call_expiring(
                lambda: self.broker.run(operation), self._expire_waiting, self._transport
            )
        except Exception as exc:
            return self._identity_failed(exc, "take a new epoch")
        with self._guard:
            self.identity = identity
            self._core.identity_renewed()
        self._progress.set()
        log.warning(
            "producer %s: new epoch %d after failed batches (fenced %d partitions)",
            self.name or identity.producer_id,
            identity.epoch,
            len(abandoned),
        )
        return True

    def _identity_failed(self, exc: Exception, what: str) -> bool:
        if isinstance(exc, Halted):  # close() ran out of time: not the identity's failure
            raise exc
        network = isinstance(exc, NETWORK_ERRORS)  # else ProducerFenced: a newer instance
        if network:
            log.warning("cannot %s yet: %s", what, type(exc).__name__)
        with self._guard:
            self._core.identity_failed(exc, network)
        self._progress.set()
        return False

    def _fence(self) -> bool:
        """UNKNOWN_PRODUCER: prove the epoch against the name's registration, then store it on
        the partitions, before anything is sent there again."""
        assert self.identity is not None and self._transport is not None
        with self._guard:
            needed = sorted(self._core.fences_needed)
        operation = identity_ops.prove_and_fence(self._keys, self.identity, needed)
        try:
            call_expiring(lambda: self.broker.run(operation), self._expire_waiting, self._transport)
        except Exception as exc:
            return self._identity_failed(exc, "fence")
        with self._guard:
            for key in needed:
                self._core.partition_fenced(key)
        return True

    def _reload_scripts(self) -> None:
        """NOSCRIPT (a restarted or flushed server): load the produce scripts again."""
        assert self._transport is not None
        try:
            for name in scripts_for(self.settings):
                load = functools.partial(self.broker.scripts.load, name)
                call_expiring(load, self._expire_waiting, self._transport)
            self._core.reload_scripts = False
        except NETWORK_ERRORS as exc:
            log.warning("cannot load scripts yet: %s", type(exc).__name__)
