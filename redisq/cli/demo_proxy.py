"""The demo's lost answers: a loopback TCP proxy between the demo's producer and the server.

It forwards both ways, except that every `every`-th request holding `needle` (a batch sent to
the demo topic) loses its answer for real: the request reaches the server, which runs it; the
first bytes of the answer are held, and the proxy cuts both connections (RST) instead of
passing them on. The producer cannot tell whether the batch was written, so it sends it again,
and the server answers the copy as a duplicate. Killing connections from the outside (CLIENT
KILL) rarely lands between a write and its answer: on Redis 7.0 it made no re-send at all.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from urllib.parse import urlsplit, urlunsplit

# After the first bytes of the doomed answer, the server is given this long to finish the rest
# of what it read in the same round (a pipelined chunk holds several batches): what it ran,
# it ran; the connection then goes.
_SETTLE_S = 0.02


class AnswerLosingProxy:
    def __init__(
        self, host: str, port: int, needle: bytes, *, every: int = 5, limit: int = 5
    ) -> None:
        if every < 1 or limit < 0:
            raise ValueError(f"every={every} (1 or more), limit={limit} (0 or more)")
        self._target = (host, port)
        self._needle = needle
        self._every = every
        self._limit = limit
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self.requests_seen = 0  # requests holding the needle
        self.answers_lost = 0

    def start(self) -> AnswerLosingProxy:
        threading.Thread(target=self._accept, name="redisq-demo-proxy", daemon=True).start()
        return self

    def url_for(self, url: str) -> str | None:
        """url with its host and port replaced by the proxy's; None when a TCP proxy cannot sit
        in front of it (TLS checks the server's name, a unix socket has no port)."""
        parts = urlsplit(url)
        if parts.scheme != "redis":
            return None
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@" if credentials else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            doomed = list(self._sockets)
        self._listener.close()
        for sock in doomed:
            _reset(sock)

    # -- threads ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self._target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._closed:
                    _reset(client)
                    _reset(upstream)
                    return
                self._sockets.update((client, upstream))
            doomed = threading.Event()  # this connection's next answer is to be lost
            for source, sink, to_server in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump,
                    args=(source, sink, to_server, doomed),
                    name="redisq-demo-proxy-pump",
                    daemon=True,
                ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, to_server: bool, doomed: threading.Event
    ) -> None:
        while True:
            try:
                chunk = source.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if to_server and self._needle in chunk and not doomed.is_set():
                with self._lock:
                    self.requests_seen += 1
                    if self.answers_lost < self._limit and self.requests_seen % self._every == 0:
                        doomed.set()
            elif not to_server and doomed.is_set():
                time.sleep(_SETTLE_S)
                with self._lock:
                    self.answers_lost += 1
                break  # the answer is dropped with the connection
            try:
                sink.sendall(chunk)
            except OSError:
                break
        for sock in (source, sink):
            _reset(sock)
        with self._lock:
            self._sockets.difference_update((source, sink))


def _reset(sock: socket.socket) -> None:
    """Cut the connection: SO_LINGER 0 makes the close an RST; the shutdown first wakes the
    other pump, blocked in recv on the same socket (a close alone would not)."""
    for cut in (
        lambda: sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
        lambda: sock.shutdown(socket.SHUT_RDWR),
        sock.close,
    ):
        try:
            cut()
        except OSError:
            pass
