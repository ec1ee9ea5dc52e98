"""A list of protocol steps as one write per node, and what a round's reader meets: no I/O.

The producer's transports (redisq.server.transport and its asyncio twin) write a round's
pre-encoded commands to one connection per node and read the replies back; what goes to which
node, what each reply means (a redirection, an error reply of ours, a result) and the errors of
a round that got no answer are decided here, once for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import redis

from redisq.errors import from_reply
from redisq.protocol import Command, ScriptCall, Step
from redisq.protocol.resp import command

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


class Halted(Exception):
    """halt() was called while a reply was awaited (close() ran out of time): the replies of
    the round are abandoned; what it wrote may or may not have run."""


class Redirect(Exception):
    """A cluster redirection (MOVED or ASK) for one command: the command did not run."""

    def __init__(self, kind: str, node: str) -> None:
        super().__init__(f"{kind} {node}")
        self.kind = kind
        self.node = node


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


def socket_timeout_for(delivery_timeout_ms: int) -> float:
    """A sender's connections: a write that cannot complete fails within the delivery timeout
    (at most 30 s); reads are bounded by each round's deadline on top."""
    return min(30.0, delivery_timeout_ms / 1000)
