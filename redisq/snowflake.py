"""Snowflake-style message ids whose worker id is leased from Redis.

64-bit id = 41 bits of milliseconds since 2024-01-01 UTC | 10 bits worker id | 12 bits counter.
The worker id is a lease (SET NX PX with a random token) renewed by a background thread at a
third of its TTL, so two live producers never share one. If the lease cannot be renewed before
it runs out, the generator stops handing out ids rather than risk a collision.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from redisq.errors import WorkerIdUnavailable
from redisq.keys import KeySpace
from redisq.scripts import Scripts

log = logging.getLogger("redisq.snowflake")

EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
WORKER_BITS = 10
COUNTER_BITS = 12
MAX_WORKERS = 1 << WORKER_BITS
_COUNTER_MASK = (1 << COUNTER_BITS) - 1
_TIME_SHIFT = WORKER_BITS + COUNTER_BITS


class SnowflakeGenerator:
    def __init__(
        self, client: Any, keys: KeySpace, scripts: Scripts, lease_ttl_ms: int = 30_000
    ) -> None:
        self._client = client
        self._keys = keys
        self._scripts = scripts
        self._lease_ttl_ms = lease_ttl_ms
        self._token = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._last_ms = 0
        self._counter = 0
        self.worker_id = self._lease_worker_id()
        self._worker_bits = self.worker_id << COUNTER_BITS
        self._lease_deadline = time.monotonic() + lease_ttl_ms / 1000
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_loop, name="redisq-worker-id", daemon=True
        )
        self._renewer.start()

    def _lease_worker_id(self) -> int:
        """Try candidates from a shared counter until SET NX wins one."""
        for _ in range(MAX_WORKERS):
            candidate = int(self._client.incr(self._keys.worker_id_counter())) % MAX_WORKERS
            key = self._keys.worker_id_lease(candidate)
            if self._client.set(key, self._token, nx=True, px=self._lease_ttl_ms):
                return candidate
        raise WorkerIdUnavailable(f"all {MAX_WORKERS} Snowflake worker ids are leased")

    def _renew_loop(self) -> None:
        key = self._keys.worker_id_lease(self.worker_id)
        interval = self._lease_ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                renewed = self._scripts.call(
                    "extend_lease", [key], [self._token, self._lease_ttl_ms]
                )
            except Exception as exc:  # connection trouble: keep the old deadline, try again
                log.warning("worker id %d: lease renewal failed: %s", self.worker_id, exc)
                continue
            if renewed:
                self._lease_deadline = time.monotonic() + self._lease_ttl_ms / 1000
            else:
                log.error("worker id %d: lease lost; generating no more ids", self.worker_id)
                self._lease_deadline = 0.0
                return

    def next_id(self) -> int:
        with self._lock:
            now = time.time_ns() // 1_000_000
            if now > self._last_ms:
                # The lease is checked once per millisecond: ids of one millisecond come from one
                # check, which keeps this cheap at high rates.
                if time.monotonic() >= self._lease_deadline:
                    raise WorkerIdUnavailable(
                        f"the lease on worker id {self.worker_id} expired; ids could collide"
                    )
                self._last_ms = now
                self._counter = 0
            else:  # the same millisecond, or the clock went back: keep counting on the last one
                self._counter = (self._counter + 1) & _COUNTER_MASK
                if self._counter == 0:  # 4096 ids in one ms: wait for the next millisecond
                    while now <= self._last_ms:
                        now = time.time_ns() // 1_000_000
                    self._last_ms = now
            return ((self._last_ms - EPOCH_MS) << _TIME_SHIFT) | self._worker_bits | self._counter

    def close(self) -> None:
        self._stop.set()
        try:
            self._scripts.call(
                "release_lease", [self._keys.worker_id_lease(self.worker_id)], [self._token]
            )
        except Exception as exc:
            log.warning("worker id %d: release failed: %s", self.worker_id, exc)
