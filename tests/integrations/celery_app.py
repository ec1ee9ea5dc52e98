"""The Celery app of the worker tests and the benchmark, configured from the environment:

    REDISQ_IT_BROKER_URL   the Redis both brokers use (redis://host:port/db)
    REDISQ_IT_TRANSPORT    "redisq" (redisq.integrations.kombu:Transport) or "redis" (Kombu's)
    REDISQ_IT_NAMESPACE    the redisq namespace; also the prefix of every other key written
    REDISQ_IT_LEASE_MS     the transport's lease_ttl_ms (how soon a killed worker's work moves)

Tasks record what they did in Redis lists under the namespace: one entry when they start and one
when they end, with the worker's pid, so a test can check order, overlaps and counts.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

URL = os.environ.get("REDISQ_IT_BROKER_URL", "redis://127.0.0.1:6379/0")
TRANSPORT = os.environ.get("REDISQ_IT_TRANSPORT", "redisq")
NAMESPACE = os.environ.get("REDISQ_IT_NAMESPACE", "celery-it")
LEASE_MS = int(os.environ.get("REDISQ_IT_LEASE_MS", "30000"))


def make_app(url: str, transport: str, namespace: str, lease_ms: int = 30_000) -> Celery:
    """A Celery app on `transport` ("redisq" or Kombu's "redis"), every key under `namespace`;
    tests send through their own (app.send_task by name), workers run the module's `app`."""
    celery = Celery("redisq_it")
    celery.conf.update(
        broker_url=url,
        result_backend=url,
        # Celery's own Redis result backend, its keys under the namespace (dropped with it).
        result_backend_transport_options={"global_keyprefix": f"{namespace}:results:"},
        task_acks_late=True,
        worker_prefetch_multiplier=4,
        broker_connection_retry_on_startup=True,
        task_default_queue=f"{namespace}.tasks",
        worker_hijack_root_logger=False,
    )
    if transport == "redisq":
        celery.conf.broker_transport = "redisq.integrations.kombu:Transport"
        celery.conf.broker_transport_options = {"namespace": namespace, "lease_ttl_ms": lease_ms}
    else:  # Kombu's stock Redis transport, its keys under the namespace
        celery.conf.broker_transport_options = {"global_keyprefix": f"{namespace}:kombu:"}
    return celery


app = make_app(URL, TRANSPORT, NAMESPACE, LEASE_MS)
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(URL)
    return _client


def journal_key(name: str) -> str:
    return f"{NAMESPACE}:journal:{name}"


@app.task(name="it.record")
def record(key: str, seq: int, work_s: float = 0.0) -> int:
    """Log start and end; count how many tasks of `key` run at this moment (order per key means
    never more than one)."""
    r = client()
    running = r.incr(journal_key(f"running:{key}"))
    start = time.time()
    r.rpush(journal_key("started"), json.dumps({"key": key, "seq": seq, "pid": os.getpid(),
                                                 "running": running, "t": start}))  # fmt: skip
    if work_s:
        time.sleep(work_s)
    r.decr(journal_key(f"running:{key}"))
    r.rpush(journal_key("done"), json.dumps({"key": key, "seq": seq, "pid": os.getpid()}))
    return seq
