"""The asyncio producer's wire: what redisq.server.transport does, on redis.asyncio connections.

Dedicated connections (one per node), pre-encoded rounds written whole, replies read no later
than the caller's deadline (a silent socket cannot hold a send past its delivery timeout):
the plain sender's rounds (redisq.produce.encoder.Round) and the delayed sender's steps (execute()).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.asyncio.cluster import RedisCluster

from redisq.protocol import Step
from redisq.protocol.rounds import (
    DeadlineReached,
    Halted,
    Redirect,
    StepRound,
    restore_error_code,
    socket_timeout_for,
)

if TYPE_CHECKING:
    from redisq.server.scripts_async import AsyncScripts

log = logging.getLogger("redisq.asyncio.transport")
T = TypeVar("T")
_REFRESHING: set[asyncio.Task[None]] = set()  # slot-map reads under way (see reset)


class AsyncTransport:
    def __init__(self, client: Any, delivery_timeout_ms: int) -> None:
        self._client = client
        self._socket_timeout_s = socket_timeout_for(delivery_timeout_ms)
        self.is_cluster = isinstance(client, RedisCluster)
        self._connections: dict[str, Any] = {}
        self._asking: dict[str, str] = {}
        self._refresh: asyncio.Task[None] | None = None
        self._halted = False

    def halt(self) -> None:
        """A backoff under way or to come raises Halted (close() ran out of time; the task is
        cancelled too, which ends a read that is waiting)."""
        self._halted = True

    @property
    def halted(self) -> bool:
        return self._halted

    async def pause(self, seconds: float) -> None:
        """A backoff between tries: Halted once halt() was called."""
        if self._halted:
            raise Halted("halted during a backoff")
        await asyncio.sleep(seconds)
        if self._halted:
            raise Halted("halted during a backoff")

    # -- routing (sync: the slot map is in memory) ----------------------------------------------
    def node_for(self, key: str) -> str:
        if not self.is_cluster:
            return "default"
        asked = self._asking.get(key)
        if asked is not None:
            return asked
        return str(self._client.get_node_from_key(key).name)

    def asking(self, key: str) -> bool:
        return key in self._asking

    def forget_asking(self, key: str) -> None:
        self._asking.pop(key, None)

    def note_ask(self, key: str, node: str) -> None:
        self._asking[key] = node

    # -- connections -----------------------------------------------------------------------------
    async def _connection(self, node: str) -> Any:
        conn = self._connections.get(node)
        if conn is None:
            if self.is_cluster:
                cluster_node = self._client.get_node(node_name=node)
                if cluster_node is None:
                    await self._client.initialize()
                    raise redis.ConnectionError(f"unknown cluster node {node}")
                connection_class = cluster_node.connection_class
                kwargs = dict(cluster_node.connection_kwargs)
            else:
                pool = self._client.connection_pool
                connection_class = pool.connection_class
                kwargs = dict(pool.connection_kwargs)
            kwargs["socket_timeout"] = self._socket_timeout_s
            conn = connection_class(**kwargs)
            await conn.connect()
            self._connections[node] = conn
        return conn

    async def send(self, node: str, payload: bytes) -> None:
        conn = await self._connection(node)
        await conn.send_packed_command(payload, check_health=False)

    async def read(self, node: str, count: int, deadline: float | None = None) -> list[Any]:
        """count replies from node, error replies as exception objects; DeadlineReached once the
        deadline (time.monotonic()) passes with a reply missing."""
        conn = await self._connection(node)
        replies: list[Any] = []
        for _ in range(count):
            try:
                if deadline is None:
                    reply = await conn.read_response()
                else:
                    remaining = max(0.0, deadline - time.monotonic())
                    try:
                        reply = await asyncio.wait_for(conn.read_response(), remaining)
                    except TimeoutError:
                        raise DeadlineReached(
                            f"no reply from {node} within the delivery timeout"
                        ) from None
                replies.append(reply)
            except redis.ResponseError as exc:
                restore_error_code(exc)
                replies.append(_redirect(exc) or exc)
        if any(isinstance(r, Redirect) and r.kind == "MOVED" for r in replies):
            await self._client.nodes_manager.initialize()  # the slot map changed
        return replies

    async def reset(self, refresh: bool = True) -> None:
        """Drop every connection (after a connection error: replies in flight are lost); on a
        cluster, read the slot map again in a task of its own (as redisq.server.transport's
        refresh_in_background: a node not answering holds no sender past its deadlines)."""
        for conn in self._connections.values():
            try:
                await conn.disconnect()
            except Exception:  # pragma: no cover - best effort
                pass
        self._connections.clear()
        if self.is_cluster and refresh and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.ensure_future(self._refresh_map())
            _REFRESHING.add(self._refresh)  # held until done, also after close()
            self._refresh.add_done_callback(_REFRESHING.discard)

    async def _refresh_map(self) -> None:
        try:
            await self._client.nodes_manager.initialize()
        except Exception as exc:
            log.warning("cluster topology refresh failed: %s", type(exc).__name__)

    async def close(self) -> None:
        await self.reset(refresh=False)

    async def execute(self, steps: list[Step], scripts: AsyncScripts, deadline: float) -> list[Any]:
        """As redisq.server.transport.Transport.execute: protocol steps written whole (StepRound),
        replies read no later than deadline; their results in order."""
        round_ = StepRound(steps, scripts.pack, self)
        for node, payload in round_.payloads.items():
            await self.send(node, payload)
        expected = round_.expected()
        replies = {node: await self.read(node, n, deadline) for node, n in expected.items()}
        results = round_.results(replies)
        for name in round_.missing_scripts(results):  # a restarted or flushed server
            await scripts.load(name)  # the steps did not run: they go again (retriable)
        return results


async def call_expiring(
    call: Callable[[], Awaitable[T]], expire: Callable[[], None], transport: AsyncTransport
) -> T:
    """call() (a round trip on the shared client: fencing, a new epoch, loading scripts) while
    expire() runs every 50 ms: a call blocked on a silent server (up to the client's socket
    timeout, 30 s) holds back no batch's delivery timeout (as redisq.server.transport's); Halted
    once transport.halt() was called."""
    task = asyncio.ensure_future(call())
    try:
        while not (await asyncio.wait({task}, timeout=0.05))[0]:
            expire()
            if transport.halted:
                task.cancel()
                raise Halted("halted while waiting for the server")
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def _redirect(exc: redis.ResponseError) -> Redirect | None:
    text = str(exc)
    if text.startswith(("MOVED ", "ASK ")):
        kind, _slot, node = text.split(" ", 2)
        return Redirect(kind, node)
    return None
