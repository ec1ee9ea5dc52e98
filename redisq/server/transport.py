"""The producer's wire: pre-encoded EVALSHA commands written straight to dedicated connections.

Reads wait no longer than the caller's deadline (the oldest batch's delivery timeout), so a
silent socket (a blackholed network, a stopped server) cannot hold a send past its timeout.
The plain sender writes its own rounds (redisq.produce.encoder.Round); the delayed senders hand
a list of protocol steps to execute() (redisq.protocol.rounds.StepRound: the same routing,
ASKING and error mapping).

redis-py's pipeline encodes every argument in Python and reads one round before the next can be
written. The producer encodes each message once, when it is queued, and keeps up to two rounds
on the wire per node, so the server runs one round's scripts while the client reads the previous
round's replies and packs the next. On Redis Cluster each partition's commands go to the node
that owns its slot; MOVED refreshes the slot map, ASK sends the next try to the named node
behind ASKING.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.cluster import RedisCluster

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
    from redisq.server.scripts import Scripts

log = logging.getLogger("redisq.transport")
T = TypeVar("T")


# How often a read waiting for a reply checks for halt().
_HALT_POLL_S = 0.05


def call_expiring(call: Callable[[], T], expire: Callable[[], None], transport: Transport) -> T:
    """call() (a round trip on the shared client: fencing, a new epoch, loading scripts) in a
    thread of its own while this one runs expire() every 50 ms: a call blocked on a silent server
    (up to the client's socket timeout, 30 s) holds back no batch's delivery timeout. Returns or
    raises what call() did; Halted once transport.halt() was called (the call ends by itself)."""
    done = threading.Event()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=target, name="redisq-call", daemon=True).start()
    while not done.wait(_HALT_POLL_S):
        expire()
        if transport.halted:
            raise Halted("halted while waiting for the server")
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value


_refreshing: set[int] = set()  # the clients whose slot map is being read again
_refreshing_lock = threading.Lock()


def refresh_in_background(client: Any) -> None:
    """Read a cluster client's slot map again in a thread of its own, one at a time per client.
    After a connection error the map may be stale, but reading it can take the client's socket
    timeout (30 s) when the node asked first is the one not answering: a sender waiting for it
    would hold every batch, of every node, past its delivery timeout. Meanwhile the old map
    serves; a node that moved answers MOVED, which is followed."""
    with _refreshing_lock:
        if id(client) in _refreshing:
            return
        _refreshing.add(id(client))

    def refresh() -> None:
        try:
            client.nodes_manager.initialize()
        except Exception as exc:
            log.warning("cluster topology refresh failed: %s", type(exc).__name__)
        finally:
            with _refreshing_lock:
                _refreshing.discard(id(client))

    threading.Thread(target=refresh, name="redisq-topology", daemon=True).start()


class Transport:
    """Dedicated connections (one per node) on which whole rounds of commands are written."""

    def __init__(self, client: Any, delivery_timeout_ms: int) -> None:
        self._client = client
        self._socket_timeout_s = socket_timeout_for(delivery_timeout_ms)
        # fakeredis answers when a reply is read, so it never looks readable before.
        self._bounded_reads = type(client).__module__.split(".")[0] != "fakeredis"
        self.is_cluster = isinstance(client, RedisCluster)
        self._connections: dict[str, Any] = {}
        self._asking: dict[str, str] = {}  # key -> node named by an ASK redirection
        self._halted = threading.Event()

    def halt(self) -> None:
        """From any thread: a read waiting for a reply raises Halted (within 50 ms), and so does
        every later one."""
        self._halted.set()

    @property
    def halted(self) -> bool:
        return self._halted.is_set()

    def pause(self, seconds: float) -> None:
        """A backoff between tries: Halted as soon as halt() is called (or was)."""
        if self._halted.wait(seconds):
            raise Halted("halted during a backoff")

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
        """Read count replies from node; error replies come back as exception objects.
        DeadlineReached (a redis.TimeoutError) once deadline (time.monotonic(); None: the socket
        timeout from now) passes with a reply missing; Halted after halt()."""
        conn = self._connection(node)
        replies: list[Any] = []
        if deadline is None:  # the socket timeout, as read_response alone would wait
            deadline = time.monotonic() + self._socket_timeout_s
        for _ in range(count):
            if self._bounded_reads:
                self._wait_readable(conn, node, deadline)
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                restore_error_code(exc)
                replies.append(self._redirect(exc) or exc)
        return replies

    def _wait_readable(self, conn: Any, node: str, deadline: float) -> None:
        """Until a reply can be read: DeadlineReached once deadline passes, Halted after halt()."""
        while not conn.can_read(min(max(0.0, deadline - time.monotonic()), _HALT_POLL_S)):
            if self._halted.is_set():
                raise Halted(f"halted while waiting for a reply from {node}")
            if time.monotonic() >= deadline:
                raise DeadlineReached(f"no reply from {node} within the delivery timeout")

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

    def reset(self, refresh: bool = True) -> None:
        """Drop every connection (after a connection error: replies in flight are lost); on a
        cluster, read the slot map again in the background (refresh_in_background)."""
        for conn in self._connections.values():
            try:
                conn.disconnect()
            except Exception:  # pragma: no cover - best effort
                pass
        self._connections.clear()
        if self.is_cluster and refresh:
            refresh_in_background(self._client)

    def close(self) -> None:
        self.reset(refresh=False)

    def execute(self, steps: list[Step], scripts: Scripts, deadline: float) -> list[Any]:
        """Run protocol steps (see StepRound) on these connections, reading no later than
        deadline (time.monotonic(): DeadlineReached, then reset() before the next use); their
        results in order, an exception in place of a failed step's."""
        round_ = StepRound(steps, scripts.pack, self)
        for node, payload in round_.payloads.items():
            self.send(node, payload)
        replies = {node: self.read(node, n, deadline) for node, n in round_.expected().items()}
        results = round_.results(replies)
        for name in round_.missing_scripts(results):  # a restarted or flushed server
            scripts.load(name)  # the steps did not run: they go again (retriable)
        return results
