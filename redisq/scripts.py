"""Loads the Lua scripts in lua/ and runs them with EVALSHA (loading again on NOSCRIPT).

Scripts are plain files, one per broker operation. `-- #include <path>` lines are replaced by the
named file (shared pieces live in lua/includes/). On real servers every script gets the `#!lua`
shebang, which makes Redis Cluster reject any key a script did not declare in KEYS; fakeredis
cannot compile that line, so it gets the script without it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import NoScriptError, ResponseError

from redisq.errors import from_reply
from redisq.protocol import ScriptCall
from redisq.protocol.resp import command, decode_bulks

T = TypeVar("T")

_INCLUDE = re.compile(r"^-- #include (\S+)\s*$", re.MULTILINE)


def lua_dir() -> Path:
    """The installed wheel carries lua/ inside the package; a source checkout has it beside it."""
    packaged = Path(__file__).with_name("lua")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "lua"


@cache
def read_source(name: str) -> str:
    """The flattened source of lua/<name>.lua."""
    root = lua_dir()
    text = (root / f"{name}.lua").read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: (root / m.group(1)).read_text(encoding="utf-8"), text)


def script_names() -> list[str]:
    return sorted(p.stem for p in lua_dir().glob("*.lua"))


def is_fake(client: Any) -> bool:
    return type(client).__module__.split(".")[0] == "fakeredis"


class Script:
    """One Lua script, bound to its SHA1."""

    def __init__(self, name: str, shebang: bool) -> None:
        self.name = name
        body = read_source(name)
        self.source = ("#!lua\n" + body) if shebang else body
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


class Scripts:
    """The script registry of one broker connection."""

    def __init__(self, client: Any) -> None:
        self._client = client
        shebang = not is_fake(client)
        self._scripts = {name: Script(name, shebang) for name in script_names()}

    def __getitem__(self, name: str) -> Script:
        return self._scripts[name]

    def load(self, name: str) -> None:
        """SCRIPT LOAD (on a cluster client, redis-py sends it to every primary)."""
        script = self._scripts[name]
        sha = self._client.script_load(script.source)
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != script.sha:  # pragma: no cover - would mean a SHA1 mismatch in the server
            raise RuntimeError(f"script {name}: server SHA {sha} != {script.sha}")

    def load_all(self) -> None:
        for name in self._scripts:
            self.load(name)

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any], *, topic: str = "?") -> Any:
        """EVALSHA now; on NOSCRIPT (a restarted or flushed server) load and run it again.
        Our scripts' error replies come back as typed redisq errors."""
        script = self._scripts[name]
        try:
            try:
                return self._client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                self.load(name)
                return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            mapped = from_reply(str(exc), topic)
            if mapped is None:
                raise
            raise mapped from None

    def run(self, call: ScriptCall[T]) -> T:
        """Send a protocol call and decode its reply (see `call`). A pre-encoded body is sent as
        ordinary arguments (the producer's hot path writes pack() to its own connections)."""
        args = call.args
        if call.body_count:
            args = [*args, *decode_bulks(call.body, call.body_count)]
        return call.decode(self.call(call.script, call.keys, args, topic=call.topic))

    def pack(self, call: ScriptCall[Any]) -> bytes:
        """The call as one RESP EVALSHA command, for a connection written to directly."""
        script = self._scripts[call.script]
        return command(
            b"EVALSHA",
            [script.sha, len(call.keys), *call.keys, *call.args],
            [call.body] if call.body_count else (),
            call.body_count,
        )

    def queue(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue EVALSHA on a pipeline. The caller re-queues a NOSCRIPT result after load(name):
        NOSCRIPT means the script did not run, so running it again is safe."""
        script = self._scripts[name]
        pipe.evalsha(script.sha, len(keys), *keys, *args)
