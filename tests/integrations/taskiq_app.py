"""The taskiq app of the taskiq worker test, configured from the environment (as celery_app.py):
REDISQ_IT_BROKER_URL, REDISQ_IT_NAMESPACE, REDISQ_IT_LEASE_MS. Tasks journal their start and end
in Redis lists under the namespace."""

from __future__ import annotations

import asyncio
import json
import os
import time

import redis.asyncio as aioredis

from redisq.integrations.taskiq import RedisqBroker

URL = os.environ.get("REDISQ_IT_BROKER_URL", "redis://127.0.0.1:6379/0")
NAMESPACE = os.environ.get("REDISQ_IT_NAMESPACE", "taskiq-it")

broker = RedisqBroker(
    URL,
    namespace=NAMESPACE,
    topic="tasks",
    partitions=4,
    lease_ttl_ms=int(os.environ.get("REDISQ_IT_LEASE_MS", "30000")),
)
_client: aioredis.Redis | None = None


def journal_key(name: str) -> str:
    return f"{NAMESPACE}:journal:{name}"


@broker.task(task_name="it.record")
async def record(key: str, seq: int, work_s: float = 0.0) -> int:
    global _client
    if _client is None:
        _client = aioredis.Redis.from_url(URL)
    running = await _client.incr(journal_key(f"running:{key}"))
    entry = {"key": key, "seq": seq, "pid": os.getpid(), "running": running, "t": time.time()}
    await _client.rpush(journal_key("started"), json.dumps(entry))
    await asyncio.sleep(work_s or 0.001)  # yield: a second task of the key would start here
    await _client.decr(journal_key(f"running:{key}"))
    await _client.rpush(journal_key("done"), json.dumps({"key": key, "seq": seq}))
    return seq
