"""Plain commands sent to the node that holds their key, with the server's raw replies.

redis-py parses some replies on the client: a cluster client hands XRANGE back as (id, dict)
pairs and XINFO STREAM as a dict whatever callbacks a caller sets, and building those dicts is
most of a scan's cost. The connector reads through protocol Commands whose decoders take the raw
RESP2 reply instead, sent here on a connection of the key's node (the same pool the client uses:
standalone, Sentinel or a cluster node), so one code path reads standalone servers and clusters.
Scripts do not come here: they go through redisq's Scripts.execute, which is cluster-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, MovedError, TryAgainError

from redisq.protocol import Command

log = logging.getLogger("redisq.spark.raw")

T = TypeVar("T")
REDIRECTS = (MovedError, AskError, TryAgainError)
_ATTEMPTS = 4


class RawNodes:
    """Routes commands by key and returns what the server said (decoded by each Command)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)

    def pool(self, key: str) -> redis.ConnectionPool:
        """The connection pool of the node that serves key."""
        if not self._cluster:
            return self._client.connection_pool  # type: ignore[no-any-return]
        node = self._client.get_node_from_key(key)
        return self._client.get_redis_connection(node).connection_pool  # type: ignore[no-any-return]

    def refresh(self) -> None:
        """After MOVED / ASK: learn the cluster's slots again."""
        if self._cluster:
            self._client.nodes_manager.initialize()

    def run(self, key: str, command: Command[T]) -> T:
        return self.run_all([(key, command)])[0]

    def run_all(self, steps: Sequence[tuple[str, Command[Any]]]) -> list[Any]:
        """Send each (key, command) to its key's node, pipelined per node, in one round trip
        per node; results in order. A redirect (slots moved) is retried after a refresh."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                return self._run_once(steps)
            except REDIRECTS as exc:
                if attempt == _ATTEMPTS:
                    raise
                log.info("cluster redirect (%s); refreshing the slot map", type(exc).__name__)
                self.refresh()
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_once(self, steps: Sequence[tuple[str, Command[Any]]]) -> list[Any]:
        by_pool: dict[int, tuple[redis.ConnectionPool, list[int]]] = {}
        for i, (key, _) in enumerate(steps):
            pool = self.pool(key)
            by_pool.setdefault(id(pool), (pool, []))[1].append(i)
        results: list[Any] = [None] * len(steps)
        for pool, indexes in by_pool.values():
            commands = [steps[i][1].args for i in indexes]
            for i, reply in zip(indexes, _send(pool, commands), strict=True):
                results[i] = steps[i][1].decode(reply)
        return results

    def stream(self, key: str, first: tuple[Any, ...], next_args: Any) -> Iterator[Any]:
        """Raw replies of a chain of commands on one connection, each sent before the previous
        reply is handed on (the server works while the caller converts): next_args(reply) gives
        the next command's arguments, or None to stop."""
        pool = self.pool(key)
        connection = pool.get_connection()
        outstanding = False
        try:
            connection.send_command(*first)
            outstanding = True
            while True:
                reply = connection.read_response()
                outstanding = False
                if isinstance(reply, redis.ResponseError):  # pragma: no cover - RESP2 raises
                    raise reply
                following = next_args(reply)
                if following is not None:
                    connection.send_command(*following)
                    outstanding = True
                yield reply
                if following is None:
                    return
        finally:
            if outstanding:  # closed early: an unread reply would desynchronise the connection
                connection.disconnect()
            pool.release(connection)


def _send(pool: redis.ConnectionPool, commands: list[tuple[Any, ...]]) -> list[Any]:
    connection = pool.get_connection()
    try:
        connection.send_packed_command(connection.pack_commands(commands))
        replies = []
        error: Exception | None = None
        for _ in commands:
            try:
                replies.append(connection.read_response())
            except redis.ResponseError as exc:  # read the others: the connection stays in step
                error = error or exc
                replies.append(exc)
        if error is not None:
            raise error
        return replies
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def pairs(reply: Any) -> dict[str, Any]:
    """A RESP2 flat [name, value, ...] list (or a RESP3 map) as {name: value}."""
    if isinstance(reply, dict):
        return {_text(k): v for k, v in reply.items()}
    return {_text(k): v for k, v in zip(reply[0::2], reply[1::2], strict=False)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
