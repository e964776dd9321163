"""A slow bridge: an HTTP proxy between Envoy and webdis that holds back the Redis calls of chosen limiters.

What it is for: races inside the filter that need one limiter's Redis call to be slower than another's, or
slower than a lease's `max_age` (tests/e2e/test_exactness.py). Redis cannot be made slow per key
(`CLIENT PAUSE` stops every write), and webdis forwards what it gets at once, so the delay sits in front of
webdis, where a call is still HTTP and names its limiters in the clear:

    Envoy --(cluster "webdis")--> SlowBridge --> webdis --> Redis

The filter sends every Redis command as `POST /` whose body is the command in webdis's path form: each
argument percent-encoded (everything but ASCII letters and digits), joined by `/`, ending in `.raw`, e.g.
`EVALSHA/<sha>/5/erl%3Ab%3Abob/%7Berl%3Ab%3Abob%7D%3Avalue/...raw`. `webdis_form("erl:b:bob")` gives the
bytes a limiter name has there (`erl%3Ab%3Abob`).

A request whose path or body contains `match` is held `delay_ms` before it is forwarded (each on its own
connection: Envoy does not pipeline HTTP/1.1, so a held call delays no other). Everything else is forwarded
at once. Method, path, headers (but the hop-by-hop ones) and body go to webdis as received; webdis's status,
headers and body come back. Both sides use HTTP/1.1 keep-alive. `set(match=..., delay_ms=...)` changes the
rule at runtime; `matched` counts the requests held, `forwarded` every request passed on (one the bridge
answers itself included), `recent` keeps the last bodies. If webdis cannot be reached the bridge answers
502, which the filter treats as any failure of the bridge.

Started in a thread of the test process on a free 127.0.0.1 port (`start()`); `stop()` (or leaving it as a
context manager) closes the listener and every connection, and cuts held delays short.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import http.server
import socket
import threading
from typing import Any

HOST = "127.0.0.1"
_KEEP = object()  # `SlowBridge.set()`: the argument was left out
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


def webdis_form(text: str | bytes) -> bytes:
    """`text` as the filter writes a command argument for webdis: every byte but ASCII letters and digits as
    `%XX` (upper-case hex), e.g. `erl:b:bob` -> `erl%3Ab%3Abob`."""
    raw = text.encode() if isinstance(text, str) else text
    return b"".join(bytes([b]) if chr(b).isalnum() and b < 128 else b"%%%02X" % b for b in raw)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: "_Server"

    def setup(self) -> None:
        super().setup()
        self.server.bridge._opened(self.connection)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        if self._upstream is not None:
            self._upstream.close()
        self.server.bridge._closed(self.connection)

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self) -> None:
        body = self._read_body()
        bridge = self.server.bridge
        bridge._held(self.path.encode("latin-1", errors="replace"), body)
        headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP}
        headers["content-length"] = str(len(body))
        answer = None
        for _attempt in range(2):  # a kept-alive connection webdis closed meanwhile: once more on a new one
            reused = self._upstream is not None
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(HOST, bridge.target_port, timeout=10.0)
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                response = self._upstream.getresponse()
                answer = (response.status, response.getheaders(), response.read())
                if response.will_close:
                    self._upstream.close()
                    self._upstream = None
                break
            except (OSError, http.client.HTTPException):
                self._upstream.close()
                self._upstream = None
                if not reused:
                    break
        with bridge._lock:
            bridge.forwarded += 1
        if answer is None:
            status, response_headers, data = 502, [("content-type", "text/plain")], b"webdis unreachable\n"
        else:
            status, response_headers, data = answer
        self.send_response_only(status)
        for name, value in response_headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _forward

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    bridge: "SlowBridge"


class SlowBridge(contextlib.AbstractContextManager):
    """The proxy; see the module docstring. `port` is where Envoy's `webdis` cluster should point:
    `stack.envoy(config, webdis_port=bridge.port)`."""

    def __init__(self, target_port: int, match: bytes | str | None = None, delay_ms: float = 0.0):
        self.target_port = target_port
        self.match: bytes | None = None
        self.delay_ms = 0.0
        self.set(match=match, delay_ms=delay_ms)
        self.matched = 0
        self.forwarded = 0
        # The bodies of the last requests (bytes), newest last: what the filter sent, for a failure's message.
        self.recent: "collections.deque[bytes]" = collections.deque(maxlen=32)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server = _Server((HOST, 0), _Handler)
        self._server.bridge = self
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def set(self, *, match: Any = _KEEP, delay_ms: float | None = None) -> None:
        """Changes what is held (`match`: bytes or text to find in a request's path or body; None: nothing)
        and for how long (`delay_ms`); an argument left out keeps its value."""
        if match is not _KEEP:
            self.match = match.encode() if isinstance(match, str) else match
        if delay_ms is not None:
            self.delay_ms = float(delay_ms)

    def _held(self, path: bytes, body: bytes) -> None:
        match, delay_ms = self.match, self.delay_ms
        self.recent.append(body or path)
        if match is not None and (match in path or match in body):
            with self._lock:
                self.matched += 1
            if delay_ms > 0:
                self._stopping.wait(delay_ms / 1000.0)

    def _opened(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)

    def _closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)

    def start(self) -> "SlowBridge":
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                            name="slowbridge", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops listening, cuts held delays short and closes the connections still open. Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> "SlowBridge":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
