"""The producer's wire: pre-encoded EVALSHA commands written straight to dedicated connections.

Reads wait no longer than the caller's deadline (the oldest batch's delivery timeout), so a
silent socket (a blackholed network, a stopped server) cannot hold a send past its timeout.

redis-py's pipeline encodes every argument in Python and reads one round before the next can be
written. The producer encodes each message once, when it is queued, and keeps up to two rounds
on the wire per node, so the server runs one round's scripts while the client reads the previous
round's replies and packs the next. On Redis Cluster each partition's commands go to the node
that owns its slot; MOVED refreshes the slot map, ASK sends the next try to the named node
behind ASKING.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.cluster import RedisCluster

log = logging.getLogger("redisq.transport")


# redis-py maps these error codes to exception classes and strips the code from the message.
_ERROR_CODES: dict[type, str] = {
    redis.exceptions.OutOfMemoryError: "OOM",
    redis.exceptions.ExecAbortError: "EXECABORT",
    redis.exceptions.BusyLoadingError: "LOADING",
    redis.exceptions.NoScriptError: "NOSCRIPT",
    redis.exceptions.ReadOnlyError: "READONLY",
    redis.exceptions.NoPermissionError: "NOPERM",
    redis.exceptions.AskError: "ASK",
    redis.exceptions.TryAgainError: "TRYAGAIN",
    redis.exceptions.MovedError: "MOVED",
    redis.exceptions.ClusterDownError: "CLUSTERDOWN",
    redis.exceptions.ClusterCrossSlotError: "CROSSSLOT",
    redis.exceptions.MasterDownError: "MASTERDOWN",
}


def restore_error_code(exc: redis.ResponseError) -> None:
    """redis-py maps some error replies to classes (AskError, MovedError, TryAgainError,
    ReadOnlyError, ...) and strips their code from the message: put it back, so the reply reads
    as the server sent it ("ASK 3999 127.0.0.1:7001") wherever it is checked by its prefix."""
    code = _ERROR_CODES.get(type(exc))
    if code is not None and exc.args and not str(exc.args[0]).startswith(code):
        exc.args = (f"{code} {exc.args[0]}", *exc.args[1:])


class DeadlineReached(redis.TimeoutError):
    """No reply before the caller's deadline (a silent socket): the connection is dropped."""


class Redirect(Exception):
    """A cluster redirection (MOVED or ASK) for one command: the command did not run."""

    def __init__(self, kind: str, node: str) -> None:
        super().__init__(f"{kind} {node}")
        self.kind = kind
        self.node = node


class Transport:
    """Dedicated connections (one per node) on which whole rounds of commands are written."""

    def __init__(self, client: Any, socket_timeout_s: float = 30.0) -> None:
        self._client = client
        self._socket_timeout_s = socket_timeout_s
        # fakeredis answers when a reply is read, so it never looks readable before.
        self._bounded_reads = type(client).__module__.split(".")[0] != "fakeredis"
        self.is_cluster = isinstance(client, RedisCluster)
        self._connections: dict[str, Any] = {}
        self._asking: dict[str, str] = {}  # key -> node named by an ASK redirection

    def node_for(self, key: str) -> str:
        """The node that serves key (standalone: the one server)."""
        if not self.is_cluster:
            return "default"
        asked = self._asking.get(key)
        if asked is not None:
            return asked
        return str(self._client.get_node_from_key(key).name)

    def asking(self, key: str) -> bool:
        """True once after an ASK redirection for key: the next command needs ASKING first."""
        return key in self._asking

    def forget_asking(self, key: str) -> None:
        self._asking.pop(key, None)

    def _connection(self, node: str) -> Any:
        conn = self._connections.get(node)
        if conn is None:
            if self.is_cluster:
                cluster_node = self._client.get_node(node_name=node)
                if cluster_node is None:
                    host, _, port = node.rpartition(":")
                    cluster_node = self._client.get_node(host=host, port=int(port))
                if cluster_node is None:
                    self._client.nodes_manager.initialize()
                    raise redis.ConnectionError(f"unknown cluster node {node}")
                pool = self._client.get_redis_connection(cluster_node).connection_pool
            else:
                pool = self._client.connection_pool
            # A connection of our own, not borrowed from the pool: its socket timeout bounds a
            # write that cannot complete, and it is never handed to another caller with replies
            # of ours unread.
            options = {**pool.connection_kwargs, "socket_timeout": self._socket_timeout_s}
            conn = pool.connection_class(**options)
            # connect() now: a Sentinel-managed connection asks the sentinels for the master
            # there (a first write would connect to its default host instead).
            conn.connect()
            self._connections[node] = conn
        return conn

    def send(self, node: str, payload: bytes) -> None:
        """Write one round's commands for node; replies are read later with read()."""
        self._connection(node).send_packed_command([payload], check_health=False)

    def read(self, node: str, count: int, deadline: float | None = None) -> list[Any]:
        """Read count replies from node; error replies come back as exception objects. With a
        deadline (time.monotonic()), redis.TimeoutError once it passes with a reply missing."""
        conn = self._connection(node)
        replies: list[Any] = []
        for _ in range(count):
            if (
                deadline is not None
                and self._bounded_reads
                and not conn.can_read(max(0.0, deadline - time.monotonic()))
            ):
                raise DeadlineReached(f"no reply from {node} within the delivery timeout")
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                restore_error_code(exc)
                replies.append(self._redirect(exc) or exc)
        return replies

    def _redirect(self, exc: redis.ResponseError) -> Redirect | None:
        text = str(exc)
        if text.startswith(("MOVED ", "ASK ")):
            kind, _slot, node = text.split(" ", 2)
            if kind == "MOVED":
                self._client.nodes_manager.initialize()
            return Redirect(kind, node)
        return None

    def note_ask(self, key: str, node: str) -> None:
        self._asking[key] = node

    def reset(self) -> None:
        """Drop every connection (after a connection error: replies in flight are lost)."""
        for conn in self._connections.values():
            try:
                conn.disconnect()
            except Exception:  # pragma: no cover - best effort
                pass
        self._connections.clear()
        if self.is_cluster:
            try:
                self._client.nodes_manager.initialize()
            except Exception as exc:
                log.warning("cluster topology refresh failed: %s", type(exc).__name__)

    def close(self) -> None:
        self.reset()
