"""The protocol layer: one typed function per Lua script (or fenced transaction).

Each function takes domain objects (a topic's config, a producer identity, a sealed batch, a
lease) and returns a `ScriptCall`: the script's name, its KEYS and ARGV in the order the script's
header gives, and the decoder of its reply. Nothing here does I/O. A caller sends the call (sync:
`Scripts.run`, asyncio: `AsyncScripts.run`, the producer's pipelined transport: `ScriptCall.pack`)
and hands the raw reply to `call.decode`. Error replies become typed exceptions in one place,
`redisq.errors.from_reply`.

This is the only code that knows a script's KEYS/ARGV layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def text(value: Any) -> str:
    """A reply element as str (replies stay bytes: values are binary)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def optional_text(value: Any) -> str | None:
    return None if value is None else text(value)


__all__ = ["ScriptCall", "optional_text", "text"]
