"""A loopback TCP proxy that misbehaves on request, between clients and a server.

Modes (for every connection, new and existing):
    pass          forward both directions at once
    delay N ms    every chunk waits N ms before it is forwarded (added latency, order kept)
    blackhole     accept and read, forward nothing: the bytes are held, in order, per connection
                  and direction, as a network that has lost its route but not the packets
    trap N        pass, until a chunk for the server contains the bytes N: that connection is
                  frozen from that chunk on (blackhole for it alone)
and actions:
    heal(keep=())        back to pass; what every held connection holds is forwarded now, except
                         the connections in `keep`: they stay frozen (bytes held, even after
                         their client has gone) until release_held() forwards what they hold,
                         so a late copy of exactly those bytes really arrives later
    held_connections()   the frozen connections holding bytes for the server (ids for `keep`)
    lose_answers(needle) forward to the server what the frozen connections holding `needle`
                         hold for it, and keep holding what comes back: the commands run,
                         their answers are lost with the connection (reset_all() next)
    reset_all()          abort every connection with a TCP RST (SO_LINGER 0)

It runs an asyncio loop in a thread of its own; the methods are called from the test's thread.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class _Direction:
    held: list[bytes | None] = field(default_factory=list)  # None: end of stream
    writer: asyncio.StreamWriter | None = None


@dataclass
class _Connection:
    number: int
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    frozen: bool = False  # holds its bytes whatever the mode (blackhole, or heal(release=False))
    to_server: _Direction = field(default_factory=_Direction)
    to_client: _Direction = field(default_factory=_Direction)
    released: bool = False
    answered_after_release: bool = False
    upstream_closed: bool = False
    held_bytes: int = 0
    pumps_done: int = 0


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.mode = "pass"
        self.delay_s = 0.0
        self.trap_needle: bytes | None = None
        self._connections: dict[int, _Connection] = {}
        self._count = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- control (test thread) ------------------------------------------------------------------
    def start(self) -> Proxy:
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pass_through(self) -> None:
        self._call(self._set_mode("pass", 0.0))

    def delay(self, ms: float) -> None:
        self._call(self._set_mode("delay", ms / 1000))

    def blackhole(self) -> None:
        self._call(self._set_mode("blackhole", 0.0))

    def trap(self, needle: bytes) -> None:
        self._call(self._set_mode("pass", 0.0, needle.lower()))

    def heal(self, keep: Iterable[int] = ()) -> None:
        self._call(self._heal(set(keep)))

    def held_connections(self, needle: bytes | None = None) -> list[int]:
        """Frozen connections holding bytes for the server (only those whose bytes contain
        `needle`, case-insensitive, when given)."""
        return self._call(self._held_connections(None if needle is None else needle.lower()))

    def holds_for_server(self, needle: bytes) -> bool:
        """Some connection holds bytes for the server containing `needle` (case-insensitive):
        a command sent while the proxy blackholes, not forwarded yet."""
        return self._call(self._holds_for_server(needle.lower()))

    def lose_answers(self, needle: bytes) -> int:
        """See the module doc; returns how many connections sent their bytes on (wait_released()
        tells when the server has answered them)."""
        return self._call(self._lose_answers(needle.lower()))

    def release_held(self) -> int:
        """Forward what frozen connections hold; returns how many had bytes for the server."""
        return self._call(self._release_held())

    def reset_all(self) -> int:
        """Abort every connection (RST); returns how many."""
        return self._call(self._reset_all())

    def stats(self) -> dict[str, int]:
        return self._call(self._stats())

    def wait_released(self, timeout: float) -> bool:
        """True once every released connection that held bytes for the server got an answer
        from it (or was closed by it): the late copies have been executed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._call(self._released_settled()):
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._close_all(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # -- the loop ---------------------------------------------------------------------------------
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _set_mode(self, mode: str, delay_s: float, trap: bytes | None = None) -> None:
        self.mode, self.delay_s, self.trap_needle = mode, delay_s, trap
        if mode == "blackhole":
            for conn in self._connections.values():
                conn.frozen = True

    async def _heal(self, keep: set[int]) -> None:
        self.mode, self.delay_s, self.trap_needle = "pass", 0.0, None
        await self._release_held(keep)

    async def _held_connections(self, needle: bytes | None) -> list[int]:
        return [
            n
            for n, c in self._connections.items()
            if c.frozen
            and c.to_server.held
            and (needle is None or needle in b"".join(x for x in c.to_server.held if x).lower())
        ]

    async def _release_held(self, keep: set[int] | None = None) -> int:
        released = 0
        for conn in list(self._connections.values()):
            if not conn.frozen or (keep is not None and conn.number in keep):
                continue
            conn.frozen = False
            if conn.to_server.held:
                released += 1
                conn.released = True
            for direction in (conn.to_server, conn.to_client):
                held, direction.held = direction.held, []
                for chunk in held:
                    self._write(direction.writer, chunk)
        return released

    async def _lose_answers(self, needle: bytes) -> int:
        sent = 0
        for conn in list(self._connections.values()):
            held = conn.to_server.held
            if not conn.frozen or needle not in b"".join(c for c in held if c).lower():
                continue
            conn.to_server.held = []
            conn.released = True
            sent += 1
            for chunk in held:
                self._write(conn.to_server.writer, chunk)
        return sent

    async def _reset_all(self) -> int:
        conns = list(self._connections.values())
        for conn in conns:
            for writer in (conn.client, conn.upstream):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    except OSError:
                        pass
                writer.transport.abort()
            self._connections.pop(conn.number, None)
        return len(conns)

    async def _stats(self) -> dict[str, int]:
        conns = list(self._connections.values())
        return {
            "connections": sum(1 for c in conns if c.pumps_done < 2),
            "frozen": sum(1 for c in conns if c.frozen),
            "held_bytes": sum(c.held_bytes for c in conns if c.frozen),
            "accepted": self._count,
        }

    async def _holds_for_server(self, needle: bytes) -> bool:
        return any(
            needle in b"".join(chunk for chunk in c.to_server.held if chunk).lower()
            for c in self._connections.values()
        )

    async def _released_settled(self) -> bool:
        return all(
            c.answered_after_release or c.upstream_closed
            for c in self._connections.values()
            if c.released
        )

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self._count += 1
        conn = _Connection(self._count, client_w, upstream_w, frozen=self.mode == "blackhole")
        conn.to_server.writer = upstream_w
        conn.to_client.writer = client_w
        self._connections[conn.number] = conn
        tasks = [
            asyncio.ensure_future(self._pump(conn, client_r, conn.to_server, True)),
            asyncio.ensure_future(self._pump(conn, upstream_r, conn.to_client, False)),
        ]
        for task in tasks:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        conn: _Connection,
        reader: asyncio.StreamReader,
        direction: _Direction,
        to_server: bool,
    ) -> None:
        while True:
            try:
                chunk: bytes | None = await reader.read(65536)
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                chunk = None  # end of stream: passed on (or held) like data
                if not to_server:
                    conn.upstream_closed = True
            elif not to_server and conn.released:
                conn.answered_after_release = True
            elif to_server and self.trap_needle and self.trap_needle in chunk.lower():
                conn.frozen = True
            if conn.frozen or self.mode == "blackhole":
                conn.frozen = True
                direction.held.append(chunk)
                conn.held_bytes += len(chunk or b"")
            else:
                if self.delay_s and chunk is not None:
                    await asyncio.sleep(self.delay_s)
                if conn.frozen:  # blackholed while this chunk waited: it is held, in order
                    direction.held.append(chunk)
                    conn.held_bytes += len(chunk or b"")
                else:
                    self._write(direction.writer, chunk)
            if chunk is None:
                conn.pumps_done += 1
                return

    @staticmethod
    def _write(writer: asyncio.StreamWriter | None, chunk: bytes | None) -> None:
        if writer is None or writer.transport.is_closing():
            return
        try:
            if chunk is None:
                if writer.can_write_eof():
                    writer.write_eof()
                else:
                    writer.close()
            else:
                writer.write(chunk)
        except (ConnectionError, OSError, RuntimeError):
            pass
