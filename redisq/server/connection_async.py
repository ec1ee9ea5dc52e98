"""Opening a redis.asyncio client for a url (hand-written per runtime: redisq.server.connection
is the thread API's), and the asyncio plumbing the drivers share.

The same rules as the sync API (redisq.server.connection): the url, else REDIS_URL, else the
embedded
valkey-server; a cluster by scheme or detected; Sentinel urls; bytes replies; redis-py's
automatic retries off (redisq retries itself, with the recovery each call needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import select
from collections.abc import Iterator
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException

from redisq.protocol.resp import pack_commands
from redisq.server import connection

T = TypeVar("T")


def _no_retries() -> Retry:
    return Retry(NoBackoff(), 0)


def _check_pooled_connections(options: dict[str, Any]) -> None:
    """redis.asyncio's pool skips its check of a pooled connection (closed by the server, or
    holding unread data) while "maintenance notifications" are on, and redis-py 8 turns them on
    by default ("auto"): a connection the server dropped was handed out and failed the next
    command. They are off unless the caller asks for them (redis-py 5-7 has no such option)."""
    if "maint_notifications_config" in options:
        return
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py before 8
        return
    options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)


async def open_client(url: str, **options: Any) -> Any:
    """A redis.asyncio client for url (see redisq.server.connection.open_client)."""
    options = connection.client_options(options)
    options["retry"] = _no_retries()
    kind, target = connection.url_kind(url)
    if kind == "sentinel":
        return await _open_sentinel(url, options)
    if kind == "cluster":
        return await _open_cluster(url, target, options)
    standalone = dict(options)
    _check_pooled_connections(standalone)
    client = redis.asyncio.Redis(connection_pool=_CheckedPool.from_url(url, **standalone))
    client.auto_close_connection_pool = True  # as Redis.from_url sets it
    try:
        info = await client.info("cluster")
    except redis.RedisError as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    if info.get("cluster_enabled") in (1, "1"):
        await client.aclose()
        return await _open_cluster(url, url, options)
    return client


async def _open_cluster(url: str, cluster_url: str, options: dict[str, Any]) -> RedisCluster:
    client = RedisCluster.from_url(cluster_url, **options)
    # The nodes it finds take their connection class from these (the startup nodes exist already).
    kwargs = client.nodes_manager.connection_kwargs
    kwargs["connection_class"] = _fresh_class(kwargs["connection_class"])
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = _fresh_class(node.connection_class)
    try:
        await client.initialize()
    except (redis.RedisError, RedisClusterException) as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    return client


async def _open_sentinel(url: str, options: dict[str, Any]) -> Any:
    from redis.asyncio.sentinel import Sentinel

    sentinels, service, sentinel_kwargs = connection.sentinel_parts(url, options)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)
    client = sentinel.master_for(
        service,
        redis_class=redis.asyncio.Redis,
        connection_pool_class=_CheckedSentinelPool,
        **options,
    )
    try:
        await client.ping()
    except redis.RedisError as exc:
        await client.aclose()
        raise connection.unreachable(url, exc) from None
    return client


def dropped(conn: Any) -> bool:
    """A pooled connection about to be used that the server closed (a restart, an idle timeout,
    CLIENT KILL): its socket is readable while no reply is due (end of file, or bytes nobody
    will read). redis-py's own check (ConnectionPool.ensure_connection, can_read) looks only at
    what the event loop has already read from the socket, and the loop may not have run since
    the server closed it: the command is then written to a dead connection and fails with
    "Connection closed by server." (the thread API's check polls the socket itself and
    reconnects). Asked before the write, so a connection found dropped is replaced and the
    command sent once, on the new one: it never reached the server on the old."""
    writer = getattr(conn, "_writer", None)
    if writer is None:
        return False
    sock = writer.transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):  # closed meanwhile: connect() opens a new one
        return True
    return bool(readable)


async def ensure_fresh(conn: Any) -> None:
    """conn connected, on a new socket if the server dropped the one it had (see dropped)."""
    if conn.is_connected and dropped(conn):
        await conn.disconnect()
    await conn.connect()


class _FreshConnections:
    """A connection pool that hands out no connection the server has dropped (see dropped), of
    connections whose handshake another task's close cannot wedge (see _WholeHandshakes)."""

    connection_class: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _mixed(self.connection_class, _WholeHandshakes)

    async def ensure_connection(self, connection: Any) -> None:
        if connection.is_connected and dropped(connection):
            await connection.disconnect()
        await super().ensure_connection(connection)  # type: ignore[misc]


class _WholeHandshakes:
    """A connection whose handshake fails, as a lost connection (redis.ConnectionError), when
    another task closes the connection in the middle of it, instead of reconnecting inside it.

    redis.asyncio's handshake (AbstractConnection.on_connect_check_health) writes HELLO, reads
    its reply, then writes CLIENT SETINFO LIB-NAME and CLIENT SETINFO LIB-VER (and SELECT) and
    reads their replies afterwards. Each write goes through send_packed_command, which first
    reconnects a connection it finds closed, running a whole handshake of its own on the new
    socket; and with a socket_timeout (redisq's default: 30 s) each write is an asyncio.wait_for,
    which lets other tasks run. RedisCluster closes every connection of every node, checked out
    or not, from whichever task meets a MOVED storm or a CLUSTERDOWN (see closed_mid_write), and
    a pool closes its idle connections in tasks that may run after one was handed out
    (drop_idle_connections). Closed between the two SETINFO writes, the connection reconnected
    for the second write, the nested handshake read its own replies, the second SETINFO went
    out alone on the new socket, and the outer handshake waited for two replies there: the
    command sat for the whole socket_timeout (forever without one) and failed with a
    TimeoutError. Here a handshake's write on a socket other than the one the handshake began
    on raises redis.ConnectionError (the connection is closed: the next use reconnects, and
    every caller retries a lost connection); a connection that stays open is untouched."""

    _handshake_writer: Any = None  # the connection's writer while its handshake runs

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        self._handshake_writer = self._writer  # type: ignore[attr-defined]
        try:
            await super().on_connect_check_health(check_health)  # type: ignore[misc]
        finally:
            self._handshake_writer = None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # Checked synchronously before redis-py's own "reconnect if closed" (no await between).
        handshake = self._handshake_writer
        if handshake is not None and self._writer is not handshake:  # type: ignore[attr-defined]
            raise redis.ConnectionError("connection closed by another task during its handshake")
        await super().send_packed_command(command, check_health)  # type: ignore[misc]


class _DroppedReconnects:
    """A connection that the cluster client replaces when the server dropped it: its nodes ask
    should_reconnect() as they hand a connection out (ClusterNode.disconnect_if_needed) and take
    it back. Nothing else asks it: a producer's own connections (transport_async), which keep
    replies in flight, never see the check."""

    def should_reconnect(self) -> bool:
        return bool(super().should_reconnect()) or (  # type: ignore[misc]
            self.is_connected and dropped(self)  # type: ignore[attr-defined]
        )


_MIXED: dict[tuple[type, ...], type] = {}


def _mixed(cls: type, *mixins: type) -> type:
    """redis-py's connection class `cls` with redisq's mixins in front (made once per pair)."""
    mixed = _MIXED.get((cls, *mixins))
    if mixed is None:
        mixed = _MIXED[(cls, *mixins)] = type(cls.__name__, (*mixins, cls), {})
    return mixed


def _fresh_class(cls: type) -> type:
    return _mixed(cls, _DroppedReconnects, _WholeHandshakes)


class _CheckedPool(_FreshConnections, redis.asyncio.ConnectionPool):
    pass


class _CheckedSentinelPool(_FreshConnections, SentinelConnectionPool):
    pass


async def drop_idle_connections(client: Any) -> None:
    """Close the pooled connections no command is using (after a lost one: the server dropped
    them all, or went away). Those in use belong to other tasks' commands under way: closing
    them would fail those commands, which may well be answered on a new connection."""
    if is_cluster(client):
        for node in client.get_nodes():
            for conn in list(node._free):
                await conn.disconnect()
    else:
        await client.connection_pool.disconnect(inuse_connections=False)


async def exchange(client: Any, node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Commands in one write on a pooled connection (of `node` on a cluster, else the client's
    pool) and their raw replies: no response callbacks (entries stay flat lists for
    decode_entries), error replies in place. A connection the server dropped while it was in
    the pool is replaced before the write (see dropped)."""
    if node is None:
        pool = client.connection_pool
        conn, release = await pool.get_connection(), pool.release
    else:
        conn, release = node.acquire_connection(), node.release
    packed = [pack_commands(commands)]
    try:
        with closed_mid_write():  # the cluster client may close this connection meanwhile
            await ensure_fresh(conn)
            await conn.send_packed_command(packed)
        replies = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await conn.disconnect()  # replies may be left unread
        result = release(conn)
        if inspect.isawaitable(result):
            await result
        raise
    result = release(conn)
    if inspect.isawaitable(result):
        await result
    return replies


@contextlib.contextmanager
def closed_mid_write() -> Iterator[None]:
    """A write on a connection another task closed meanwhile, as the lost connection it is
    (redis.ConnectionError, which every caller already retries).

    redis.asyncio's RedisCluster disconnects every connection of every node, checked out or not,
    from whichever task meets its every `reinitialize_steps`-th MOVED (5 by default: dozens in a
    slot migration) or a CLUSTERDOWN: RedisCluster._execute_command calls self.aclose(), and
    ClusterNode.disconnect() sets each connection's writer to None (redis-py 8.1,
    redis/asyncio/cluster.py and Connection.disconnect in redis/asyncio/connection.py). A task
    that has just found its connection connected in send_packed_command (the command's write,
    or the handshake of a connection reconnecting) writes through asyncio.wait_for, which on
    Python 3.11 runs the write in a new task one loop iteration later; the writer is gone by
    then and redis-py lets AttributeError("'NoneType' object has no attribute 'writelines'")
    out. The write itself failed, so the command did not run on that connection. Only that
    exact error is converted; any other AttributeError is a bug and stays one."""
    try:
        yield
    except AttributeError as exc:
        if exc.name != "writelines" or exc.obj is not None:
            raise
        raise redis.ConnectionError("connection closed by another task before the write") from exc


async def resolve_url(url: str | None) -> tuple[str, bool]:
    """(url, embedded?): starting the embedded server blocks, so it runs in a thread."""
    return await asyncio.to_thread(connection.resolve_url, url)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)
