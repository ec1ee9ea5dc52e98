"""The producer's wire: pre-encoded EVALSHA commands written straight to dedicated connections.

redis-py's pipeline encodes every argument in Python and reads one round before the next can be
written. The producer encodes each message once, when it is queued, and keeps up to two rounds
on the wire per node, so the server runs one round's scripts while the client reads the previous
round's replies and packs the next. On Redis Cluster each partition's commands go to the node
that owns its slot; MOVED refreshes the slot map, ASK sends the next try to the named node
behind ASKING.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

log = logging.getLogger("redisq.transport")

_CRLF = b"\r\n"


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _as_arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int):
        return b"%d" % value
    return str(value).encode()


def command(
    name: bytes, args: Iterable[Any], encoded: Sequence[bytes] = (), encoded_count: int = 0
) -> bytes:
    """A RESP command: name, then args (encoded here), then `encoded` (already bulk strings)."""
    head = [bulk(_as_arg(a)) for a in args]
    return b"".join([b"*%d\r\n" % (1 + len(head) + encoded_count), bulk(name), *head, *encoded])


def _error_codes() -> dict[type, str]:
    try:
        from redis._parsers.base import BaseParser
    except ImportError:  # pragma: no cover - redis-py < 5
        return {}
    classes = BaseParser.EXCEPTION_CLASSES.items()
    return {cls: code for code, cls in classes if isinstance(cls, type)}


_ERROR_CODES = _error_codes()


def _restore_error_code(exc: redis.ResponseError) -> None:
    """redis-py maps some error replies to classes (AskError, MovedError, TryAgainError,
    ReadOnlyError, ...) and strips their code from the message: put it back, so the reply reads
    as the server sent it ("ASK 3999 127.0.0.1:7001") wherever it is checked by its prefix."""
    code = _ERROR_CODES.get(type(exc))
    if code is not None and exc.args and not str(exc.args[0]).startswith(code):
        exc.args = (f"{code} {exc.args[0]}", *exc.args[1:])


class Redirect(Exception):
    """A cluster redirection (MOVED or ASK) for one command: the command did not run."""

    def __init__(self, kind: str, node: str) -> None:
        super().__init__(f"{kind} {node}")
        self.kind = kind
        self.node = node


class Transport:
    """Dedicated connections (one per node) on which whole rounds of commands are written."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.is_cluster = isinstance(client, RedisCluster)
        self._connections: dict[str, Any] = {}
        self._pools: dict[str, Any] = {}  # node -> the pool its connection is borrowed from
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
            conn = pool.get_connection()
            self._connections[node] = conn
            self._pools[node] = pool
        return conn

    def send(self, node: str, payload: bytes) -> None:
        """Write one round's commands for node; replies are read later with read()."""
        self._connection(node).send_packed_command([payload], check_health=False)

    def read(self, node: str, count: int) -> list[Any]:
        """Read count replies from node; error replies come back as exception objects."""
        conn = self._connection(node)
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                _restore_error_code(exc)
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
        """Drop every connection (after a connection error: replies in flight are lost) and give
        it back to its pool: a pool counts borrowed connections against max_connections, so
        thousands of short-lived producers would otherwise exhaust it."""
        for node, conn in self._connections.items():
            try:
                conn.disconnect()
                self._pools[node].release(conn)
            except Exception:  # pragma: no cover - best effort
                pass
        self._connections.clear()
        self._pools.clear()
        if self.is_cluster:
            try:
                self._client.nodes_manager.initialize()
            except Exception as exc:
                log.warning("cluster topology refresh failed: %s", type(exc).__name__)

    def close(self) -> None:
        self.reset()
