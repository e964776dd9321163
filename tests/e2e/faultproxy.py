"""A TCP fault proxy between the gateways and Redis, for the fault tests (tests/e2e/faults.py) and the bench.

It listens on 127.0.0.1, forwards every connection to one Redis port, and is switched at runtime between
modes. A mode applies to the connections open when it is set and to the ones accepted while it lasts:

- `pass`: bytes are forwarded both ways as they arrive.
- `latency` (N ms): every chunk read from either side is written to the other side N ms after it was read,
  order kept; a command and its reply each wait N ms, so a round trip takes 2N ms more. Chunks already
  queued when the mode changes keep the time they were due.
- `reset`: every open connection is closed with a TCP RST on both sides (SO_LINGER 0, then close); new
  connections are accepted and reset at once, and no connection to Redis is made. Clients see ECONNRESET.
- `blackhole`: connections stay open and new ones are accepted (and connected to Redis), the proxy reads
  what each side sends but writes nothing to the other: no command reaches Redis, no reply reaches the
  client. Like a path that drops packets for a while and heals, whose TCP retransmits what was sent: when
  the mode ends, what was read meanwhile is delivered, in order.
- `half_close`: the proxy shuts down its write side towards the client (the client reads EOF, a FIN) on
  every open connection and on every new one right after accepting it; replies from Redis are discarded
  from then on. What the client still writes is forwarded to Redis on open connections and read and
  discarded on new ones (which get no connection to Redis). A client that closes its end closes both.
- `drop`: every open connection is closed with a FIN on both sides (shutdown, then close); new connections
  are accepted and closed at once.

When Redis refuses the proxy's connection (Redis stopped), the client's connection is closed (FIN) right
after it was accepted, as a TCP proxy does; when either side closes or resets, the proxy closes both.

Two ways to run it: `FaultProxy` runs the proxy's event loop in a thread of this process; `FaultProxyProcess`
runs it as a child process (this file as a script, driven by JSON lines on its stdin) so the proxy never
waits for the GIL of a test that also runs load threads, and stops it by its PID. Both have `port`,
`password` (what webdis should send to Redis through it: `harness.Webdis(workdir, proxy)` takes either),
`set_mode(mode, latency_ms=0)`, `stats()` and `stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MODES = ("pass", "latency", "reset", "blackhole", "half_close", "drop")
READ_SIZE = 64 * 1024
CONNECT_TIMEOUT_S = 2.0


def check_mode(mode: str, latency_ms: int) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown fault proxy mode {mode!r} (one of {', '.join(MODES)})")
    if mode == "latency" and latency_ms < 0:
        raise ValueError("latency_ms must be >= 0")


class _Link:
    """One accepted client connection and, when its mode lets it through, its connection to Redis."""

    def __init__(self, proxy: "_Proxy", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.proxy = proxy
        self.client_reader = reader
        self.client_writer = writer
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.half_closed = False
        self.closed = False
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def run(self, mode: str) -> None:
        proxy = self.proxy
        if mode in ("reset", "drop"):
            proxy.stats["refused"] += 1
            self.close(rst=mode == "reset")
            return
        if mode == "half_close":
            self.half_close()
            self.tasks.append(asyncio.create_task(self._discard(self.client_reader)))
            return
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(proxy.upstream_host, proxy.upstream_port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            proxy.stats["upstream_failures"] += 1
            self.close(rst=False)
            return
        if self.closed:  # a mode set while connecting closed it
            upstream_writer.transport.abort()
            return
        self.upstream_writer = upstream_writer
        towards_redis: asyncio.Queue = asyncio.Queue()
        towards_client: asyncio.Queue = asyncio.Queue()
        self.tasks += [
            asyncio.create_task(self._pump(self.client_reader, towards_redis, "bytes_up")),
            asyncio.create_task(self._pump(upstream_reader, towards_client, "bytes_down")),
            asyncio.create_task(self._send(towards_redis, upstream_writer, to_client=False)),
            asyncio.create_task(self._send(towards_client, self.client_writer, to_client=True)),
        ]

    async def _pump(self, reader: asyncio.StreamReader, into: asyncio.Queue, counter: str) -> None:
        """Reads one side; each chunk is queued with the time it is due on the other side. EOF last."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(READ_SIZE):
                self.proxy.stats[counter] += len(data)
                into.put_nowait((loop.time() + self.proxy.latency_s, data))
        into.put_nowait((loop.time() + self.proxy.latency_s, None))

    async def _send(self, source: asyncio.Queue, writer: asyncio.StreamWriter, to_client: bool) -> None:
        """Writes the queued chunks when due and while no blackhole holds them; EOF closes the link."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await source.get()
                await self.proxy.flowing.wait()
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                    await self.proxy.flowing.wait()  # a blackhole that began meanwhile holds it too
                if data is None:
                    break
                if to_client and self.half_closed:
                    continue
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        self.close(rst=False)

    async def _discard(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while await reader.read(READ_SIZE):
                pass
        self.close(rst=False)

    def half_close(self) -> None:
        """Shuts down the write side towards the client (FIN); Redis's replies are discarded from now on."""
        if self.closed or self.half_closed:
            return
        self.half_closed = True
        self.proxy.stats["half_closed"] += 1
        with contextlib.suppress(OSError, RuntimeError):
            if self.client_writer.can_write_eof():
                self.client_writer.write_eof()

    def close(self, rst: bool) -> None:
        """Closes both sides: with RST (SO_LINGER 0) or with FIN (shutdown); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.proxy.links.discard(self)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        for writer in (self.client_writer, self.upstream_writer):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                if rst:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            writer.transport.abort()
        self.done.set()


class _Proxy:
    """The event-loop side: the listening socket, the links, the mode."""

    def __init__(self, port: int, upstream_port: int, upstream_host: str = HOST):
        self.port = port
        self.upstream_port = upstream_port
        self.upstream_host = upstream_host
        self.mode = "pass"
        self.latency_s = 0.0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.links: set[_Link] = set()
        self.server: asyncio.base_events.Server | None = None
        self.stats: dict[str, int] = {"accepted": 0, "refused": 0, "reset": 0, "dropped": 0, "half_closed": 0,
                                      "upstream_failures": 0, "bytes_up": 0, "bytes_down": 0}

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, HOST, self.port, backlog=256)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["accepted"] += 1
        link = _Link(self, reader, writer)
        self.links.add(link)
        await link.run(self.mode)
        await link.done.wait()  # keeps the streams referenced for the link's life

    def set_mode(self, mode: str, latency_ms: int = 0) -> dict:
        check_mode(mode, latency_ms)
        self.mode = mode
        self.latency_s = latency_ms / 1000.0 if mode == "latency" else 0.0
        if mode == "blackhole":
            self.flowing.clear()
        else:
            self.flowing.set()
        for link in list(self.links):
            if mode == "reset":
                self.stats["reset"] += 1
                link.close(rst=True)
            elif mode == "drop":
                self.stats["dropped"] += 1
                link.close(rst=False)
            elif mode == "half_close":
                link.half_close()
        return self.describe()

    def describe(self) -> dict:
        return {"mode": self.mode, "latency_ms": round(self.latency_s * 1000), "open": len(self.links),
                **self.stats}

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in list(self.links):
            link.close(rst=False)
        if self.server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)


class FaultProxy:
    """The proxy in a thread of this process (its own event loop); `port` defaults to harness.free_port()."""

    def __init__(self, upstream_port: int, port: int | None = None, password: str | None = None,
                 upstream_host: str = HOST):
        if port is None:
            from harness import free_port  # only the in-process proxy of a test needs the harness
            port = free_port()
        self.port = port
        self.upstream_port = upstream_port
        self.upstream_host = upstream_host
        self.password = password
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._proxy: _Proxy | None = None

    def start(self, timeout: float = 5.0) -> "FaultProxy":
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        started: "queue.Queue[BaseException | None]" = queue.Queue()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._proxy = _Proxy(self.port, self.upstream_port, self.upstream_host)
                loop.run_until_complete(self._proxy.start())
            except BaseException as error:  # noqa: BLE001 - handed to start()
                started.put(error)
                loop.close()
                return
            started.put(None)
            loop.run_forever()
            loop.run_until_complete(self._proxy.stop())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name=f"faultproxy-{self.port}", daemon=True)
        self._thread.start()
        try:
            error = started.get(timeout=timeout)
        except queue.Empty:
            error = TimeoutError(f"the fault proxy did not listen on port {self.port} within {timeout} s")
        if error is not None:
            self._thread = None
            raise RuntimeError(f"fault proxy: {error}") from error
        return self

    def _run(self, function: Any, timeout: float = 5.0) -> Any:
        if self._loop is None or self._proxy is None or self._thread is None:
            raise RuntimeError("the fault proxy is not running")

        async def call() -> Any:
            return function(self._proxy)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def set_mode(self, mode: str, latency_ms: int = 0) -> dict:
        """Switches the mode (see the module docs); returns once it applies to every connection."""
        check_mode(mode, latency_ms)
        return self._run(lambda proxy: proxy.set_mode(mode, latency_ms))

    def stats(self) -> dict:
        """The mode, open connections and counters (accepted, refused, reset, dropped, ...)."""
        return self._run(lambda proxy: proxy.describe())

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None


class FaultProxyProcess:
    """The proxy as a child process (`python faultproxy.py`), driven by JSON lines on its stdin and stopped by
    its PID (harness.Process). `upstream` is anything with a `.port` (a harness `Redis`: its port stays the same
    across stop/start); `port` defaults to harness.free_port()."""

    def __init__(self, workdir: Path, upstream: Any, port: int | None = None, password: str | None = None,
                 name: str = "faultproxy"):
        from harness import free_port
        self.workdir = workdir
        self.upstream = upstream
        self.port = port or free_port()
        self.password = password
        self.name = name
        self.process: Any = None
        self._lines: "queue.Queue[bytes | None]" = queue.Queue()

    def start(self, timeout: float = 10.0) -> "FaultProxyProcess":
        from harness import HarnessError, Process
        if self.process is not None and self.process.alive():
            return self
        argv = [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port),
                "--upstream-port", str(self.upstream.port)]
        self._lines = queue.Queue()
        self.process = Process(self.name, argv, self.workdir / f"{self.name}.log", pipes=True)
        threading.Thread(target=self._read_lines, args=(self.process.popen.stdout,), daemon=True,
                         name=f"{self.name}-stdout").start()
        try:
            ready = self._answer(timeout)
        except HarnessError:
            self.stop()
            raise
        if not ready.get("ready"):
            self.stop()
            raise HarnessError(f"{self.name} did not start: {ready}")
        return self

    def _read_lines(self, stdout: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in stdout:
                self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float) -> dict:
        from harness import HarnessError, tail
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise HarnessError(f"{self.name} did not answer within {timeout} s") from None
        if line is None:
            self._lines.put(None)
            raise HarnessError(f"{self.name} exited:\n{tail(self.workdir / f'{self.name}.log')}")
        answer = json.loads(line)
        if not answer.get("ok", True):
            raise HarnessError(f"{self.name}: {answer.get('error')}")
        return answer

    def _call(self, line: dict, timeout: float = 5.0) -> dict:
        from harness import HarnessError
        if self.process is None:
            raise HarnessError(f"{self.name} is not running")
        try:
            self.process.popen.stdin.write(json.dumps(line).encode() + b"\n")
            self.process.popen.stdin.flush()
        except (OSError, ValueError):
            pass  # it exited: _answer says how
        return self._answer(timeout)

    def set_mode(self, mode: str, latency_ms: int = 0) -> dict:
        """Switches the mode (see the module docs); returns once it applies to every connection."""
        check_mode(mode, latency_ms)
        return self._call({"mode": mode, "latency_ms": latency_ms})

    def stats(self) -> dict:
        return self._call({"stats": True})

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        """Closes its stdin (it exits), then stops it by its PID if it lingers."""
        if self.process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.process.popen.stdin.close()
        self.process.wait(2.0)
        self.process.stop()
        self.process = None


def main() -> int:
    """The child process: serves until stdin closes; one JSON answer line per control line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--upstream-host", default=HOST)
    args = parser.parse_args()
    proxy = FaultProxy(args.upstream_port, port=args.port, upstream_host=args.upstream_host)

    def say(answer: dict) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    try:
        proxy.start()
    except RuntimeError as error:
        say({"ok": False, "error": str(error)})
        return 1
    say({"ok": True, "ready": True, "port": proxy.port})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                if "mode" in request:
                    answer = proxy.set_mode(str(request["mode"]), int(request.get("latency_ms") or 0))
                else:
                    answer = proxy.stats()
                say({"ok": True, **answer, "at": time.time()})
            except (ValueError, TypeError, RuntimeError) as error:
                say({"ok": False, "error": str(error)})
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
