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
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from redisq.errors import from_reply
from redisq.protocol import Command, ScriptCall, Steps
from redisq.protocol.resp import command, decode_bulks

T = TypeVar("T")

_INCLUDE = re.compile(r"^-- #include (\S+)\s*$", re.MULTILINE)


def lua_dir() -> Traversable:
    """The installed wheel carries lua/ inside the package (read through importlib.resources,
    so a zipped package works too, as on Spark executors with addPyFile); a source checkout has
    it beside the package."""
    packaged = resources.files("redisq") / "lua"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "lua"


def _read(root: Traversable, relative: str) -> str:
    node = root
    for part in relative.split("/"):
        node = node / part
    return node.read_text(encoding="utf-8")


@cache
def read_source(name: str) -> str:
    """The flattened source of lua/<name>.lua."""
    root = lua_dir()
    text = _read(root, f"{name}.lua")
    return _INCLUDE.sub(lambda m: _read(root, m.group(1)), text)


def script_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in lua_dir().iterdir()
        if entry.name.endswith(".lua") and entry.is_file()
    )


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
    """The script registry of one broker connection, and the sync executor of protocol steps."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
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

    def execute(self, steps: Steps) -> Any:
        """Run protocol steps (see redisq.protocol.run_operation): a ScriptCall, a Command, or a
        list of them, pipelined (one round trip), whose results come back in order with the
        exception in place of a failed step's result."""
        if isinstance(steps, ScriptCall):
            return self.run(steps)
        if isinstance(steps, Command):
            if steps.nodes == "primaries":
                return self._on_primaries(steps)
            return steps.decode(self._client.execute_command(*steps.args))
        if not steps:
            return []
        if self._cluster and any(isinstance(step, ScriptCall) for step in steps):
            # A cluster pipeline refuses EVALSHA: scripts go one at a time.
            results: list[Any] = []
            for step in steps:
                try:
                    results.append(self.execute(step))
                except Exception as exc:
                    results.append(exc)
            return results
        return self._pipeline(steps)

    def _on_primaries(self, step: Command[Any]) -> dict[str, Any]:
        """A command on every primary (Command.nodes "primaries"), one at a time."""
        out: dict[str, Any] = {}
        for node in primaries(self._client, self._cluster):
            options = {} if node is None else {"target_nodes": node}
            try:
                reply = self._client.execute_command(*step.args, **options)
                out[node_name(node)] = step.decode(reply)
            except (ResponseError, redis.ConnectionError, redis.TimeoutError) as exc:
                out[node_name(node)] = exc  # one node's answer, or that it gave none
        return out

    def _pipeline(self, steps: list[ScriptCall[Any] | Command[Any]]) -> list[Any]:
        replies = self._raw_pipeline(steps)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:  # NOSCRIPT: those did not run; load them and send just those again
            for i in missing:
                self.load(steps[i].script)  # type: ignore[union-attr]
            again = self._raw_pipeline([steps[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        results: list[Any] = []
        for step, reply in zip(steps, replies, strict=True):
            if isinstance(reply, ResponseError):
                topic = step.topic if isinstance(step, ScriptCall) else "?"
                results.append(from_reply(str(reply), topic) or reply)
            elif isinstance(reply, Exception):
                results.append(reply)
            else:
                results.append(step.decode(reply))
        return results

    def _raw_pipeline(self, steps: list[ScriptCall[Any] | Command[Any]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for step in steps:
            if isinstance(step, ScriptCall):
                args = step.args
                if step.body_count:
                    args = [*args, *decode_bulks(step.body, step.body_count)]
                pipe.evalsha(self._scripts[step.script].sha, len(step.keys), *step.keys, *args)
            else:
                pipe.execute_command(*step.args)
        return list(pipe.execute(raise_on_error=False))

    def pack(self, call: ScriptCall[Any]) -> bytes:
        """The call as one RESP EVALSHA command, for a connection written to directly."""
        return pack(self._scripts[call.script], call)

    def queue(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue EVALSHA on a pipeline. The caller re-queues a NOSCRIPT result after load(name):
        NOSCRIPT means the script did not run, so running it again is safe."""
        script = self._scripts[name]
        pipe.evalsha(script.sha, len(keys), *keys, *args)


def primaries(client: Any, cluster: bool) -> list[Any]:
    """The nodes a Command of nodes="primaries" runs on: a cluster's primaries, or [None] (the
    one server)."""
    return list(client.get_primaries()) if cluster else [None]


def node_name(node: Any) -> str:
    """A cluster node's "host:port" ("" for the one server)."""
    return "" if node is None else str(node.name)


def pack(script: Script, call: ScriptCall[Any]) -> bytes:
    """A call of this script as one RESP EVALSHA command."""
    return command(
        b"EVALSHA",
        [script.sha, len(call.keys), *call.keys, *call.args],
        [call.body] if call.body_count else (),
        call.body_count,
    )
