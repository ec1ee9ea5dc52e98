"""The protocol layer: one typed function per Lua script (or fenced transaction).

Each function takes domain objects (a topic's config, a producer identity, a sealed batch, a
lease) and returns a `ScriptCall`: the script's name, its KEYS and ARGV in the order the script's
header gives, and the decoder of its reply. Nothing here does I/O. A caller sends the call (sync:
`Scripts.run`, asyncio: `AsyncScripts.run`, the producer's pipelined transport: `Scripts.pack`)
and hands the raw reply to `call.decode`. Error replies become typed exceptions in one place,
`redisq.errors.from_reply`.

Operations of more than one step (create a topic, describe a group) are written once, as
generators that yield steps (a ScriptCall, a plain `Command`, or a list of them to pipeline) and
receive each step's decoded result; `run_operation` drives one with a sync executor, the asyncio
API drives the same generator with an async one.

This is the only code that knows a script's KEYS/ARGV layout.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _identity(reply: Any) -> Any:
    return reply


@dataclass(slots=True)
class ScriptCall(Generic[T]):
    """One script invocation, ready to send.

    body: arguments already encoded as RESP bulk strings (body_count of them), appended after
    args: the producer encodes each message once, when it is queued, and never again.
    """

    script: str
    keys: Sequence[str]
    args: Sequence[Any]
    decode: Callable[[Any], T] = _identity
    topic: str = "?"
    body: bytes = b""
    body_count: int = 0
    # Safe to send again after a lost connection, whether or not it ran (see
    # redisq.server.scripts_async): every script whose second run answers as its first did.
    retry_safe: bool = True


@dataclass(slots=True)
class Command(Generic[T]):
    """A plain Redis command and the decoder of its reply (redis-py's raw reply, bytes).

    nodes: where it runs on Redis Cluster (one server otherwise, named ""):
      "one"        any node (a keyless command; on a transport round, the node of the step before)
      "primaries"  every primary, alone (not in a list of steps): the result is a dict of node
                   name -> decoded reply, or the error in its place (an error reply, no
                   connection, a timeout)
      "written"    on a transport round (StepRound): after the steps of every node the round
                   wrote to; the result maps the index of each step before it to the decoded
                   reply (or exception) of the command on that step's node
    """

    args: tuple[Any, ...]
    decode: Callable[[Any], T] = _identity
    nodes: str = "one"
    retry_safe: bool = True  # see ScriptCall.retry_safe


Step = ScriptCall[Any] | Command[Any]
# A step, or a list of steps sent together (pipelined); a list's result is the list of results,
# with an exception object in place of a failed step's result.
Steps = Step | list[Step]


class Atomic(list[Step]):
    """Steps that take effect together: one MULTI/EXEC on a single server, so no other client
    sees part of them (a reader meets all of a transaction's roll-forward or none); on a Cluster,
    where their keys live on several nodes, one at a time in order, a step whose first key a
    failed step had is not sent (that failure is its result). The result is the list of
    results, as for a list."""

    __slots__ = ()


Operation = Generator[Steps, Any, T]


def run_operation(operation: Operation[T], execute: Callable[[Steps], Any]) -> T:
    """Drive an operation: each yielded step goes to execute(), its result (or the exception it
    raised) back into the generator, until it returns."""
    try:
        steps = next(operation)
        while True:
            try:
                result = execute(steps)
            except Exception as exc:
                steps = operation.throw(exc)
            else:
                steps = operation.send(result)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def text(value: Any) -> str:
    """A reply element as str (replies stay bytes: values are binary)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def optional_text(value: Any) -> str | None:
    return None if value is None else text(value)


__all__ = [
    "Command",
    "Operation",
    "ScriptCall",
    "Step",
    "Steps",
    "optional_text",
    "run_operation",
    "text",
]
