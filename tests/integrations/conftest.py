"""Fixtures of the integration tests: a redisq namespace per test on the machine's Redis (or the
suite's redis-server), emptied afterwards; waiting for workers in other processes to hold their
share of a group. (The workers themselves: celery_workers.py, test_taskiq.py; each stops them by
process group at the end, also when the test fails.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis


def drop_keys(url: str, pattern: str) -> None:
    """Delete the keys of one namespace or prefix (never a flush: the server is shared)."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=pattern, count=1000):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
def integration_namespace(redis_url: str) -> Iterator[str]:
    """A fresh redisq namespace on the machine's Redis, dropped afterwards."""
    namespace = f"it{uuid.uuid4().hex[:12]}"
    yield namespace
    drop_keys(redis_url, f"{namespace}:*")


def wait_for_owners(
    url: str, namespace: str, topic: str, group: str, owners: int, timeout: float = 60.0
) -> None:
    """Until `owners` members hold the group's partitions (workers started in other processes
    have joined and the assignment settled), so a test spreads its work over all of them."""
    import redisq

    broker = redisq.connect(url, namespace=namespace)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                held = {p.owner for p in broker.describe_group(topic, group).partitions}
            except redisq.errors.RedisqError:  # the topic or group is not there yet
                held = set()
            if len(held - {None}) >= owners:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}/{group}: owners {held} after {timeout} s")
            time.sleep(0.05)
    finally:
        broker.close()
