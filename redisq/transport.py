"""The producer's wire: pre-encoded EVALSHA commands written straight to dedicated connections.

Reads wait no longer than the caller's deadline (the oldest batch's delivery timeout), so a
silent socket (a blackholed network, a stopped server) cannot hold a send past its timeout.
The plain sender writes its own rounds (redisq.sending.Round); the delayed senders hand a list
of protocol steps to execute() (StepRound: the same routing, ASKING and error mapping).

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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import redis
from redis.cluster import RedisCluster

from redisq.errors import from_reply
from redisq.protocol import Command, ScriptCall, Step
from redisq.protocol.resp import command

if TYPE_CHECKING:
    from redisq.scripts import Scripts

log = logging.getLogger("redisq.transport")
T = TypeVar("T")


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


def socket_timeout_for(delivery_timeout_ms: int) -> float:
    """A sender's connections: a write that cannot complete fails within the delivery timeout
    (at most 30 s); reads are bounded by each round's deadline on top."""
    return min(30.0, delivery_timeout_ms / 1000)


class DeadlineReached(redis.TimeoutError):
    """No reply before the caller's deadline (a silent socket): the connection is dropped."""


class Halted(Exception):
    """halt() was called while a reply was awaited (close() ran out of time): the replies of
    the round are abandoned; what it wrote may or may not have run."""


# How often a read waiting for a reply checks for halt().
_HALT_POLL_S = 0.05


class Redirect(Exception):
    """A cluster redirection (MOVED or ASK) for one command: the command did not run."""

    def __init__(self, kind: str, node: str) -> None:
        super().__init__(f"{kind} {node}")
        self.kind = kind
        self.node = node


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


class Router(Protocol):
    """What a round needs of a transport: which node serves a key, and ASK redirections."""

    def node_for(self, key: str) -> str: ...

    def asking(self, key: str) -> bool: ...

    def forget_asking(self, key: str) -> None: ...

    def note_ask(self, key: str, node: str) -> None: ...


class StepRound:
    """Protocol steps as one write per node (no I/O; Transport.execute and AsyncTransport.execute
    do it): a ScriptCall goes to the node of its first key (behind ASKING after an ASK
    redirection), a Command to the node of the step before it, or, with nodes="written" (WAIT /
    WAITAOF), to every node written to before it (see redisq.protocol.Command)."""

    def __init__(
        self, steps: list[Step], pack: Callable[[ScriptCall[Any]], bytes], router: Router
    ) -> None:
        self.steps = steps
        self._router = router
        self._slots: dict[str, list[int | None]] = {}  # per node, each reply's step (None: ASKING)
        self._node_of: dict[int, str] = {}  # each step's node
        parts: dict[str, list[bytes]] = {}
        node = ""
        for i, step in enumerate(steps):
            if isinstance(step, ScriptCall):
                key = step.keys[0]
                node = router.node_for(key)
                if router.asking(key):
                    router.forget_asking(key)
                    parts.setdefault(node, []).append(command(b"ASKING", ()))
                    self._slots.setdefault(node, []).append(None)
                payload = pack(step)
            else:
                payload = command(str(step.args[0]).encode(), step.args[1:])
                if step.nodes == "written":
                    # every node a step before it was sent to (a Command with nodes="written"
                    # before it has no node of its own)
                    written_to = (self._node_of[j] for j in range(i) if j in self._node_of)
                    for written in dict.fromkeys(written_to):
                        parts[written].append(payload)
                        self._slots[written].append(i)
                    continue
                node = node or router.node_for("")
            parts.setdefault(node, []).append(payload)
            self._slots.setdefault(node, []).append(i)
            self._node_of[i] = node
        self.payloads = {node: b"".join(p) for node, p in parts.items()}

    def expected(self) -> dict[str, int]:
        """How many replies to read from each node."""
        return {node: len(slots) for node, slots in self._slots.items()}

    def results(self, replies: dict[str, list[Any]]) -> list[Any]:
        """The steps' results in order: decoded replies; error replies as our typed errors (or
        redis-py's); a redirection as a ResponseError, after noting an ASK for the next try."""
        out: list[Any] = [None] * len(self.steps)
        by_node: dict[int, dict[str, Any]] = {}  # a "written" command's result on each node
        for node, slots in self._slots.items():
            for i, reply in zip(slots, replies[node], strict=True):
                if i is None:  # the reply to ASKING
                    continue
                step = self.steps[i]
                if isinstance(reply, Redirect):
                    if reply.kind == "ASK" and isinstance(step, ScriptCall):
                        self._router.note_ask(step.keys[0], reply.node)
                    result: Any = redis.ResponseError(str(reply))  # did not run: retriable
                elif isinstance(reply, redis.ResponseError):
                    topic = step.topic if isinstance(step, ScriptCall) else "?"
                    result = from_reply(str(reply), topic) or reply
                elif isinstance(reply, Exception):
                    result = reply
                else:
                    result = step.decode(reply)
                if isinstance(step, Command) and step.nodes == "written":
                    by_node.setdefault(i, {})[node] = result
                else:
                    out[i] = result
        for i, step in enumerate(self.steps):
            if isinstance(step, Command) and step.nodes == "written":
                results = by_node.get(i, {})  # {}: nothing written before it
                out[i] = {j: results[self._node_of[j]] for j in range(i) if j in self._node_of}
        return out

    def missing_scripts(self, results: list[Any]) -> list[str]:
        """The scripts of steps refused with NOSCRIPT (they did not run), to load."""
        return sorted(
            {
                step.script
                for step, result in zip(self.steps, results, strict=True)
                if isinstance(step, ScriptCall)
                and isinstance(result, redis.exceptions.NoScriptError)
            }
        )
