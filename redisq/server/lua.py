"""The Lua scripts in lua/: read, flattened and bound to their SHA1 (no I/O on a server).

Scripts are plain files, one per broker operation. `-- #include <path>` lines are replaced by the
named file (shared pieces live in lua/includes/). On real servers every script gets the `#!lua`
shebang, which makes Redis Cluster reject any key a script did not declare in KEYS; fakeredis
cannot compile that line, so it gets the script without it. The executors that send them are
redisq.server.scripts (threads) and redisq.server.scripts_async (asyncio).
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from redisq.protocol import ScriptCall
from redisq.protocol.resp import command

_INCLUDE = re.compile(r"^-- #include (\S+)\s*$", re.MULTILINE)


def lua_dir() -> Traversable:
    """The installed wheel carries lua/ inside the package (read through importlib.resources,
    so a zipped package works too, as on Spark executors with addPyFile); a source checkout has
    it beside the package."""
    packaged = resources.files("redisq") / "lua"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "lua"


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
